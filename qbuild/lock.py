"""artifacts.lock: what each recipe resolved to and produced. Deterministic, sorted, diff-friendly JSON.

    {"version": 1,
     "recipes": {name: {"recipe": path, "model": {source, revision, files}, "nodes": {role: node id},
                        "bundle": tree digest of the package output, "verified": bool}},
     "nodes": {node id: {"kind", "name", "key", "preimage", "digest", "outputs": {path: {digest, size}}}}}

A node's preimage holds its params, input digests, action version and toolchain versions, so `qbuild explain`
can name the field that changed. The serialiser is a pure function; writes go through an atomic rename under
a file lock, and merge with what other processes wrote meanwhile.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import UserError
from .store.local import atomic_write
from .store.manifest import Manifest

LOCK_VERSION = 1


def empty() -> dict:
    return {"version": LOCK_VERSION, "recipes": {}, "nodes": {}}


def read(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return empty()
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: unreadable lockfile: {e}") from None
    if doc.get("version") != LOCK_VERSION:
        raise UserError(f"{path}: lockfile version {doc.get('version')!r}; this qbuild reads {LOCK_VERSION}")
    return doc


def dumps(doc: dict) -> str:
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def node_entry(node, manifest: Manifest) -> dict:
    return {"kind": node.kind, "name": node.name, "key": manifest.key, "preimage": manifest.preimage,
            "digest": manifest.digest, "outputs": manifest.outputs}


def recipe_entry(planned, model: dict, manifests: dict[str, Manifest], cwd: Path) -> dict:
    """The lock entry of one recipe, given the manifests of the nodes built so far."""
    try:
        recipe_path = planned.loaded.path.relative_to(cwd).as_posix()
    except ValueError:
        recipe_path = planned.loaded.path.as_posix()
    bundle = manifests.get(planned.bundle)
    return {"recipe": recipe_path, "model": model,
            "nodes": {role: nid for role, nid in sorted(planned.nodes.items()) if nid in manifests},
            "bundle": bundle.digest if bundle else None,
            "verified": planned.verify in manifests}


def merge(doc: dict, recipes: dict[str, dict], nodes: dict[str, dict]) -> dict:
    """`doc` with the given recipe and node entries replaced, and nodes no recipe names any more dropped."""
    out = {"version": LOCK_VERSION, "recipes": dict(doc["recipes"]), "nodes": dict(doc["nodes"])}
    out["recipes"].update(recipes)
    out["nodes"].update(nodes)
    live = {nid for entry in out["recipes"].values() for nid in entry["nodes"].values()}
    out["nodes"] = {nid: n for nid, n in out["nodes"].items() if nid in live}
    return out


def update(path: Path, recipes: dict[str, dict], nodes: dict[str, dict]) -> bool:
    """Merge entries into the lockfile on disk atomically; returns whether its content changed."""
    from filelock import FileLock   # only writers take the lock; readers (plan, check) never load it

    with FileLock(str(path) + ".flock"):
        old = read(path)
        new = merge(old, recipes, nodes)
        if dumps(new) == dumps(old) and path.exists():
            return False
        atomic_write(path, dumps(new).encode())
        return True


def locked_preimage(doc: dict, roles: list[tuple[str, str]]) -> dict | None:
    """The preimage the lock recorded for the same role of the same recipe, if any."""
    for recipe, role in roles:
        nid = doc["recipes"].get(recipe, {}).get("nodes", {}).get(role)
        if nid and nid in doc["nodes"]:
            return doc["nodes"][nid]["preimage"]
    return None


def check(doc: dict, store, recipes: list[str] | None = None) -> list[str]:
    """Every artifact the lockfile names must be in `store` with the right digest. Returns one line per problem.

    Blobs in the local store are re-hashed. With a remote-backed store an entry need not be local: its manifest may
    come from the remote (checked as on every read: key, tree digest, and here the locked digest) and the blobs the
    local store lacks must exist on the remote (checked by presence, without downloading them; their bytes are
    checked whenever they are downloaded)."""
    from .hashing import digest_file

    remote = getattr(store, "remote", None)
    problems = []
    names = recipes if recipes is not None else sorted(doc["recipes"])
    for name in names:
        entry = doc["recipes"].get(name)
        if entry is None:
            problems.append(f"{name}: not in the lockfile")
            continue
        for role, nid in sorted(entry["nodes"].items()):
            node = doc["nodes"].get(nid)
            if node is None:
                problems.append(f"{name}: {role}: node {nid} missing from the lockfile")
                continue
            manifest = store.get_manifest(node["key"])
            if manifest is None or manifest.digest != node["digest"]:
                problems.append(f"{name}: {role}: no store entry for key {node['key'][:16]}")
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
