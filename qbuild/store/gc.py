"""Garbage collection: drop store entries no lockfile references, locally beyond an LRU size budget, remotely all
but those written within the grace period; and the groups of the side caches it is handed (qbuild.store.side_cache:
a backend's compiler cache, such as the Neuron compile cache), least recently used first, beyond the same budget here
and on the remote.

What it keeps is what lockfiles name: the caller hands in how to read their keys (qbuild.planning.lock
.referenced_keys), and gc calls it at the moment that makes the removal safe beside builds (see gc_local).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from qbuild.core.files import read_regular
from qbuild.store.lease import live_leases
from qbuild.store.local import LocalStore
from qbuild.store.manifest import Manifest
from qbuild.store.remote import holding
from qbuild.store.s3 import POOL_THREADS, S3Remote, parse_remote
from qbuild.store.side_cache import CacheGroup, SideCache
from qbuild.core.threads import map_all

# What was written this recently is kept: a blob no manifest names may belong to a push still in flight, and a
# fresh manifest to a build or pull that has not written the lockfile naming it yet.
GRACE_S = 3600.0


@dataclass
class Removal:
    where: str                              # "local" or the remote URL
    what: Literal["manifest", "blob", "cache", "partial"]
    name: str                               # key, digest, a side cache's group (relative to the cache), or a file
    size: int
    kind: str = ""                          # the manifest's step kind, or the side cache's name


@dataclass
class GcReport:
    removed: list[Removal] = field(default_factory=list)
    kept_manifests: int = 0
    kept_blobs: int = 0
    young_orphans: int = 0       # blobs no manifest names, kept because they are younger than the grace period
    in_use: int = 0              # manifests kept because a running build holds them or they are within the grace
    kept_cache: int = 0          # side cache groups kept
    dry_run: bool = False

    @property
    def bytes_freed(self) -> int:
        """Blobs, and a local cache group's files (a remote group's files are its blobs)."""
        return sum(r.size for r in self.removed if r.what in ("blob", "partial") or (r.what == "cache" and r.where == "local"))

    def to_json(self) -> dict:
        return {"dry_run": self.dry_run, "removed": [asdict(r) for r in self.removed],
                "kept_manifests": self.kept_manifests, "kept_blobs": self.kept_blobs, "kept_cache": self.kept_cache,
                "young_orphans": self.young_orphans, "in_use": self.in_use,
                "bytes_freed": self.bytes_freed}


# The keys of every artifact the lockfiles name, read when called (their lockfiles can change while gc runs).
Referenced = Callable[[], set[str]]


@dataclass
class _Listed:
    """The store's entries as gc found them, each with the stat it is judged by (a removal re-checks it)."""

    manifests: list[tuple[Manifest, Path, os.stat_result]] = field(default_factory=list)
    blobs: list[tuple[Path, os.stat_result]] = field(default_factory=list)
    groups: list[tuple[SideCache, CacheGroup]] = field(default_factory=list)


def _list_local(root: Path, caches: Sequence[SideCache]) -> _Listed:
    listed = _Listed()
    for path in sorted((root / "ac").glob("*/*.json")):
        try:
            data, st = read_regular(path, noatime=True)   # O_NOATIME: gc's own read does not disturb the LRU order
            listed.manifests.append((Manifest.from_json(json.loads(data)), path, st))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue   # removed meanwhile; or unreadable: `qbuild store verify --repair` reports and removes it
    for blob in sorted((root / "cas").glob("*/*")):
        try:
            if not blob.name.startswith("."):
                listed.blobs.append((blob, os.lstat(blob)))
        except FileNotFoundError:
            continue
    listed.groups = [(cache, group) for cache in caches for group in cache.groups(root)]
    return listed


def collect(store_root: Path, referenced: Referenced, keep_size: int, *, dry_run: bool = False,
            grace_s: float = GRACE_S, remote_url: str | None = None,
            caches: Sequence[SideCache] = ()) -> list[GcReport]:
    """`qbuild gc`: gc_local of the store at `store_root`, then, given `remote_url`, gc_remote of that remote (an
    explicit URL only: deleting shared artifacts is never configured). A malformed URL, or a lockfile that cannot be
    read, is refused before the local store is touched. Each gc reads the lockfiles again itself, after the leases of
    the builds running: read before them, they would miss what a build that ended in between locked."""
    if remote_url is not None:
        parse_remote(remote_url)
    referenced()
    reports = [gc_local(LocalStore(store_root.resolve()), referenced, keep_size, dry_run=dry_run, grace_s=grace_s,
                        caches=caches)]
    if remote_url is not None:
        reports.append(gc_remote(S3Remote(remote_url, probe=True), referenced, keep_size=keep_size, dry_run=dry_run,
                                 grace_s=grace_s, caches=caches))
    return reports


def gc_local(store: LocalStore, referenced: Referenced, keep_size: int, *, dry_run: bool = False,
             grace_s: float = GRACE_S, caches: Sequence[SideCache] = ()) -> GcReport:
    """Keep the manifests the lockfiles reference (`referenced()`), those a running build holds (see store/lease.py)
    and those written within `grace_s`, then the most recently used others while their blobs fit in `keep_size`
    bytes; remove the remaining manifests, then every blob no kept manifest names (but those a running build
    wrote or claimed, and blobs no manifest names at all only once older than `grace_s`). The groups of the side
    `caches` compete for the same budget by their last use; one used within `grace_s` or since a running build began,
    or held by a build, is kept.

    The order of the reads is what makes this safe beside builds. The entries are listed first, then the leases,
    then the lockfiles: whatever was listed was written by a build that is running when its lease is read (which
    protects what it wrote and used) or that ended before, having written its lockfile first (which protects it
    then); what a build writes after the listing is not touched. A removal checks its file again under the lock its
    writers take, so an entry a build put back or claimed meanwhile stays."""
    report = GcReport(dry_run=dry_run)
    listed = _list_local(store.root, caches)
    live = live_leases(store.root, reap=False)
    locked = referenced()
    if not dry_run:
        live.reap()
    now = time.time()
    entries: list[tuple[float, Manifest | tuple[SideCache, CacheGroup], Path | None, os.stat_result | None]] = []
    for manifest, path, st in listed.manifests:
        if manifest.key not in locked and (manifest.key in live.keys or live.protects(st.st_mtime)
                                           or now - st.st_mtime < grace_s):
            report.in_use += 1
            locked.add(manifest.key)
        entries.append((max(st.st_atime, st.st_mtime), manifest, path, st))
    for cache, group in listed.groups:
        if live.protects(group.used) or now - group.used < grace_s:
            report.in_use += 1
            report.kept_cache += 1
        else:
            entries.append((group.used, (cache, group), None, None))
    named = {o["digest"] for m, _, _ in listed.manifests for o in m.outputs.values()}
    kept_blobs = {o["digest"] for m, _, _ in listed.manifests if m.key in locked for o in m.outputs.values()}
    doomed, doomed_groups = _over_budget(entries, locked, kept_blobs, keep_size, report)
    _remove_manifests(store, doomed, kept_blobs, report)
    for cache, group in doomed_groups:
        if dry_run or cache.remove_group(store, group):
            report.removed.append(Removal("local", "cache", group.name, group.size, cache.name))
        else:   # a build took it meanwhile
            report.in_use += 1
            report.kept_cache += 1
    candidates = []
    for blob, st in listed.blobs:
        if blob.name in kept_blobs:
            report.kept_blobs += 1
        elif live.protects(st.st_ctime) or (blob.name not in named and now - st.st_ctime < grace_s):
            report.young_orphans += 1   # a running build's output or claim, or one whose manifest is not committed yet
        else:
            candidates.append((blob, st))
    gone = {b.name for b, _ in candidates} if dry_run else {b.name for b in store.discard_blobs(candidates)}
    report.removed += [Removal("local", "blob", blob.name, st.st_size) for blob, st in candidates if blob.name in gone]
    report.kept_blobs += len(candidates) - len(gone)   # claimed or linked since it was listed: in use again
    # Their own age, not the grace: a live write's partial file is moments old, however short a grace the user asks for.
    abandoned = store.abandoned_writes()
    gone_partials = [p for p, _ in abandoned] if dry_run else store.discard_abandoned(abandoned)
    report.removed += [Removal("local", "partial", p.name, st.st_size) for p, st in abandoned if p in gone_partials]
    return report


def _over_budget(entries: list, locked: set[str], kept_blobs: set[str], keep_size: int,
                 report: GcReport) -> tuple[list[tuple[Manifest, Path, os.stat_result]],
                                            list[tuple[SideCache, CacheGroup]]]:
    """The manifests and side cache groups beyond `keep_size`, most recently used kept first; `kept_blobs` gets the
    blobs of the manifests kept."""
    budget = keep_size
    doomed, doomed_groups = [], []
    for _, m, path, st in sorted(entries, key=lambda e: -e[0]):   # most recently used first
        if isinstance(m, tuple):    # (side cache, group)
            if m[1].size <= budget:
                budget -= m[1].size
                report.kept_cache += 1
            else:
                doomed_groups.append(m)
            continue
        if m.key in locked:
            report.kept_manifests += 1
            continue
        extra = {o["digest"]: o["size"] for o in m.outputs.values() if o["digest"] not in kept_blobs}
        cost = sum(extra.values()) + len(m.to_bytes())     # the manifest counts too: --keep-size 0 keeps none
        if cost <= budget:
            budget -= cost
            kept_blobs.update(extra)
            report.kept_manifests += 1
        else:
            doomed.append((m, path, st))
    return doomed, doomed_groups


def _remove_manifests(store: LocalStore, doomed: list, kept_blobs: set[str], report: GcReport) -> None:
    """Manifests before blobs: no reader may find a manifest whose blobs are gone. One a build put back or holds
    meanwhile stays, and so do its blobs."""
    for m, path, st in doomed:
        # A read-only store stops at the first one, before any blob goes: exit 3, nothing lost.
        if report.dry_run or store.discard_manifest(path, st):
            report.removed.append(Removal("local", "manifest", m.key, len(m.to_bytes()), m.kind))
        else:
            report.in_use += 1
            report.kept_manifests += 1
            kept_blobs.update(o["digest"] for o in m.outputs.values())


def gc_remote(remote: S3Remote, referenced: Referenced, *, keep_size: int = 0, dry_run: bool = False,
              grace_s: float = GRACE_S, caches: Sequence[SideCache] = ()) -> GcReport:
    """Remove every remote manifest no lockfile references and older than `grace_s` (one written since may be a
    push whose lockfile is not committed yet), and the index objects of the side `caches` beyond the `keep_size`
    budget (most recently written kept first; those written within `grace_s` always), then every blob no remaining
    manifest or index names (blobs nothing names at all only once older than `grace_s`: a publish uploads blobs
    before its manifest, a cache upload before its index). A gc that deletes holds the remote's gc lease
    (qbuild.store.remote): it waits for the pushes under way, and none starts until it is done, so no blob a push
    found present goes. The lockfiles are read (`referenced()`) once the lease is held, so one written while the gc
    waited for the pushes under way is read too."""
    if dry_run:
        return _gc_remote(remote, referenced(), keep_size, dry_run, grace_s, caches)
    with holding(remote, "gc"):
        return _gc_remote(remote, referenced(), keep_size, dry_run, grace_s, caches)


@dataclass(frozen=True)
class _Index:
    """One index object of a side cache on the remote, and the blobs it names."""

    cache: SideCache
    obj: object                     # the listed object (name, size, modified)
    blobs: set[str]

    @property
    def group(self) -> str:
        return self.obj.name.split(f"{self.cache.name}/", 1)[-1].removesuffix(".json")


def _list_indexes(remote: S3Remote, caches: Sequence[SideCache]) -> list[_Index]:
    listed = [(cache, o) for cache in caches for o in remote.list_objects(remote.object_key(cache.name) + "/")
              if o.name.endswith(".json")]
    blobs = map_all(lambda item: item[0].index_blobs(remote, item[1].name), listed, POOL_THREADS)
    return [_Index(cache, o, names) for (cache, o), names in zip(listed, blobs)]


def _gc_remote(remote: S3Remote, locked: set[str], keep_size: int, dry_run: bool, grace_s: float,
               caches: Sequence[SideCache]) -> GcReport:
    report = GcReport(dry_run=dry_run)
    listed = {m.name: m for m in remote.list_manifests()}
    blobs = list(remote.list_blobs())
    manifests = dict(zip(listed, map_all(remote.get_manifest, list(listed), POOL_THREADS)))
    indexes = _list_indexes(remote, caches)
    now = time.time()
    young = {k for k, obj in listed.items() if k not in locked and now - obj.modified.timestamp() < grace_s}
    report.in_use = len(young)
    locked |= young
    named = {o["digest"] for m in manifests.values() if m for o in m.outputs.values()}
    named |= {d for index in indexes for d in index.blobs}
    kept_blobs = {o["digest"] for k, m in manifests.items() if m and k in locked for o in m.outputs.values()}
    doomed = sorted(k for k in listed if k not in locked)
    report.kept_manifests = len(listed) - len(doomed)
    for key in doomed:
        m = manifests.get(key)
        report.removed.append(Removal(remote.url, "manifest", key, listed[key].size, m.kind if m else ""))
    doomed_indexes = _indexes_over_budget(remote, indexes, kept_blobs, {b.name: b.size for b in blobs}, keep_size,
                                          now - grace_s, report)
    if not dry_run:   # manifests and indexes before the blobs they name
        remote.delete([remote.manifest_key(k) for k in doomed] + [index.obj.name for index in doomed_indexes])
    gone = []
    for blob in blobs:
        if blob.name in kept_blobs:
            report.kept_blobs += 1
            continue
        if blob.name not in named and now - blob.modified.timestamp() < grace_s:
            report.young_orphans += 1
            continue
        report.removed.append(Removal(remote.url, "blob", blob.name, blob.size))
        gone.append(remote.blob_key(blob.name))
    if not dry_run:
        remote.delete(gone)
    return report


def _indexes_over_budget(remote: S3Remote, indexes: list[_Index], kept_blobs: set[str], sizes: dict[str, int],
                         budget: int, young_since: float, report: GcReport) -> list[_Index]:
    """The side caches' index objects beyond `budget`, most recently written kept first (and every one written after
    `young_since`); `kept_blobs` gets the blobs of those kept."""
    doomed = []
    for index in sorted(indexes, key=lambda i: -i.obj.modified.timestamp()):   # most recently written first
        extra = index.blobs - kept_blobs
        cost = sum(sizes.get(d, 0) for d in extra)
        young = index.obj.modified.timestamp() > young_since
        if young or cost <= budget:
            budget -= 0 if young else cost
            kept_blobs |= extra
            report.kept_cache += 1
        else:
            doomed.append(index)
            report.removed.append(Removal(remote.url, "cache", index.group, index.obj.size, index.cache.name))
    return doomed
