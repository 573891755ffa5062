"""artifacts.lock: what each recipe resolved to and produced, as one typed model, and everything done with it.

This module owns the lockfile: its model (Lock, RecipeEntry, NodeEntry, ModelEntry, PortEntry), reading it (the
shape checked by pydantic, then its consistency), the verdicts of a plan against it, the entries a build writes,
merging them in, and the one canonical serialisation. Every command that reads a lockfile takes a `Lock` from `read`.

    {"version": 2,
     "recipes": {name: {"recipe": path, "model": model, "nodes": {role: node id},
                        "bundle": tree digest of the package output, or null (pinned, not built),
                        "verified": whether the entry holds its verify node,
                        "verify_failure": why the bundle is not verified (only where a build said why),
                        "port": {url, rev, subdir (a git port), digest: its files' tree digest} (neuron recipes)}},
     "nodes": {node id: {"kind", "key", "preimage", "digest", "outputs": {path: {digest, size}}}}}

A recipe's model is {"source": "path", "revision": null, "files": {name: digest}} for a local checkpoint, and for a
hub model its pin: {"source": "hf", "repo", "requested": the recipe's revision, "revision": the commit it is pinned
to, "files": the built snapshot's digests, empty until that commit is fetched}. Planning keys a hub fetch on the pin
while the recipe asks for the same repo and revision; `qbuild lock update` moves pins, and nothing else does.

A recipe's `recipe` path is relative to the lockfile's directory (absolute when the file lies outside it), and
recipe names are unique per lockfile. A node entry holds nothing but what its key and output are: its kind, key,
the key's preimage (params, input digests, code hash, toolchain, and for an output that is not portable the
platform it was built for, so `qbuild explain` can name the field that changed), its output digest and files. No
recipe's name is in it, so a step two recipes share is one entry whoever built it (version 1 held the plan's display
name, which named whichever recipe planned it first: the lock changed with the order recipes were built).

The laws merging obeys (tests/test_lock_model.py holds them as properties):
- an entry is complete or absent: a recipe is written once its build is over (every step built, cached, failed or
  skipped), from that build's results alone, and never again by a build that did not finish it;
- `verified` is true exactly when the entry holds its verify node, which exists only where the verify step passed;
- merging what a lock already holds changes nothing, byte for byte;
- writing some recipes never drops another recipe's entry, nor changes what its roles resolve to: where a step it
  shares is written again with another output, it keeps its own under `<node id>@<12 hex of that entry's digest>`;
- the result depends neither on the order steps finish nor on the order recipes are named or built.
Every Lock this module writes agrees with itself (`problem`); `read` refuses one that does not, so no command acts on
it. Writes go through an atomic rename under an flock of the lockfile's directory, merged with what other processes
wrote meanwhile.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Iterable, Iterator, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from qbuild.core import jsonio
from qbuild.core.errors import BuildError, InfraError, UserError
from qbuild.core.hashing import digest_json, is_commit
from qbuild.core.platform import host_tag
from qbuild.core.urls import carries_credentials
from qbuild.core.userfile import read_small_file
from qbuild.planning.dag import Node, Plan, PlannedRecipe
from qbuild.planning.graph import upstream
from qbuild.planning.keys import LockedNode, as_locked, diff_preimages, key_of, walk
from qbuild.planning.plan import HubPin
from qbuild.planning.step import LockedFiles
from qbuild.recipe.params import FetchHub, to_json
from qbuild.recipe.schema import LoadedRecipe, load_recipe
from qbuild.core.files import atomic_write
from qbuild.store.manifest import Manifest, tree_digest

LOCK_VERSION = 2
MAX_LOCK_BYTES = 256 << 20   # a lockfile of every shipped recipe is a few hundred KiB

Digest = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]      # blake3, hex
Name = Annotated[str, Field(min_length=1)]


class _Entry(BaseModel):
    # Built on first use, not at import: planning imports this module, and most commands read one small lockfile.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, defer_build=True)


def _absent_if_none(field_default=None):
    """An optional field the file leaves out where it is None."""
    return Field(field_default, exclude_if=lambda v: v is None)


# --- the model ---------------------------------------------------------------------------------------------------

class Output(_Entry):
    digest: Digest
    size: Annotated[int, Field(ge=0)]


class NodeEntry(_Entry):
    """A built step: its kind, its key and the key's preimage, its output's tree digest and files."""

    kind: Name
    key: Digest
    preimage: dict[str, Any]
    digest: Digest
    outputs: dict[Name, Output]

    @field_validator("preimage")
    @classmethod
    def _inputs_are_digests(cls, pre: dict[str, Any]) -> dict[str, Any]:
        inputs = pre.get("inputs", {})
        if not isinstance(inputs, dict) or not all(isinstance(d, str) and re.fullmatch(r"[0-9a-f]{64}", d)
                                                   for d in inputs.values()):
            raise ValueError("inputs: expected an object of digests")
        return pre

    @classmethod
    def of(cls, kind: str, manifest: Manifest) -> NodeEntry:
        return cls(kind=kind, key=manifest.key, preimage=manifest.preimage, digest=manifest.digest,
                   outputs={rel: Output(**meta) for rel, meta in manifest.outputs.items()})

    @property
    def locked(self) -> LockedNode:
        return LockedNode(self.key, self.preimage, self.digest)

    def outputs_json(self) -> dict[str, dict]:
        """The outputs as a manifest records them."""
        return {rel: {"digest": o.digest, "size": o.size} for rel, o in self.outputs.items()}


class ModelEntry(_Entry):
    source: Literal["path", "hf"]
    revision: str | None
    files: dict[Name, Name]             # "blake3:<hex>" of a local file; a Hub file's own ("git-sha1:...")
    repo: str | None = _absent_if_none()        # hf only
    requested: str | None = _absent_if_none()   # hf only

    @property
    def pin(self) -> HubPin | None:
        """The hub pin this model holds: a repo, the revision asked for and the commit it is pinned to."""
        if self.source != "hf" or self.repo is None or self.requested is None or not is_commit(self.revision):
            return None
        return HubPin(self.repo, self.requested, self.revision)

    @classmethod
    def pinned(cls, pin: HubPin, files: Mapping[str, str] | None = None) -> ModelEntry:
        return cls(source="hf", repo=pin.repo, requested=pin.requested, revision=pin.revision,
                   files=dict(sorted((files or {}).items())))


class PortEntry(_Entry):
    url: str | None = _absent_if_none()         # a git port's url, rev and subdir
    rev: str | None = _absent_if_none()
    subdir: str | None = _absent_if_none()
    digest: Digest


class RecipeEntry(_Entry):
    recipe: Name
    model: ModelEntry
    nodes: dict[Name, Name]             # role -> node id
    bundle: Digest | None
    verified: bool
    verify_failure: str | None = _absent_if_none()
    port: PortEntry | None = _absent_if_none()

    @classmethod
    def pinned_only(cls, recipe: str, model: ModelEntry) -> RecipeEntry:
        """A recipe `qbuild lock update` pinned before any build of it."""
        return cls(recipe=recipe, model=model, nodes={}, bundle=None, verified=False)


class Lock(_Entry):
    version: Literal[2] = LOCK_VERSION
    recipes: dict[Name, RecipeEntry] = {}
    nodes: dict[Name, NodeEntry] = {}

    # --- reading ---
    def node(self, name: str, role: str) -> NodeEntry | None:
        """The node a recipe's role names (None where the recipe or the role is not locked)."""
        nid = self.recipes[name].nodes.get(role) if name in self.recipes else None
        return self.nodes.get(nid) if nid is not None else None

    def resolved(self, name: str) -> dict[str, NodeEntry]:
        """role -> node entry of a recipe: what its roles resolve to, whatever ids they are kept under."""
        return {role: self.nodes[nid] for role, nid in self.recipes[name].nodes.items()}

    def hub_pins(self) -> dict[str, HubPin]:
        """recipe name -> its hub pin, for each locked recipe whose model is pinned to a commit."""
        return {name: pin for name, e in sorted(self.recipes.items()) if (pin := e.model.pin) is not None}

    def keys(self) -> set[str]:
        """The keys of every node the lock names: what `qbuild gc` keeps."""
        return {node.key for node in self.nodes.values()}

    # --- writing ---
    def to_json(self) -> dict:
        return self.model_dump(mode="json")

    def dumps(self) -> str:
        """The canonical file: sorted keys, indented, one trailing newline. Refuses a lock that disagrees with
        itself: no such lock is ever written."""
        problem = first_inconsistency(self)
        if problem is not None:
            raise AssertionError(f"refusing to write a lockfile that disagrees with itself: {problem}")
        return jsonio.dumps(self.to_json(), indent=2, sort_keys=True) + "\n"


# --- reading a file ----------------------------------------------------------------------------------------------

def read(path: Path) -> Lock:
    """The lockfile at `path` (an empty Lock where there is none). UserError, one line naming the file and the JSON
    path, for a document of the wrong shape or one that disagrees with itself. A version 1 file is read as version 2
    (its nodes' display names dropped) and written as version 2 by the next build that changes it."""
    if not path.exists() and not path.is_symlink():
        return Lock()
    return parse(read_small_file(path, MAX_LOCK_BYTES, "the lockfile"), path)


def parse(data: bytes, path: Path) -> Lock:
    try:
        doc = json.loads(data)
    except ValueError as e:   # invalid JSON or not UTF-8
        raise UserError(f"{path}: unreadable lockfile: {e}") from None
    if not isinstance(doc, dict):
        raise UserError(f"{path}: not a lockfile (expected a JSON object)")
    version = doc.get("version")
    if version == 1 and not isinstance(version, bool):
        doc = _from_version_1(doc)
    elif version != LOCK_VERSION or isinstance(version, bool):
        raise UserError(f"{path}: lockfile version {version!r}; this qbuild reads {LOCK_VERSION} (and 1)")
    try:
        lock = Lock.model_validate(doc)
    except ValidationError as e:
        err = e.errors()[0]
        raise UserError(f"{path}: {json_path(err['loc'])}: {_message(err)}; not a lockfile qbuild writes: fix it, "
                        "or delete it and run `qbuild compile`") from None
    problem = first_inconsistency(lock)
    if problem is not None:
        raise UserError(f"{path}: {problem}; the lockfile disagrees with itself: restore it from version control, or "
                        "delete the recipe's entry and run `qbuild compile`")
    return lock


def _from_version_1(doc: dict) -> dict:
    """A version 1 document as version 2: the same entries, each node without the display name it carried, and an
    entry a build left without a bundle (an older qbuild locked failed builds) kept as the pin it holds."""
    nodes, recipes = doc.get("nodes"), doc.get("recipes")
    if isinstance(nodes, dict):
        nodes = {nid: {k: v for k, v in n.items() if k != "name"} if isinstance(n, dict) else n
                 for nid, n in nodes.items()}
    if isinstance(recipes, dict):
        recipes = {name: {**e, "nodes": {}, "verified": False} if isinstance(e, dict) and e.get("bundle") is None
                   else e for name, e in recipes.items()}
    return {**doc, "version": LOCK_VERSION, "recipes": recipes, "nodes": nodes}


def json_path(loc) -> str:
    """A pydantic error location as a JSON path: $.recipes.alpha.nodes["compile cte-32"]."""
    out = "$"
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[\w-]+", part):
            out += f".{part}"
        else:
            out += '["' + part.replace("\\", "\\\\").replace('"', '\\"') + '"]'
    return out


_EXPECTED = {"dict_type": "expected an object", "model_type": "expected an object", "string_type": "expected a string",
             "int_type": "expected an integer", "bool_type": "expected true or false",
             "literal_error": "expected one of its values", "greater_than_equal": "expected a size (0 or more)",
             "string_too_short": "expected a non-empty string"}


def _message(err: dict) -> str:
    if err["type"] == "extra_forbidden":
        return "unknown field"
    if err["type"] == "missing":
        return "missing"
    if err["type"] == "value_error":
        return str(err["ctx"]["error"])
    if err["type"] == "string_pattern_mismatch":
        expected = f"expected a string matching {err['ctx']['pattern']}"
    else:
        expected = _EXPECTED.get(err["type"], err["msg"])
    got = err.get("input")
    shown = "null" if got is None else "true" if got is True else "false" if got is False else \
        "a list" if isinstance(got, list) else "an object" if isinstance(got, dict) else repr(got)[:40]
    return f"{expected}, got {shown}"


# --- consistency -------------------------------------------------------------------------------------------------

def first_inconsistency(lock: Lock) -> str | None:
    """The first way the lock disagrees with itself, as a line starting with a JSON path: the nodes first, then each
    recipe entry in name order. None where it agrees.

    Per node: its key is the digest of its preimage, its digest the tree digest of its outputs, and no URL in its
    params carries credentials. Per recipe entry: every node id it names is in `nodes` and is a node of its role's
    kind; each input a node's preimage names is the output of a node of the same recipe (so the entry holds every step
    its bundle was built from, and none of another recipe's); a named bundle is its package node's output; `verified`
    is whether it holds its verify node, which took that bundle; a port entry is its port node's. A lock that passes
    names, for each recipe, one bundle and the steps that made it: what `pull` lays out is what was built, verified,
    for that recipe."""
    for nid, node in sorted(lock.nodes.items()):
        problem = _node_problem(json_path(("nodes", nid)), node)
        if problem:
            return problem
    for name, entry in sorted(lock.recipes.items()):
        problem = _entry_problem(lock, name, entry)
        if problem:
            return problem
    return None


def _node_problem(where: str, node: NodeEntry) -> str | None:
    if digest_json(node.preimage) != node.key:
        return f"{where}.key: is not the digest of the node's preimage"
    if tree_digest(node.outputs_json()) != node.digest:
        return f"{where}.digest: is not the tree digest of the node's outputs"
    params = node.preimage.get("params")
    if isinstance(params, dict) and isinstance(params.get("url"), str) and carries_credentials(params["url"]):
        return f"{where}.preimage.params.url: carries credentials, which no lockfile may hold"
    return None


def _entry_problem(lock: Lock, name: str, entry: RecipeEntry) -> str | None:
    """The first way one recipe entry disagrees with the lock's nodes, as a line starting with a JSON path; None
    where it agrees."""
    nodes: dict[str, NodeEntry] = {}
    for role, nid in sorted(entry.nodes.items()):
        node = lock.nodes.get(nid)
        if node is None:
            return f"{json_path(('recipes', name, 'nodes', role))}: node {nid} is not in $.nodes"
        if node.kind != role.split(" ", 1)[0]:
            return f"{json_path(('recipes', name, 'nodes', role))}: node {nid} is a {node.kind} node"
        nodes[role] = node
    problem = _bundle_problem(json_path(("recipes", name)), entry, nodes)
    if problem:
        return problem
    outputs = {node.digest for node in nodes.values()}
    for role, node in sorted(nodes.items()):
        for input_name, digest in sorted(node.preimage.get("inputs", {}).items()):
            if digest not in outputs:
                return (f"{json_path(('recipes', name, 'nodes', role))}: its input {input_name} ({digest[:16]}) is "
                        f"the output of none of {name}'s nodes")
    return None


def _bundle_problem(where: str, entry: RecipeEntry, nodes: dict[str, NodeEntry]) -> str | None:
    bundle, package, verify = entry.bundle, nodes.get("package"), nodes.get("verify")
    if bundle is not None and package is None:
        return f"{where}.bundle: names a bundle, but the entry has no package node"
    if bundle is None and nodes:
        return f"{where}.bundle: null, but the entry names the steps of a build"
    if bundle is not None and package.digest != bundle:
        return (f"{where}.bundle: {bundle[:16]} is not the output of its package node "
                f"({entry.nodes['package']}: {package.digest[:16]})")
    if entry.verified and verify is None:
        return f"{where}.verified: true, but the entry has {'no bundle' if bundle is None else 'no verify node'}"
    if not entry.verified and verify is not None:
        return f"{where}.verified: false, but the entry holds its verify node"
    if verify is not None and bundle not in verify.preimage.get("inputs", {}).values():
        return f"{where}.nodes.verify: {entry.nodes['verify']} did not verify the bundle {bundle[:16]}"
    if entry.port is not None:
        return _port_problem(where, entry.port, nodes.get("port"))
    return None


def _port_problem(where: str, port: PortEntry, node: NodeEntry | None) -> str | None:
    if node is None or node.digest != port.digest:
        return f"{where}.port.digest: is not the output of the entry's port node"
    if port.url is not None and carries_credentials(port.url):
        return f"{where}.port.url: carries credentials, which no lockfile may hold"
    params = node.preimage.get("params")
    params = params if isinstance(params, dict) else {}
    if any(getattr(port, k) != params.get(k) for k in ("url", "rev", "subdir")):
        return f"{where}.port: url, rev and subdir are not its port node's"
    return None


# --- merging -----------------------------------------------------------------------------------------------------

def merge(lock: Lock, written: Lock) -> Lock:
    """`lock` with the recipe entries of `written` (a Lock of the recipes a build finished, and their nodes) in
    place of its own, and the nodes no recipe names any more dropped. A recipe `written` does not hold keeps its
    entry; where it shares a step whose node `written` replaces by another entry (built again into another output),
    it keeps its own under `<node id>@<12 hex of that entry's digest>`, so what each role resolves to stays."""
    nodes = dict(lock.nodes)
    recipes = {}
    for name, entry in lock.recipes.items():
        if name not in written.recipes:
            recipes[name] = _kept_apart(entry, lock.nodes, written.nodes, nodes)
    recipes.update(written.recipes)
    nodes.update(written.nodes)
    live = {nid for entry in recipes.values() for nid in entry.nodes.values()}
    return Lock(recipes=recipes, nodes={nid: n for nid, n in nodes.items() if nid in live})


def _kept_apart(entry: RecipeEntry, old: Mapping[str, NodeEntry], new: Mapping[str, NodeEntry],
                out: dict[str, NodeEntry]) -> RecipeEntry:
    moved = {role: nid for role, nid in entry.nodes.items() if nid in new and new[nid] != old[nid]}
    if not moved:
        return entry
    roles = dict(entry.nodes)
    for role, nid in moved.items():
        roles[role] = f"{nid.partition('@')[0]}@{old[nid].digest[:12]}"
        out[roles[role]] = old[nid]
    return entry.model_copy(update={"nodes": roles})


def first_difference(old: Lock, new: Lock) -> str | None:
    """The first entry and field where two locks differ, the recipe entries before the nodes they name:
    "recipes.alpha.verified: true -> false", "nodes.3f2a...: added"; None where they write the same file."""
    a, b = old.to_json(), new.to_json()
    for part in ("version", "recipes", "nodes"):
        found = _first_difference(a[part], b[part], part)
        if found:
            return found
    return None


def _first_difference(a, b, path: str) -> str | None:
    if a == b:
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            where = f"{path}.{k}" if path else k
            if k not in a:
                return f"{where}: added"
            if k not in b:
                return f"{where}: removed"
            found = _first_difference(a[k], b[k], where)
            if found:
                return found
        return None

    def shown(v) -> str:
        if isinstance(v, str) and len(v) > 24:     # a digest or a key: its prefix names it
            return v[:16] + "..."
        text = json.dumps(v, sort_keys=True)
        return text[:40] + "..." if len(text) > 48 else text
    return f"{path}: {shown(a)} -> {shown(b)}"


# --- the file on disk --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ReadLock:
    """A lockfile as a command read it: the Lock, and the file's identity taken just before the read (None where
    there was no file), by which a later write knows whether the file is still what was read."""

    lock: Lock
    signature: tuple[int, int, int, int] | None

    @classmethod
    def of(cls, path: Path) -> ReadLock:
        signature = _signature(path)     # before the read: a change after it shows as another signature
        return cls(read(path), signature)


def _signature(path: Path) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def write(path: Path, written: Lock, read_as: ReadLock | None = None) -> bool:
    """Merge `written` into the lockfile at `path`, atomically, under the flock of its directory; returns whether
    the file changed. Nothing is written where the merge changes nothing (nor where `written` is empty). `read_as`:
    the lockfile as this command read it; while the file is still that one, a merge that changes nothing is known
    without taking the flock or reading the file again."""
    if not written.recipes:
        return False
    if read_as is not None and read_as.signature is not None and merge(read_as.lock, written) == read_as.lock \
            and _signature(path) == read_as.signature:
        return False
    with directory_locked(path.parent):
        old = read(path)
        new = merge(old, written)
        if new == old and path.exists():
            return False
        atomic_write(path, new.dumps().encode())
        return True


def set_pins(path: Path, pins: Mapping[str, tuple[str, HubPin]]) -> tuple[Lock, dict[str, HubPin | None]]:
    """Write hub pins (recipe name -> (its recipe file as recorded in the lock, its pin)) into the lockfile on disk,
    atomically, and nothing else: a locked recipe keeps its nodes, bundle and verify state, and its model's file
    digests where the commit did not move; a recipe the lock does not hold gets an entry with its pin only.
    Returns the lock written, and recipe name -> the pin it had before (None: none)."""
    with directory_locked(path.parent):
        old = read(path)
        before = old.hub_pins()
        recipes = {}
        for name, (recipe_path, pin) in sorted(pins.items()):
            kept = old.recipes[name].model.files if name in old.recipes and before.get(name) == pin else None
            model = ModelEntry.pinned(pin, kept)
            entry = old.recipes.get(name)
            recipes[name] = RecipeEntry.pinned_only(recipe_path, model) if entry is None else \
                entry.model_copy(update={"model": model})
        new = merge(old, Lock(recipes=recipes, nodes={nid: n for nid, n in old.nodes.items()
                                                      if any(nid in e.nodes.values() for e in recipes.values())}))
        if new != old or not path.exists():
            atomic_write(path, new.dumps().encode())
    return new, {name: before.get(name) for name in pins}


@contextmanager
def directory_locked(directory: Path) -> Iterator[None]:
    """Hold an exclusive flock of `directory` itself: it serialises the writers of the lockfiles in it and, unlike a
    lock file beside artifacts.lock, leaves nothing in the working tree (the kernel drops it with the process)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory, os.O_RDONLY)
    except OSError as e:
        raise InfraError(f"{directory}: cannot lock the lockfile's directory: {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def referenced_keys(paths: Iterable[Path]) -> set[str]:
    """The keys every lockfile at `paths` names: what `qbuild gc` keeps. UserError for one that is not there: read as
    empty, it would keep nothing."""
    keys: set[str] = set()
    for path in paths:
        if not os.path.lexists(path):
            raise UserError(f"{path}: no such lockfile; gc keeps only what lockfiles reference, so it needs them")
        keys |= read(path).keys()
    return keys


# --- recipes and their files -------------------------------------------------------------------------------------

def recorded_path(path: Path, lock_path: Path) -> str:
    """A recipe file as the lock records it: relative to the lockfile's directory (absolute when outside it), so it
    names the same file from any working directory."""
    try:
        return path.resolve().relative_to(lock_path.parent.resolve()).as_posix()
    except ValueError:
        return path.resolve().as_posix()


def recipe_file(entry: RecipeEntry, lock_path: Path) -> Path:
    """The recipe file a lock entry recorded (relative to the lockfile's directory, or absolute)."""
    return (lock_path.parent.resolve() / entry.recipe).resolve()


def resolve_recipe(lock: Lock, lock_path: Path, arg: str) -> str:
    """The locked recipe a command-line argument names: a recipe name, or a recipe file written any way `compile`
    accepts it (relative to the working directory, absolute, through ../), matched by the file it resolves to.
    Every command that takes a recipe of the lockfile (publish, pull, run, bench, serve, lock check) resolves it
    here."""
    if arg in lock.recipes:
        return arg
    target = Path(arg).resolve()
    for name, entry in sorted(lock.recipes.items()):
        if recipe_file(entry, lock_path) == target:
            return name
    known = ", ".join(sorted(lock.recipes)) or "none"
    raise UserError(f"{lock_path}: recipe {arg!r} is not in the lockfile (locked: {known})")


def recipe_names(lock: Lock, lock_path: Path, recipes: list[str], all_: bool) -> list[str]:
    """Lock entries named by recipe name or recipe file (resolve_recipe); --all takes every one."""
    if all_:
        if not lock.recipes:
            raise UserError(f"{lock_path}: --all, but the lockfile names no recipes; run `qbuild compile` first")
        return sorted(lock.recipes)
    if not recipes:
        raise UserError("name at least one recipe (as in the lockfile), or pass --all")
    return list(dict.fromkeys(resolve_recipe(lock, lock_path, r) for r in recipes))


def check_unique_names(lock: Lock, lock_path: Path, recipes: list[tuple[str, Path]]) -> None:
    """Recipe names are unique per lockfile: refuse (name, file) pairs whose name the lock holds for another file
    that still exists (a recipe that moved may take its entry over)."""
    for name, path in recipes:
        entry = lock.recipes.get(name)
        if entry is None:
            continue
        locked = recipe_file(entry, lock_path)
        if locked != path.resolve() and locked.is_file():
            raise UserError(f"{path}: recipe name {name!r} is already locked in {lock_path} for {locked}; recipe "
                            "names must be unique per lockfile: rename one (its name: field)")


def locked_recipe(lock: Lock, lock_path: Path, name: str, backend: str | None = None) -> LoadedRecipe:
    """The locked recipe `name`, loaded from the file the lock records, on `backend` if given, else on the backend
    it was locked for (a recipe built with --backend is locked as `<name>@<backend>`). UserError naming the lockfile
    where that file is gone."""
    path = recipe_file(lock.recipes[name], lock_path)
    if not path.is_file():
        raise UserError(f"{lock_path}: recipe {name!r} was locked from {path}, which no longer exists")
    return load_recipe(path).with_backend(backend or name.partition("@")[2] or None)


def recipe_or_file(lock: Lock, lock_path: Path, arg: str) -> LoadedRecipe:
    """The recipe a command-line argument names: a locked recipe (by name or file, as resolve_recipe takes it),
    else a recipe file."""
    try:
        return locked_recipe(lock, lock_path, resolve_recipe(lock, lock_path, arg))
    except UserError:
        if not Path(arg).is_file():
            raise
        return load_recipe(Path(arg))


def every_locked_recipe(lock: Lock, lock_path: Path, backend: str | None = None) -> list[LoadedRecipe]:
    """Every recipe the lockfile holds (locked_recipe), sorted by name; UserError where it holds none or one's file
    is gone."""
    if not lock.recipes:
        raise UserError(f"{lock_path}: the lockfile holds no recipe; name recipe files, or pass --all")
    return [locked_recipe(lock, lock_path, name, backend) for name in sorted(lock.recipes)]


def gone_recipes(lock: Lock, lock_path: Path) -> dict[str, Path]:
    """name -> recorded file, of each locked recipe whose file is no longer there."""
    files = {name: recipe_file(entry, lock_path) for name, entry in sorted(lock.recipes.items())}
    return {name: path for name, path in files.items() if not path.is_file()}


# --- the lock against a store ------------------------------------------------------------------------------------

def check(lock: Lock, store, recipes: list[str] | None = None) -> list[str]:
    """Every artifact the lockfile names must be in `store` with the right digest. Returns one line per problem.

    Blobs in the local store are re-hashed. With a remote-backed store an entry need not be local: its manifest may
    come from the remote (checked as on every read: key, tree digest, and here the locked digest) and the blobs the
    local store lacks must exist on the remote (checked by presence, without downloading them; their bytes are
    checked whenever they are downloaded)."""
    from qbuild.core.hashing import digest_file

    remote = getattr(store, "remote", None)
    problems = []
    for name in recipes if recipes is not None else sorted(lock.recipes):
        entry = lock.recipes.get(name)
        if entry is None:
            problems.append(f"{name}: not in the lockfile")
            continue
        if entry.bundle is None:
            problems.append(f"{name}: pinned, but no bundle is locked for it; run `qbuild compile` on {entry.recipe}")
            continue
        for role, node in sorted(lock.resolved(name).items()):
            manifest = store.get_manifest(node.key)
            if manifest is None:
                problems.append(f"{name}: {role}: no store entry for key {node.key[:16]}")
                continue
            if manifest.digest != node.digest:
                problems.append(f"{name}: {role}: the store's entry for key {node.key[:16]} has digest "
                                f"{manifest.digest[:16]}, the lockfile {node.digest[:16]}")
                continue
            elsewhere: dict[str, str] = {}
            for rel, out in sorted(node.outputs.items()):
                blob = store.blob_path(out.digest)
                if remote is not None and not blob.is_file():
                    elsewhere.setdefault(out.digest, rel)
                elif not blob.is_file() or blob.stat().st_size != out.size or digest_file(blob) != out.digest:
                    problems.append(f"{name}: {role}: {rel} missing or corrupt in the store")
            if elsewhere:
                on_remote = remote.has_blobs(elsewhere)
                for digest, rel in sorted(elsewhere.items(), key=lambda kv: kv[1]):
                    if digest not in on_remote:
                        problems.append(f"{name}: {role}: {rel} is in neither the local store nor {remote.url}")
    return problems


# --- a plan against the lock -------------------------------------------------------------------------------------

def roles_by_node(plan: Plan) -> dict[str, list[tuple[str, str]]]:
    """node id -> the (recipe, role) pairs it serves, for every node at once (asking per node is quadratic)."""
    roles: dict[str, list[tuple[str, str]]] = {}
    for name, pr in plan.recipes.items():
        for role, nid in pr.nodes.items():
            roles.setdefault(nid, []).append((name, role))
    return roles


def locked_entries(plan: Plan, lock: Lock, first_only: bool = False) -> dict[str, LockedNode]:
    """node id -> the lock's entry for it: the entry of the first of its (recipe, role) pairs the lock holds (with
    `first_only`, of its first pair alone). The lock's node ids may differ from the plan's (a changed param changes
    the id), so nodes are matched by role."""
    out = {}
    for nid, pairs in roles_by_node(plan).items():
        for recipe, role in pairs[:1] if first_only else pairs:
            node = lock.node(recipe, role)
            if node is not None:
                out[nid] = node.locked
                break
    return out


def pinned_files(lock: Lock, lock_path: Path) -> dict[tuple[str, str], LockedFiles]:
    """(repo, commit) -> the files the lock holds for that pinned commit, which the planner puts in the source of its
    fetch node (never in a key): the fetch step refuses a snapshot of that commit with other files
    (qbuild/steps/fetch.py)."""
    out = {}
    for _, entry in sorted(lock.recipes.items()):
        model = entry.model
        if model.source == "hf" and model.repo is not None and is_commit(model.revision) and model.files:
            out.setdefault((model.repo, model.revision), LockedFiles(str(lock_path), dict(model.files)))
    return out


@dataclass(frozen=True)
class PlatformRebuild:
    """The nodes a --frozen build rebuilt for this platform: not portable, and locked as built for another one."""

    host: str
    locked: tuple[str, ...]          # the platforms the lock names for them
    nodes: tuple[str, ...]           # their ids, in plan order
    counts: dict[str, int]           # "reference", "compile inductor", ... -> how many

    def line(self) -> str:
        what = ", ".join(f"{label} x{n}" for label, n in self.counts.items())
        return f"rebuilt for {self.host} (locked for {', '.join(self.locked)}): {what}"

    def to_json(self) -> dict:
        return {"host": self.host, "locked": list(self.locked), "counts": self.counts}


def frozen_verdict(plan: Plan, lock: Lock, lock_path: Path,
                   host: Callable[[], str] = host_tag) -> PlatformRebuild | None:
    """Raise BuildError, before anything is built, if a node's key differs from the lock's (upstream taken as locked),
    unless the node is not portable and differs only in the platform the lock holds it for: such nodes are returned,
    to be rebuilt for this platform (None: there are none)."""
    roles = roles_by_node(plan)
    # A node must be locked under the role that names it in the error: its first one.
    locked = locked_entries(plan, lock, first_only=True)
    keys = walk(plan, lambda nid, key: locked[nid].digest if nid in locked else None, host)
    elsewhere: dict[str, str] = {}
    for nid, nk in keys.items():
        if nid not in roles:
            continue    # built on request and never locked (--keep-intermediates)
        recipe, role = roles[nid][0]
        entry = locked.get(nid)
        if entry is None:
            raise BuildError(f"{lock_path}: --frozen, but {recipe}: {role} is not in the lockfile; run "
                             "`qbuild compile` without --frozen and commit the lockfile")
        if nk.key == entry.key:
            continue
        if _built_for_another_platform(nk.preimage, entry):
            elsewhere[nid] = entry.platform
            continue
        changed = "; ".join(diff_preimages(entry.preimage, as_locked(nk.preimage))) or "key changed"
        raise BuildError(f"{lock_path}: --frozen, but {recipe}: {role} would change ({changed}); run "
                         "`qbuild compile` without --frozen and commit the lockfile")
    if not elsewhere:
        return None
    counts: dict[str, int] = {}
    for nid in elsewhere:
        label = _rebuild_label(plan.nodes[nid])
        counts[label] = counts.get(label, 0) + 1
    platform = next(keys[nid].preimage["platform"] for nid in elsewhere)
    return PlatformRebuild(platform, tuple(sorted(set(elsewhere.values()))), tuple(elsewhere), counts)


def frozen_difference(plan: Plan, lock: Lock, written: Lock, rebuilt: PlatformRebuild | None) -> str | None:
    """Where a --frozen build's entries (`written`) would change the lock: its first entry and field (None: they
    would not). What was rebuilt for this platform differs from the lock by design: it is compared as the lock has it."""
    recipes, nodes = dict(written.recipes), dict(written.nodes)
    rebuilt_ids = set(rebuilt.nodes) if rebuilt else set()
    for name, planned in plan.recipes.items():
        if name not in recipes or name not in lock.recipes:
            continue
        entry = recipes[name]
        swapped = {role: lock.recipes[name].nodes[role] for role, nid in planned.nodes.items()
                   if nid in rebuilt_ids and role in entry.nodes and role in lock.recipes[name].nodes}
        if swapped:
            for role, locked_id in swapped.items():
                nodes.pop(entry.nodes[role], None)
                nodes[locked_id] = lock.nodes[locked_id]
            bundle = lock.recipes[name].bundle if "package" in swapped else entry.bundle
            recipes[name] = entry.model_copy(update={"nodes": {**entry.nodes, **swapped}, "bundle": bundle})
    return first_difference(lock, merge(lock, Lock(recipes=recipes, nodes=nodes)))


def _built_for_another_platform(pre: dict, entry: LockedNode) -> bool:
    """Whether the locked node is this one built for another platform: its key is this preimage's, with the lock's
    platform in place of this host's (so a portable node, or a locked entry without a platform, never is)."""
    return "platform" in pre and entry.platform is not None and entry.platform != pre["platform"] \
        and key_of({**pre, "platform": entry.platform}) == entry.key


def _rebuild_label(node: Node) -> str:
    """How the one line of a platform rebuild counts a node: by kind, and for a compile, by its backend too."""
    return f"{node.kind} {node.params.backend}" if node.kind == "compile" else node.kind


# --- what a build writes -----------------------------------------------------------------------------------------

def finished(planned: PlannedRecipe, outcomes: Mapping[str, str]) -> bool:
    """Whether the build of a recipe is over: each of its steps was built, cached, failed or skipped (`outcomes`:
    node id -> how it ended, for the steps that ended)."""
    return all(nid in outcomes for nid in planned.nodes.values())


def written_entry(plan: Plan, name: str, manifests: Mapping[str, Manifest], why_unverified: str | None,
                  snapshot: dict | None, lock_path: Path) -> Lock | None:
    """The lock entry of recipe `name` whose build is over, with its nodes, as a Lock of that recipe alone; None
    where its bundle was not built (its entry, if the lock has one, stays as it was). `manifests`: node id -> its
    result; `why_unverified`: why its verify has no result (failed, or skipped and why); `snapshot`: the
    snapshot.json of its fetch step."""
    planned = plan.recipes[name]
    if planned.bundle not in manifests:
        return None
    nodes = {role: nid for role, nid in sorted(planned.nodes.items()) if nid in manifests}
    verified = planned.verify in manifests
    port = manifests.get(planned.nodes.get("port", ""))
    entry = RecipeEntry(
        recipe=recorded_path(planned.loaded.path, lock_path), model=model_entry(plan, planned, snapshot),
        nodes=nodes, bundle=manifests[planned.bundle].digest, verified=verified,
        verify_failure=None if verified else why_unverified,
        # Where the compiled port came from (a git port: url, rev, subdir) and its tree digest.
        port=None if port is None else PortEntry(digest=port.digest, **{
            k: v for k, v in port.preimage["params"].items() if k in ("url", "rev", "subdir")}))
    return Lock(recipes={name: entry},
                nodes={nid: NodeEntry.of(plan.nodes[nid].kind, manifests[nid]) for nid in nodes.values()})


def model_entry(plan: Plan, planned: PlannedRecipe, snapshot: dict | None) -> ModelEntry:
    """The recipe's model as locked: a local checkpoint's digests, or the commit its hub fetch is keyed on (the pin),
    with the built snapshot's digests (`snapshot`: its fetch's snapshot.json; None where not built)."""
    params = plan.nodes[planned.nodes["fetch"]].params
    files = {n: m["digest"] for n, m in sorted(snapshot["files"].items())} if snapshot else {}
    if not isinstance(params, FetchHub):
        return ModelEntry(source="path", revision=None, files=files)
    pin = HubPin(params.repo, planned.loaded.recipe.model.revision, params.revision)
    return ModelEntry.pinned(pin, files if snapshot and snapshot.get("revision") == pin.revision else {})


def combined(locks: Iterable[Lock]) -> Lock:
    """The entries of several single-recipe locks (written_entry) as one: what a build wrote, in one Lock."""
    recipes, nodes = {}, {}
    for one in locks:
        recipes.update(one.recipes)
        nodes.update(one.nodes)
    return Lock(recipes=dict(sorted(recipes.items())), nodes=dict(sorted(nodes.items())))


# --- a locked recipe whose file changed --------------------------------------------------------------------------

def first_change(plan: Plan, planned: PlannedRecipe, lock: Lock, name: str) -> str | None:
    """"<role>: <field> ..." for the first node of `planned`, in plan order, whose params or inputs differ from the
    node the lock holds for the same role of recipe `name`; None where none does. Neither the code version nor the
    toolchain is compared (an upgrade re-keys every node while the recipe asks for the same bundle)."""
    locked = lock.resolved(name)
    role_of = {nid: role for role, nid in planned.nodes.items()}
    bundle_steps = upstream(plan.graph(), [planned.bundle])
    for nid, node in plan.nodes.items():
        role = role_of.get(nid)
        if role is None:
            continue
        old = locked.get(role)
        if old is None:
            if nid in bundle_steps:
                return f"{role}: a step the locked bundle was not built with"
            continue
        inputs = {n: locked[role_of[dep]].digest for n, dep in node.deps.items() if role_of[dep] in locked}
        # The params first: what the recipe says is the cause, an input that follows from it the consequence.
        changed = diff_preimages({"params": old.preimage.get("params")}, as_locked({"params": to_json(node.params)})) \
            + diff_preimages({"inputs": old.preimage.get("inputs", {})}, {"inputs": inputs})
        if changed:
            return f"{role}: {changed[0]}"
    gone = sorted(set(locked) - set(planned.nodes))
    return f"{gone[0]}: a locked step the recipe no longer plans" if gone else None

