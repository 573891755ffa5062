"""artifacts.lock: what each recipe resolved to and produced. Deterministic, sorted, diff-friendly JSON.

    {"version": 1,
     "recipes": {name: {"recipe": path, "model": model, "nodes": {role: node id},
                        "bundle": tree digest of the package output, "verified": bool,
                        "verify_failure": why the last verify failed (only when it did),
                        "port": {url, rev, subdir (a git port), digest: its files' tree digest} (neuron recipes)}},
     "nodes": {node id: {"kind", "name", "key", "preimage", "digest", "outputs": {path: {digest, size}}}}}

A recipe's model is {"source": "path", "revision": null, "files": {name: digest}} for a local checkpoint, and for a
hub model its pin: {"source": "hf", "repo", "requested": the recipe's revision, "revision": the commit it is pinned
to, "files": the built snapshot's digests, empty until that commit is fetched}. Planning keys a hub fetch on the pin
while the recipe asks for the same repo and revision; `qbuild lock update` moves pins, and nothing else does.

A recipe's `recipe` path is relative to the lockfile's directory (absolute when the file lies outside it), and
recipe names are unique per lockfile. A recipe has an entry only once its bundle was built: a build that fails
before leaves the recipe's entry as it was. A node's preimage holds its params, input digests, action source hash
and toolchain versions, and for a node whose output is not portable (native code, CPU-dependent numbers) the
platform it was built for, so `qbuild explain` can name the field that changed. A node id is the plan's, except where
two recipes share a step that one of them built again into another output: the other recipe's entry, left as it
was, keeps its own under `<node id>@<digest prefix>` until it is built again. The serialiser is a pure function;
writes go through an atomic rename under an flock of the lockfile's directory, and merge with what other processes
wrote meanwhile. `read` refuses a document of the wrong shape or whose entries disagree with their own nodes
(qbuild.store.lock_schema), so no command acts on one.
"""

from __future__ import annotations

import fcntl
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

from qbuild.core import jsonio
from qbuild.core.errors import InfraError, UserError
from qbuild.store import lock_schema
from qbuild.store.local import atomic_write
from qbuild.store.manifest import Manifest
from qbuild.core.userfile import read_small_file

LOCK_VERSION = 1
MAX_LOCK_BYTES = 256 << 20   # a lockfile of every shipped recipe is a few hundred KiB


def empty() -> dict:
    return {"version": LOCK_VERSION, "recipes": {}, "nodes": {}}


def read(path: Path) -> dict:
    if not path.exists() and not path.is_symlink():
        return empty()
    try:
        doc = json.loads(read_small_file(path, MAX_LOCK_BYTES, "the lockfile"))
    except ValueError as e:   # invalid JSON or not UTF-8
        raise UserError(f"{path}: unreadable lockfile: {e}") from None
    if not isinstance(doc, dict):
        raise UserError(f"{path}: not a lockfile (expected a JSON object)")
    if doc.get("version") != LOCK_VERSION or isinstance(doc.get("version"), bool):
        raise UserError(f"{path}: lockfile version {doc.get('version')!r}; this qbuild reads {LOCK_VERSION}")
    lock_schema.validate(doc, path)   # its shape, and each recipe entry against its own nodes
    return doc


def dumps(doc: dict) -> str:
    return jsonio.dumps(doc, indent=2, sort_keys=True) + "\n"


def same(a: dict, b: dict) -> bool:
    """Whether two lock documents write the same file. Compared compact: json's C encoder does not indent, and the
    Python one it falls back to took most of a no-op compile's time after planning."""
    return jsonio.dumps(a, sort_keys=True, compact=True) == jsonio.dumps(b, sort_keys=True, compact=True)


def node_entry(node, manifest: Manifest) -> dict:
    return {"kind": node.kind, "name": node.name, "key": manifest.key, "preimage": manifest.preimage,
            "digest": manifest.digest, "outputs": manifest.outputs}


def recipe_entry(planned, model: dict, manifests: dict[str, Manifest], lock_path: Path,
                 verify_failure: str | None = None) -> dict:
    """The lock entry of one recipe, given the manifests of the nodes built so far (and why its verify failed). The
    recipe file is recorded as recorded_path says."""
    bundle = manifests.get(planned.bundle)
    entry = {"recipe": recorded_path(planned.loaded.path, lock_path), "model": model,
             "nodes": {role: nid for role, nid in sorted(planned.nodes.items()) if nid in manifests},
             "bundle": bundle.digest if bundle else None,
             "verified": planned.verify in manifests}
    if verify_failure is not None and planned.verify not in manifests:
        entry["verify_failure"] = verify_failure   # what `qbuild pull` names when it refuses the bundle
    port = manifests.get(planned.nodes.get("port", ""))
    if port is not None:   # where the compiled port came from (a git port: url, rev, subdir) and its tree digest
        source = {k: v for k, v in port.preimage["params"].items() if k in ("url", "rev", "subdir")}
        entry["port"] = {**source, "digest": port.digest}
    return entry


def recorded_path(path: Path, lock_path: Path) -> str:
    """A recipe file as the lock records it: relative to the lockfile's directory (absolute when outside it), so it
    names the same file from any working directory."""
    try:
        return path.resolve().relative_to(lock_path.parent.resolve()).as_posix()
    except ValueError:
        return path.resolve().as_posix()


@dataclass(frozen=True)
class HubPin:
    """A recipe's hub model pinned to a commit, as uv or Cargo lock a version: the repo, the revision the recipe
    asks for (a branch, a tag or the commit itself) and the commit it was resolved to."""

    repo: str
    requested: str
    revision: str

    def model(self, files: Mapping[str, str] | None = None) -> dict:
        """The lock's model entry for this pin, with the digests of the fetched snapshot's files where known."""
        return {"source": "hf", "repo": self.repo, "requested": self.requested, "revision": self.revision,
                "files": dict(sorted((files or {}).items()))}


def _is_commit(value) -> bool:
    return isinstance(value, str) and len(value) == 40 and all(c in "0123456789abcdef" for c in value)


def model_entry(pin: HubPin | None, snapshot: dict | None) -> dict:
    """A recipe's model entry: a local checkpoint's file digests, or a hub model's pin, with the files of its fetched
    snapshot (`snapshot`: snapshot.json of the recipe's fetch step, None where it is not built)."""
    files = {n: m["digest"] for n, m in sorted(snapshot["files"].items())} if snapshot else {}
    if pin is None:
        return {"source": "path", "revision": None, "files": files}
    return pin.model(files if snapshot and snapshot.get("revision") == pin.revision else {})


def hub_pins(doc: dict) -> dict[str, HubPin]:
    """recipe name -> its hub pin, for each locked recipe whose model is pinned to a commit."""
    out = {}
    for name, entry in sorted(doc["recipes"].items()):
        model = entry.get("model") or {}
        if model.get("source") == "hf" and isinstance(model.get("repo"), str) \
                and isinstance(model.get("requested"), str) and _is_commit(model.get("revision")):
            out[name] = HubPin(model["repo"], model["requested"], model["revision"])
    return out


def set_pins(path: Path, pins: Mapping[str, tuple[str, HubPin]]) -> tuple[dict, dict[str, HubPin | None]]:
    """Write hub pins (recipe name -> (its recipe file as recorded in the lock, its pin)) into the lockfile on disk,
    atomically, and nothing else: a locked recipe keeps its nodes, bundle and verify state, and its model's file
    digests where the commit did not move; a recipe the lock does not hold gets an entry with its pin only.
    Returns the document written, and recipe name -> the pin it had before (None: none)."""
    with _directory_locked(path.parent):
        old = read(path)
        before = hub_pins(old)
        recipes = {}
        for name, (recipe_path, pin) in sorted(pins.items()):
            entry = dict(old["recipes"].get(name) or {"recipe": recipe_path, "nodes": {}, "bundle": None,
                                                       "verified": False})
            kept = entry.get("model", {}).get("files") if before.get(name) == pin else None
            entry["model"] = pin.model(kept)
            recipes[name] = entry
        new = merge(old, recipes, {})
        if not same(new, old) or not path.exists():
            atomic_write(path, dumps(new).encode())
    return new, {name: before.get(name) for name in pins}


def merge(doc: dict, recipes: dict[str, dict], nodes: dict[str, dict]) -> dict:
    """`doc` with the given recipe and node entries replaced, and nodes no recipe names any more dropped. A recipe
    entry left as it was keeps the nodes its bundle was built from: where it shares a step with a recipe written now
    and that step's entry changes (built again into another output), it keeps the old entry under its own id (see
    _kept_apart), so every entry still agrees with itself (lock_schema). An entry that would disagree with itself all
    the same is dropped, never written: its recipe is locked again when its bundle is next built."""
    from qbuild.store.lock_schema import entry_problem

    out = {"version": LOCK_VERSION, "recipes": dict(doc["recipes"]), "nodes": dict(doc["nodes"])}
    for name, entry in doc["recipes"].items():
        if name not in recipes:
            out["recipes"][name] = _kept_apart(entry, doc["nodes"], nodes, out["nodes"])
    out["recipes"].update(recipes)
    out["nodes"].update(nodes)
    for name in [n for n in out["recipes"] if n not in recipes]:
        if entry_problem(out, name, out["recipes"][name]) is not None:
            del out["recipes"][name]
    live = {nid for entry in out["recipes"].values() for nid in entry["nodes"].values()}
    out["nodes"] = {nid: n for nid, n in out["nodes"].items() if nid in live}
    return out


def _kept_apart(entry: dict, old: dict[str, dict], new: dict[str, dict], out: dict[str, dict]) -> dict:
    """A recipe entry that stays as it was, with each node of it whose entry `new` replaces by another moved to the id
    `<node id>@<its output digest's first 12>` (added to `out`). Lock ids need not be the plan's: nodes are matched
    by role (locked_nodes), and the entry goes when its recipe is written again."""
    moved = {role: nid for role, nid in entry["nodes"].items() if nid in new and new[nid] != old.get(nid)}
    if not moved:
        return entry
    roles = dict(entry["nodes"])
    for role, nid in moved.items():
        roles[role] = f"{nid}@{old[nid]['digest'][:12]}"
        out[roles[role]] = old[nid]
    return {**entry, "nodes": roles}


def update(path: Path, recipes: dict[str, dict], nodes: dict[str, dict]) -> bool:
    """Merge entries into the lockfile on disk atomically; returns whether its content changed. No entries: nothing
    is written, not even an empty lockfile."""
    if not recipes and not nodes:
        return False
    with _directory_locked(path.parent):
        old = read(path)
        new = merge(old, recipes, nodes)
        if same(new, old) and path.exists():
            return False
        atomic_write(path, dumps(new).encode())
        return True


def recipe_file(entry: dict, lock_path: Path) -> Path:
    """The recipe file a lock entry recorded (relative to the lockfile's directory, or absolute)."""
    return (lock_path.parent.resolve() / entry["recipe"]).resolve()


def resolve_recipe(doc: dict, lock_path: Path, arg: str) -> str:
    """The locked recipe a command-line argument names: a recipe name, or a recipe file written any way `compile`
    accepts it (relative to the working directory, absolute, through ../), matched by the file it resolves to.
    Every command that takes a recipe of the lockfile (publish, pull, run, bench, lock check) resolves it here."""
    if arg in doc["recipes"]:
        return arg
    target = Path(arg).resolve()
    for name, entry in sorted(doc["recipes"].items()):
        if recipe_file(entry, lock_path) == target:
            return name
    known = ", ".join(sorted(doc["recipes"])) or "none"
    raise UserError(f"{lock_path}: recipe {arg!r} is not in the lockfile (locked: {known})")


def check_unique_names(doc: dict, lock_path: Path, recipes: list[tuple[str, Path]]) -> None:
    """Recipe names are unique per lockfile: refuse (name, file) pairs whose name the lock holds for another file
    that still exists (a recipe that moved may take its entry over)."""
    for name, path in recipes:
        entry = doc["recipes"].get(name)
        if entry is None:
            continue
        locked = recipe_file(entry, lock_path)
        if locked != path.resolve() and locked.is_file():
            raise UserError(f"{path}: recipe name {name!r} is already locked in {lock_path} for {locked}; recipe "
                            "names must be unique per lockfile: rename one (its name: field)")


@contextmanager
def _directory_locked(directory: Path) -> Iterator[None]:
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


@dataclass(frozen=True)
class LockedNode:
    """What the lock recorded for a node: its key, the key's preimage, and the digest of its output tree."""

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


def locked_nodes(doc: dict, roles: Mapping[str, list[tuple[str, str]]]) -> dict[str, LockedNode]:
    """The lock's entry for each node (node id -> the (recipe, role) pairs it serves): the entry recorded for the
    first of its roles that the lock holds. The lock's node ids may differ from the plan's (a changed param changes
    the id), so nodes are matched by role."""
    out = {}
    for nid, pairs in roles.items():
        for recipe, role in pairs:
            locked_id = doc["recipes"].get(recipe, {}).get("nodes", {}).get(role)
            entry = doc["nodes"].get(locked_id) if locked_id else None
            if entry is not None:
                out[nid] = LockedNode(entry["key"], entry["preimage"], entry["digest"])
                break
    return out


def check(doc: dict, store, recipes: list[str] | None = None) -> list[str]:
    """Every artifact the lockfile names must be in `store` with the right digest. Returns one line per problem.

    Blobs in the local store are re-hashed. With a remote-backed store an entry need not be local: its manifest may
    come from the remote (checked as on every read: key, tree digest, and here the locked digest) and the blobs the
    local store lacks must exist on the remote (checked by presence, without downloading them; their bytes are
    checked whenever they are downloaded)."""
    from qbuild.core.hashing import digest_file

    remote = getattr(store, "remote", None)
    problems = []
    names = recipes if recipes is not None else sorted(doc["recipes"])
    for name in names:
        entry = doc["recipes"].get(name)
        if entry is None:
            problems.append(f"{name}: not in the lockfile")
            continue
        if entry.get("bundle") is None:
            # Written by a qbuild that locked failed builds: the recipe names no artifact to check.
            problems.append(f"{name}: locked without a bundle (its build did not finish); run `qbuild compile` on "
                            f"{entry.get('recipe', name)}")
            continue
        for role, nid in sorted(entry["nodes"].items()):
            node = doc["nodes"].get(nid)
            if node is None:
                problems.append(f"{name}: {role}: node {nid} missing from the lockfile")
                continue
            manifest = store.get_manifest(node["key"])
            if manifest is None:
                problems.append(f"{name}: {role}: no store entry for key {node['key'][:16]}")
                continue
            if manifest.digest != node["digest"]:
                problems.append(f"{name}: {role}: the store's entry for key {node['key'][:16]} has digest "
                                f"{manifest.digest[:16]}, the lockfile {node['digest'][:16]}")
                continue
            elsewhere: dict[str, str] = {}
            for rel, meta in sorted(node["outputs"].items()):
                blob = store.blob_path(meta["digest"])
                if remote is not None and not blob.is_file():
                    elsewhere.setdefault(meta["digest"], rel)
                elif not blob.is_file() or blob.stat().st_size != meta["size"] or digest_file(blob) != meta["digest"]:
                    problems.append(f"{name}: {role}: {rel} missing or corrupt in the store")
            if elsewhere:
                on_remote = remote.has_blobs(elsewhere)
                for digest, rel in sorted(elsewhere.items(), key=lambda kv: kv[1]):
                    if digest not in on_remote:
                        problems.append(f"{name}: {role}: {rel} is in neither the local store nor {remote.url}")
    return problems
