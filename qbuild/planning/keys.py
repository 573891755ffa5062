"""Content keys: the action specs, a node's key preimage, and the one walk that keys a plan.

A node's key is blake3 of its preimage {action, version, params, inputs, toolchain[, platform]}: the action's kind
and source hash, the node's allow-listed params, its inputs' output digests, the toolchain it runs with, and for a
node whose output is not portable, this host's platform tag (qbuild.core.platform). A node is portable when its
action's output is the same on every platform (ActionSpec.portable, or for compile and package, the backend's
answer) and so is every input's: a bundle of native graphs is native, and so is the verify report of it. An input's
digest is known only once that input is built, so a walk over the plan takes the upstream digests from a source
the caller chooses: the store (what is built), the lockfile (what was built when the lock was written), or both.
A node whose inputs have no known digest has no key.

The preimage's "version" field holds the source hash; its name is in every lockfile and key, so it stays.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Callable, Mapping, Protocol

from qbuild import backends
from qbuild.core.platform import host_tag
from qbuild.core.hashing import canonical_json, digest_bytes, digest_json
from qbuild.recipe.params import to_json


class Node(Protocol):
    """What keying reads of a plan node (qbuild.planning.plan.Node, which imports this module)."""

    kind: str
    params: object
    deps: dict[str, str]


class Plan(Protocol):
    nodes: dict[str, Node]


@dataclass(frozen=True)
class ActionSpec:
    kind: str
    entry: str                                 # "package.module:function", called as function(ctx)
    sources: tuple[str, ...]                   # modules or packages whose source files are hashed into keys
    toolchain: tuple[str, ...] = ()            # distributions whose installed versions are hashed into keys
    optional_toolchain: tuple[str, ...] = ()   # the same, where installed (e.g. the Neuron SDK)
    # Whether the output is the same on every platform (machine, libc, Python, torch's CPU kernels); None: the
    # backend the node's params name decides (Backend.portable).
    portable: bool | None = True

    @property
    def source_hash(self) -> str:
        return _source_hash(self.sources)

    def toolchain_versions(self) -> dict[str, str]:
        return _toolchain(self.toolchain, self.optional_toolchain)


Registry = Mapping[str, ActionSpec]           # kind -> spec


@cache
def _source_files(name: str) -> list[Path]:
    """The files of module or package `name`, found without importing it or its parents: find_spec of a submodule
    imports its package, and qbuild.model.convert's imports torch, which planning must not."""
    top, *rest = name.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or spec.origin is None:
        raise ValueError(f"action source {name!r} is not importable")
    path = Path(spec.origin)
    for part in rest:
        if path.name != "__init__.py":
            raise ValueError(f"action source {name!r} is not importable")
        package, module = path.parent / part / "__init__.py", path.parent / f"{part}.py"
        path = package if package.is_file() else module
        if not path.is_file():
            raise ValueError(f"action source {name!r} is not importable")
    if path.name == "__init__.py":
        return sorted(path.parent.rglob("*.py"))
    return [path]


@cache
def _source_hash(sources: tuple[str, ...]) -> str:
    parts = []
    for name in sources:
        for path in _source_files(name):
            parts.append(f"{name}:{path.name}:{_file_digest(path)}")
    return digest_bytes("\n".join(sorted(parts)).encode())[:32]


@cache
def _file_digest(path: Path) -> str:
    """Most actions share modules (families, arch, convert): each file is read and hashed once per process."""
    return digest_bytes(path.read_bytes())


@cache
def _toolchain(required: tuple[str, ...], optional: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for dist in required + optional:
        try:
            out[dist] = _installed_version(dist)
        except importlib.metadata.PackageNotFoundError:
            if dist in required:
                out[dist] = "absent"
    return out


@cache
def _installed_version(name: str) -> str:
    """importlib.metadata.version(name), without parsing the whole METADATA file as an email message (which took
    most of a plan's keying time): the Version field is one line of the header block, before the first empty line."""
    dist = importlib.metadata.distribution(name)
    for line in (dist.read_text("METADATA") or dist.read_text("PKG-INFO") or "").splitlines():
        if not line:
            break
        if line.startswith("Version:"):
            return line.removeprefix("Version:").strip()
    return dist.version


_SRC = "qbuild.build.actions"
# The backends an action asks through qbuild.backends.get (compile, package, verify, and the neuron port's params),
# with the recipe modules the backends import.
_BACKENDS = ("qbuild.backends", "qbuild.recipe.params", "qbuild.recipe.schema", "qbuild.recipe.checks")
_MODEL = ("qbuild.model.families", "qbuild.model.fp8", "qbuild.model.arch")
# An action runs the function `entry` names (imported only in the worker, so planning stays light); the source it
# is made of is hashed into every key it produces, so editing a converter rebuilds conversions and nothing else.
REGISTRY: dict[str, ActionSpec] = {spec.kind: spec for spec in (
    ActionSpec("fetch", f"{_SRC}.fetch:run", (f"{_SRC}.fetch",), ("huggingface_hub",)),
    ActionSpec("port", f"{_SRC}.port:run", (f"{_SRC}.port", *_BACKENDS)),
    ActionSpec("convert", f"{_SRC}.convert:run", (f"{_SRC}.convert", "qbuild.model.convert", *_MODEL),
               ("safetensors", "torch")),
    ActionSpec("shard", f"{_SRC}.shard:run", (f"{_SRC}.shard", "qbuild.model.convert", *_MODEL),
               ("safetensors", "torch")),
    # A neuron compile pins its toolchain in its params (the recipe's `toolchain`), which then replaces these.
    ActionSpec("compile", f"{_SRC}.compile:run", (f"{_SRC}.compile", *_BACKENDS, "qbuild.model.modeling",
                                                  "qbuild.model.kernels", *_MODEL), ("torch",), portable=None),
    ActionSpec("package", f"{_SRC}.package:run", (f"{_SRC}.package", *_BACKENDS, "qbuild.store.bundle",
                                                  "qbuild.store.files", *_MODEL, "qbuild.model.convert.hybrid"),
               portable=None),
    # Logits computed with torch's vectorised CPU kernels, whose last bits depend on the capability they run with.
    ActionSpec("reference", f"{_SRC}.reference:run", (f"{_SRC}.reference", "qbuild.model.families",
                                                      "qbuild.core.numerics"), ("torch", "transformers"),
               portable=False),
    ActionSpec("verify", f"{_SRC}.verify:run", (f"{_SRC}.verify", *_BACKENDS, "qbuild.model.runtime",
                                                "qbuild.model.modeling", "qbuild.model.kernels", *_MODEL,
                                                "qbuild.model.convert", "qbuild.core.numerics"), ("torch",),
               portable=False),
)}


# --- portability -------------------------------------------------------------------------------------------------

def action_portable(node: Node, registry: Registry = REGISTRY) -> bool:
    """Whether `node`'s action, whatever its inputs, writes the same output on every platform."""
    portable = registry[node.kind].portable
    if portable is None:
        return backends.get(node.params.backend).portable(node.kind)
    return portable


def portability(plan: Plan, registry: Registry = REGISTRY) -> dict[str, bool]:
    """Node id -> whether the node's output is the same on every platform: its action's is, and every input's."""
    out: dict[str, bool] = {}
    for nid, node in plan.nodes.items():    # topological order: every input is decided first
        out[nid] = action_portable(node, registry) and all(out[dep] for dep in node.deps.values())
    return out


# --- the preimage ----------------------------------------------------------------------------------------------

def preimage(node: Node, inputs: dict[str, str], registry: Registry = REGISTRY, platform: str | None = None) -> dict:
    """The key preimage of `node` given its inputs' output digests (input name -> digest), and for a node that is
    not portable, the platform tag it is built for (None: a portable node, whose preimage has no platform)."""
    spec = registry[node.kind]
    params = to_json(node.params)
    # A node that pins its toolchain (a neuron compile) is keyed on the pin, never on what this host has installed.
    toolchain = params["toolchain"] if "toolchain" in params else spec.toolchain_versions()
    pre = {"action": node.kind, "version": spec.source_hash, "params": params, "inputs": inputs,
           "toolchain": toolchain}
    if platform is not None:
        pre["platform"] = platform
    return pre


def key_of(pre: dict) -> str:
    return digest_json(pre)


def as_locked(pre: dict) -> dict:
    """A preimage as the lockfile holds it (read back from JSON: tuples are lists), to compare with a locked one."""
    return json.loads(canonical_json(pre))


def diff_preimages(old: dict, new: dict, prefix: str = "") -> list[str]:
    """The dotted fields whose values differ between two preimages, with old -> new for scalars."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b, path = old.get(k), new.get(k), f"{prefix}{k}"
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out += diff_preimages(a, b, path + ".")
        elif isinstance(a, (dict, list)) or isinstance(b, (dict, list)) or \
                (isinstance(a, str) and len(a) > 24 and k != "platform"):   # digests; a platform tag is read
            out.append(f"{path} changed")
        else:
            out.append(f"{path}: {a} -> {b}")
    return out


# --- the walk ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class NodeKey:
    """A node's key as a walk found it: None where some inputs' digests are unknown (named in `unknown`)."""

    preimage: dict | None
    key: str | None
    digest: str | None          # the node's own output digest, from the walk's source; None: unknown
    unknown: tuple[str, ...]    # input names whose digests the source did not know


def key_node(node: Node, digests: Mapping[str, str], registry: Registry = REGISTRY,
             platform: str | None = None) -> NodeKey:
    """`node`'s preimage and key, given the output digests known so far (node id -> digest) and, for a node that is
    not portable (see portability), the platform tag it is built for."""
    unknown = tuple(sorted(name for name, dep in node.deps.items() if dep not in digests))
    if unknown:
        return NodeKey(None, None, None, unknown)
    pre = preimage(node, {name: digests[dep] for name, dep in node.deps.items()}, registry, platform)
    return NodeKey(pre, key_of(pre), None, ())


# (node id, the node's key) -> the node's output digest, or None where the source does not know it
DigestSource = Callable[[str, str], "str | None"]


def walk(plan: Plan, source: DigestSource, registry: Registry = REGISTRY,
         host: Callable[[], str] = host_tag) -> dict[str, NodeKey]:
    """Key every node of `plan` in topological order, taking each keyed node's output digest from `source`; nodes
    that are not portable are keyed for the platform `host()` names (asked only once such a node is keyed)."""
    digests: dict[str, str] = {}
    out: dict[str, NodeKey] = {}
    portable = portability(plan, registry)
    for nid, node in plan.nodes.items():
        tag = None if portable[nid] or any(d not in digests for d in node.deps.values()) else host()
        nk = key_node(node, digests, registry, tag)
        if nk.key is not None:
            digest = source(nid, nk.key)
            if digest is not None:
                digests[nid] = digest
                nk = NodeKey(nk.preimage, nk.key, digest, ())
        out[nid] = nk
    return out
