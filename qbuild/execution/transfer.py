"""Moving locked artifacts between stores: publish them to the remote, pull a bundle out of the store.

    publish    the lockfile's nodes of some recipes (all, or what bundles need) -> the remote (blobs first, manifests
               last, conditionally)
    pull       one recipe's locked bundle (its package node's outputs) -> a directory, every digest checked; or,
               for as long as a command reads it (run, bench, serve), a temporary one (open_locked_bundle)

Both read the lockfile, never the recipes, so a serving host needs nothing but qbuild and artifacts.lock.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from qbuild.core.errors import InfraError, UserError
from qbuild.planning.lock import Lock, NodeEntry, recipe_names
from qbuild.store.remote import Store
from qbuild.core.files import staged
from qbuild.store.manifest import Manifest
from qbuild.store.remote import NoProgress, PushReport, RemoteStore, remote_blobs_matching, push_manifests


# --- choosing locked nodes -----------------------------------------------------------------------------------------

def locked_nodes(lock: Lock, names: list[str]) -> dict[str, tuple[str, str, NodeEntry]]:
    """node id -> (recipe, role, its entry) for every node the named recipes lock."""
    out: dict[str, tuple[str, str, NodeEntry]] = {}
    for name in names:
        for role, nid in sorted(lock.recipes[name].nodes.items()):
            out.setdefault(nid, (name, role, lock.nodes[nid]))
    return out


# --- publish -------------------------------------------------------------------------------------------------------

# What publish uploads: "all" every node the recipes lock; "bundles" what `pull` and a rebuild elsewhere need, every
# locked node but those whose outputs only serve to verify a bundle again (the reference's logits): the bundle, the
# nodes whose outputs it links (shards, graphs: the same blobs), the descriptions it is made from (snapshot, port,
# the converted weights' description) and its verify report. docs/bytes.md.
PUBLISHED = ("bundles", "all")
_REVERIFY_ONLY = ("reference",)


def published_nodes(lock: Lock, names: list[str], what: str = "all") -> dict[str, tuple[str, str, NodeEntry]]:
    """locked_nodes of `names`, less those `what` leaves out."""
    nodes = locked_nodes(lock, names)
    if what == "all":
        return nodes
    return {nid: v for nid, v in nodes.items() if v[2].kind not in _REVERIFY_ONLY}


def publish(store: RemoteStore, lock: Lock, lock_path: Path, names: list[str], *,
            verify_remote: bool = False, what: str = "all") -> PushReport:
    """Upload every locked node of `names` (of those `what` names: PUBLISHED) that the remote lacks. Idempotent: a
    second run uploads nothing. `verify_remote` reads back every blob the remote has for them and re-uploads the ones
    that do not match."""
    manifests: list[Manifest] = []
    absent: dict[str, tuple[str, str]] = {}
    for recipe, role, node in published_nodes(lock, names, what).values():
        m = store.local.get_manifest(node.key)
        if m is None:
            absent[node.key] = (recipe, role)
            continue
        if m.digest != node.digest:
            raise UserError(f"{lock_path}: {recipe}: {role}: the store's entry for key {node.key[:16]} has digest "
                            f"{m.digest[:16]}, the lockfile {node.digest[:16]}; rebuild with `qbuild compile`")
        manifests.append(m)
    if absent:
        on_remote = store.remote.has_manifests(absent)
        for key, (recipe, role) in absent.items():
            if key not in on_remote:
                raise UserError(f"{recipe}: {role} (key {key[:16]}) is in neither the local store ({store.root}) "
                                f"nor {store.remote.url}; run `qbuild compile` for it first")
    unchecked = _remote_only_blobs(lock, names, absent, what) if verify_remote else {}
    sound = _check_remote_only(store, unchecked)
    report = push_manifests(store.local, store.remote, manifests, store.progress, verify_remote=verify_remote)
    report.manifests_present += len(absent)
    report.blobs_present += len(sound)
    return report


def _remote_only_blobs(lock: Lock, names: list[str], absent: dict,
                       what: str = "all") -> dict[str, tuple[str, str, int]]:
    """digest -> (first recipe naming it, path, size) of the locked outputs of nodes this store has no entry for: the
    remote's copy is the only one, so verifying the remote reads those back too."""
    out: dict[str, tuple[str, str, int]] = {}
    for recipe, _, node in sorted(published_nodes(lock, names, what).values(), key=lambda v: v[0]):
        if node.key in absent:
            for rel, o in sorted(node.outputs.items()):
                out.setdefault(o.digest, (recipe, rel, o.size))
    return out


def _check_remote_only(store: RemoteStore, blobs: dict[str, tuple[str, str, int]]) -> set[str]:
    """The digests of `blobs` whose remote bytes match. Nothing here can repair the others (this store lacks them):
    raise one line per bad blob, naming it and the publish that repairs it from a store that holds it."""
    if not blobs:
        return set()
    sound = remote_blobs_matching(store.remote, {d: (rel, size) for d, (_, rel, size) in blobs.items()},
                                   store.progress or NoProgress())
    have = store.remote.has_blobs(blobs)
    bad = sorted(set(blobs) - sound)
    if bad:
        url = store.remote.url
        raise InfraError("\n".join(
            f"{store.remote.object_url(store.remote.blob_key(d))}: {'corrupt' if d in have else 'missing'} (blob {d}); "
            f"this store lacks it: run `qbuild publish {blobs[d][0]} --verify-remote --remote {url}` where it is built"
            for d in bad))
    return sound


# --- pull ----------------------------------------------------------------------------------------------------------

def pull_bundle(store: Store, lock: Lock, lock_path: Path, recipe: str, dest: Path, *, share: bool,
                allow_unverified: bool = False, shown_as: str | None = None) -> Manifest:
    """Lay out the locked bundle of `recipe` in `dest` (new or empty), checking every digest first. With `share` the
    files are the store's own read-only blobs (hardlinks); without, they share no inode with it (see materialize).
    A bundle whose verify did not pass is refused unless `allow_unverified`. Errors name `dest` as `shown_as`
    (default: its path).

    Through a RemoteStore only the manifest is read at lookup; `materialize` then downloads (ensure_blobs) and
    verifies exactly the bundle's blobs; a blob that does not match aborts the pull before anything is written to
    `dest`."""
    name = recipe_names(lock, lock_path, [recipe], False)[0]
    entry = lock.recipes[name]
    node = lock.node(name, "package")
    if node is None:
        raise UserError(f"{lock_path}: {name} has no locked bundle (its package step has not been built)")
    if not entry.verified and not allow_unverified:
        why = entry.verify_failure or "its verify step has not run"
        raise UserError(f"{lock_path}: {name}: the bundle is not verified ({why}); refusing to lay it out. Fix the "
                        "recipe and rebuild, or pass --allow-unverified")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UserError(f"{shown_as or dest}: exists and is not an empty directory; pull into a new or empty one")
    manifest = store.get_manifest(node.key)
    if manifest is None:
        if isinstance(store, RemoteStore):
            raise InfraError(f"{name}: bundle {node.key[:16]} is in neither the local store ({store.root}) nor "
                             f"{store.remote.url}; publish it there with `qbuild publish {name}`")
        raise InfraError(f"{name}: bundle {node.key[:16]} is not in the local store ({store.root}); "
                         "pass --remote s3://bucket/prefix to fetch it")
    if manifest.digest != node.digest:
        raise InfraError(f"{name}: the stored bundle {node.key[:16]} differs from the one {lock_path} locks "
                         f"(digest {manifest.digest[:16]}, locked {node.digest[:16]}); refusing it")
    locked_outputs = node.outputs_json()
    if manifest.outputs != locked_outputs:   # the same paths and digests (the tree digest), other sizes
        rel = next(r for r in sorted(locked_outputs) if manifest.outputs.get(r) != locked_outputs[r])
        raise InfraError(f"{name}: the stored bundle {node.key[:16]} records {rel} with "
                         f"{manifest.outputs[rel]['size']} bytes, {lock_path} with {locked_outputs[rel]['size']}; "
                         "refusing it")
    try:
        with staged(dest, directory=True) as stage:
            store.materialize(manifest.outputs, stage, verify=True, share=share)
    except OSError as e:
        raise InfraError(f"{shown_as or dest}: {e.strerror or e}") from None
    return manifest


@dataclass(frozen=True)
class OpenBundle:
    """A bundle directory a command reads: one the user gave, or a locked recipe's bundle laid out for the command."""

    path: Path
    name: str                       # the locked recipe's name, or the directory's
    shown_as: str | None = None     # how errors name it; None: by its path
    digests_checked: bool = False   # every file was checked against its digest as it was laid out


@contextmanager
def open_locked_bundle(store: Store, lock: Lock, lock_path: Path, recipe: str, *, share: bool,
                       allow_unverified: bool = False) -> Iterator[OpenBundle]:
    """The locked bundle of `recipe` (a name or a recipe file, as resolve_recipe takes it), laid out from the store
    (pull_bundle: `share`, `allow_unverified`, every digest checked) in a temporary directory that is removed when
    the block ends. Errors name it "<recipe> (its locked bundle)", never the temporary directory the user did not
    choose; pass `shown_as` on to what reads it (Runtime.load, bundle.read_manifest) for theirs to do the same."""
    name = recipe_names(lock, lock_path, [recipe], False)[0]
    shown_as = f"{recipe} (its locked bundle)"
    with tempfile.TemporaryDirectory(prefix="qbuild-bundle-") as tmp:
        path = Path(tmp) / name
        pull_bundle(store, lock, lock_path, name, path, share=share, allow_unverified=allow_unverified,
                    shown_as=shown_as)
        yield OpenBundle(path, name, shown_as, digests_checked=True)
