"""Content keys: a node's key preimage, and the one walk that keys a plan.

A node's key is blake3 of its preimage {action, code_hash, params, inputs, toolchain[, platform]}: its step kind,
the hash of the code it runs (the import closure of its step's module and of the node's `code`, and the step's data
files: qbuild.planning.closures), the node's typed params, its inputs' output digests, the toolchain it runs with (the
installed versions of the third-party distributions that code imports, or the versions a neuron compile pins), and
for a node whose output is not portable, this host's platform tag (qbuild.core.platform). A node is portable when its
step's output is the same on every platform (Step.portable, or for compile and package, the backend's answer) and so
is every input's: a bundle of native graphs is native, and so is the verify report of it. An input's digest is known
only once that input is built, so a walk over the plan takes the upstream digests from a source the caller chooses:
the store (what is built), the lockfile (what was built when the lock was written), or both. A node whose inputs have
no known digest has no key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Mapping

from qbuild.core.platform import host_tag
from qbuild.core.hashing import canonical_json, digest_bytes, digest_json
from qbuild.planning.closures import DEFAULT, Closure, Sources, distribution_versions
from qbuild.planning.dag import Node, Plan
from qbuild.planning.step import Step
from qbuild.recipe.params import to_json
from qbuild.store.manifest import Manifest


# --- the code a node runs ----------------------------------------------------------------------------------------

def closure(step: type[Step], code: tuple[str, ...] = (), sources: Sources = DEFAULT) -> Closure:
    """The import closure of a step's module, with that of each module in `code`: what a node of it runs beyond its
    step's own imports (a backend's implementation, a shard layout's rules), which the step reaches through the
    backend registry and the static walk cannot see."""
    return sources.closure((step.module(), *code))


def code_hash(step: type[Step], code: tuple[str, ...] = (), sources: Sources = DEFAULT) -> str:
    """The hash of the code a node of `step` runs: its closure's modules (qbuild.planning.closures) and the step's data
    files."""
    parts = [sources.digest(closure(step, code, sources))]
    root = sources.root(step.module().split(".")[0])
    for rel in step.data:
        parts.append(f"{rel}:{digest_bytes((root / rel).read_bytes())}")
    return digest_bytes("\n".join(parts).encode())[:32]


def toolchain_versions(step: type[Step], code: tuple[str, ...] = (), sources: Sources = DEFAULT) -> dict[str, str]:
    return distribution_versions(closure(step, code, sources).third_party)


# --- portability -------------------------------------------------------------------------------------------------

def step_portable(node: Node, backends=None) -> bool:
    """Whether `node`'s step, whatever its inputs, writes the same output on every platform (asking `backends` for
    the backend's answer where the step leaves it to the backend)."""
    portable = node.step.portable
    if portable is None:
        assert backends is not None, f"a {node.kind} node is planned with the backends that decide its portability"
        return backends.get(node.params.backend).portable(node.kind)
    return portable


def portability(plan: Plan) -> dict[str, bool]:
    """Node id -> whether the node's output is the same on every platform: its step's is, and every input's."""
    out: dict[str, bool] = {}
    for nid, node in plan.nodes.items():    # topological order: every input is decided first
        out[nid] = step_portable(node, plan.backends) and all(out[dep] for dep in node.deps.values())
    return out


# --- the preimage ----------------------------------------------------------------------------------------------

def preimage(node: Node, inputs: dict[str, str], platform: str | None = None) -> dict:
    """The key preimage of `node` given its inputs' output digests (input name -> digest), and for a node that is
    not portable, the platform tag it is built for (None: a portable node, whose preimage has no platform)."""
    params = to_json(node.params)
    # A node that pins its toolchain is keyed on the pin, never on what this host has installed.
    toolchain = params["toolchain"] if "toolchain" in params else toolchain_versions(node.step, node.code)
    pre = {"action": node.kind, "code_hash": code_hash(node.step, node.code), "params": params, "inputs": inputs,
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
        # A digest or a code hash is named, not shown; a platform tag is read.
        elif isinstance(a, (dict, list)) or isinstance(b, (dict, list)) or \
                (any(isinstance(v, str) and len(v) > 24 for v in (a, b)) and k != "platform"):
            out.append(f"{path} changed")
        else:
            out.append(f"{path}: {a} -> {b}")
    return out


# --- what the lock holds ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LockedNode:
    """What the lockfile holds for a node (qbuild.planning.lock.NodeEntry.locked): its key, the key's preimage, and
    the digest of its output tree."""

    key: str
    preimage: dict
    digest: str

    @property
    def platform(self) -> str | None:
        """The platform the node was built for; None for a portable node (its preimage names none)."""
        return self.preimage.get("platform")

    def digest_under(self, key: str) -> str | None:
        """The output a result under `key` must have: the locked digest where `key` is the locked key, else None."""
        return self.digest if key == self.key else None


def other_bytes(name: str, how: str, manifest: Manifest, locked_digest: str | None) -> str | None:
    """Why `manifest`, the result of node `name` (`how`: "built" or "cached"), must not be accepted: the lock holds
    `locked_digest` as the output under its key (LockedNode.digest_under), and its own digest is another (an input
    changed outside the key, or a store or remote holds other bytes under it). None where it may be accepted."""
    if locked_digest is None or manifest.digest == locked_digest:
        return None
    return (f"{name}: the {how} output {manifest.digest[:12]} differs from the locked {locked_digest[:12]} under "
            f"the same key {manifest.key[:16]}: an input changed outside the key, or the store or remote holds other "
            "bytes under it; refusing it (run `qbuild compile --update` to accept it)")


# --- the walk ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class NodeKey:
    """A node's key as a walk found it: None where some inputs' digests are unknown (named in `unknown`)."""

    preimage: dict | None
    key: str | None
    digest: str | None          # the node's own output digest, from the walk's source; None: unknown
    unknown: tuple[str, ...]    # input names whose digests the source did not know


def key_node(node: Node, digests: Mapping[str, str], platform: str | None = None) -> NodeKey:
    """`node`'s preimage and key, given the output digests known so far (node id -> digest) and, for a node that is
    not portable (see portability), the platform tag it is built for."""
    unknown = tuple(sorted(name for name, dep in node.deps.items() if dep not in digests))
    if unknown:
        return NodeKey(None, None, None, unknown)
    pre = preimage(node, {name: digests[dep] for name, dep in node.deps.items()}, platform)
    return NodeKey(pre, key_of(pre), None, ())


# (node id, the node's key) -> the node's output digest, or None where the source does not know it
DigestSource = Callable[[str, str], "str | None"]


class PlanKeys:
    """Keys the nodes of one plan as their inputs' digests become known, one node at a time: the rule walk() applies
    in one pass, and the engine step by step as steps are cached or built. A node that is not portable is keyed for
    the platform `host()` names, asked only once such a node is keyed."""

    def __init__(self, plan: Plan, host: Callable[[], str] = host_tag):
        self.plan = plan
        self.host = host
        self.portable = portability(plan)

    def key(self, nid: str, digests: Mapping[str, str]) -> NodeKey:
        """Node `nid`'s key given the output digests known so far (node id -> digest)."""
        node = self.plan.nodes[nid]
        tag = None if self.portable[nid] or any(d not in digests for d in node.deps.values()) else self.host()
        return key_node(node, digests, tag)


def walk(plan: Plan, source: DigestSource, host: Callable[[], str] = host_tag) -> dict[str, NodeKey]:
    """Key every node of `plan` in topological order (PlanKeys), taking each keyed node's output digest from
    `source`."""
    keys = PlanKeys(plan, host)
    digests: dict[str, str] = {}
    out: dict[str, NodeKey] = {}
    for nid in plan.nodes:
        nk = keys.key(nid, digests)
        if nk.key is not None:
            digest = source(nid, nk.key)
            if digest is not None:
                digests[nid] = digest
                nk = NodeKey(nk.preimage, nk.key, digest, ())
        out[nid] = nk
    return out
