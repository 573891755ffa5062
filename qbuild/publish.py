"""Moving locked artifacts between stores: publish to the remote, pull a bundle, and collect garbage.

    publish    the lockfile's nodes of some recipes -> the remote (blobs first, manifests last, conditionally)
    pull       one recipe's locked bundle (its package node's outputs) -> a directory, every digest checked
    gc         drop store entries no lockfile references: locally beyond an LRU size budget, remotely all

All three read the lockfile, never the recipes, so a serving host needs nothing but qbuild and artifacts.lock.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Iterable

from .errors import InfraError, UserError
from .lock import resolve_recipe
from .store.local import LocalStore, discard_path
from .store.manifest import Manifest
from .store.remote import NoProgress, Progress, PushReport, RemoteStore, push_manifests
from .store.s3 import S3Remote
from .units import parse_duration, parse_size

ORPHAN_GRACE_S = 3600.0   # a blob no manifest names may belong to a push or build still in flight


# --- choosing locked nodes -----------------------------------------------------------------------------------------

def recipe_names(doc: dict, lock_path: Path, recipes: list[str], all_: bool) -> list[str]:
    """Lock entries named by recipe name or recipe file (see lock.resolve_recipe); --all takes every one."""
    if all_:
        if not doc["recipes"]:
            raise UserError(f"{lock_path}: --all, but the lockfile names no recipes; run `qbuild compile` first")
        return sorted(doc["recipes"])
    if not recipes:
        raise UserError("name at least one recipe (as in the lockfile), or pass --all")
    return list(dict.fromkeys(resolve_recipe(doc, lock_path, r) for r in recipes))


def locked_nodes(doc: dict, lock_path: Path, names: list[str]) -> dict[str, tuple[str, str, dict]]:
    """node id -> (recipe, role, lock node entry) for every node the named recipes lock."""
    out: dict[str, tuple[str, str, dict]] = {}
    for name in names:
        for role, nid in sorted(doc["recipes"][name]["nodes"].items()):
            node = doc["nodes"].get(nid)
            if node is None:
                raise UserError(f"{lock_path}: {name}: {role}: node {nid} is missing from the lockfile")
            out.setdefault(nid, (name, role, node))
    return out


# --- publish -------------------------------------------------------------------------------------------------------

def publish(store: LocalStore, remote: S3Remote, doc: dict, lock_path: Path, names: list[str],
            progress: Progress | None = None, *, verify_remote: bool = False) -> PushReport:
    """Upload every locked node of `names` that the remote lacks. Idempotent: a second run uploads nothing.
    `verify_remote` reads back every blob the remote has for them and re-uploads the ones that do not match."""
    manifests: list[Manifest] = []
    absent: dict[str, tuple[str, str]] = {}
    for recipe, role, node in locked_nodes(doc, lock_path, names).values():
        m = LocalStore.get_manifest(store, node["key"])
        if m is None:
            absent[node["key"]] = (recipe, role)
            continue
        if m.digest != node["digest"]:
            raise UserError(f"{lock_path}: {recipe}: {role}: the store's entry for key {node['key'][:16]} has digest "
                            f"{m.digest[:16]}, the lockfile {node['digest'][:16]}; rebuild with `qbuild compile`")
        manifests.append(m)
    if absent:
        on_remote = remote.has_manifests(absent)
        for key, (recipe, role) in absent.items():
            if key not in on_remote:
                raise UserError(f"{recipe}: {role} (key {key[:16]}) is in neither the local store ({store.root}) "
                                f"nor {remote.url}; run `qbuild compile` for it first")
    report = push_manifests(store, remote, manifests, progress, verify_remote=verify_remote)
    report.manifests_present += len(absent)
    return report


# --- pull ----------------------------------------------------------------------------------------------------------

def pull_bundle(store: LocalStore, doc: dict, lock_path: Path, recipe: str, dest: Path, *, share: bool,
                allow_unverified: bool = False) -> Manifest:
    """Lay out the locked bundle of `recipe` in `dest` (new or empty), checking every digest first. With `share` the
    files are the store's own read-only blobs (hardlinks); without, they share no inode with it (see materialize).
    A bundle whose verify did not pass is refused unless `allow_unverified`.

    Through a RemoteStore only the manifest is read at lookup; `materialize` then downloads (ensure_blobs) and
    verifies exactly the bundle's blobs; a blob that does not match aborts the pull before anything is written to
    `dest`."""
    name = recipe_names(doc, lock_path, [recipe], False)[0]
    entry = doc["recipes"][name]
    nid = entry["nodes"].get("package")
    node = doc["nodes"].get(nid) if nid else None
    if node is None:
        raise UserError(f"{lock_path}: {name} has no locked bundle (its package step has not been built)")
    if not entry.get("verified") and not allow_unverified:
        why = entry.get("verify_failure") or "its verify step has not run"
        raise UserError(f"{lock_path}: {name}: the bundle is not verified ({why}); refusing to lay it out. Fix the "
                        "recipe and rebuild, or pass --allow-unverified")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UserError(f"{dest}: exists and is not an empty directory; pull into a new or empty one")
    manifest = store.get_manifest(node["key"])
    if manifest is None:
        if isinstance(store, RemoteStore):
            raise InfraError(f"{name}: bundle {node['key'][:16]} is in neither the local store ({store.root}) nor "
                             f"{store.remote.url}; publish it there with `qbuild publish {name}`")
        raise InfraError(f"{name}: bundle {node['key'][:16]} is not in the local store ({store.root}); "
                         "pass --remote s3://bucket/prefix to fetch it")
    if manifest.digest != node["digest"] or manifest.outputs != node["outputs"]:
        raise InfraError(f"{name}: the stored bundle {node['key'][:16]} differs from the one {lock_path} locks "
                         f"(digest {manifest.digest[:16]} vs {node['digest'][:16]}); refusing it")
    stage = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        store.materialize(manifest.outputs, stage, verify=True, share=share)
        if dest.exists():
            dest.rmdir()
        os.replace(stage, dest)
    except OSError as e:
        raise InfraError(f"{dest}: {e.strerror or e}") from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return manifest


# --- gc ------------------------------------------------------------------------------------------------------------

@dataclass
class Removal:
    where: str          # "local" or the remote URL
    what: str           # "manifest" | "blob"
    name: str           # key or digest
    size: int
    kind: str = ""      # the manifest's action kind


@dataclass
class GcReport:
    removed: list[Removal] = field(default_factory=list)
    kept_manifests: int = 0
    kept_blobs: int = 0
    young_orphans: int = 0       # blobs no manifest names, kept because they are younger than the grace period
    dry_run: bool = False

    @property
    def bytes_freed(self) -> int:
        return sum(r.size for r in self.removed if r.what == "blob")

    def to_json(self) -> dict:
        return {"dry_run": self.dry_run, "removed": [asdict(r) for r in self.removed],
                "kept_manifests": self.kept_manifests, "kept_blobs": self.kept_blobs,
                "young_orphans": self.young_orphans, "bytes_freed": self.bytes_freed}


def referenced_keys(docs: Iterable[dict]) -> set[str]:
    return {node["key"] for doc in docs for node in doc["nodes"].values()}


def gc_local(store: LocalStore, docs: list[dict], keep_size: int, *, dry_run: bool = False,
             grace_s: float = ORPHAN_GRACE_S) -> GcReport:
    """Keep the manifests the lockfiles reference, then the most recently used others while their blobs fit in
    `keep_size` bytes; remove the remaining manifests, then every blob no kept manifest names (blobs no manifest
    names at all only once older than `grace_s`)."""
    report = GcReport(dry_run=dry_run)
    locked = referenced_keys(docs)
    entries: list[tuple[float, Manifest, Path]] = []
    for path in sorted((store.root / "ac").glob("*/*.json")):
        manifest = _read_manifest(path)
        try:
            st = path.stat()
        except FileNotFoundError:
            continue  # removed meanwhile
        if manifest is None:
            continue  # unreadable: `qbuild store verify --repair` reports and removes it
        entries.append((max(st.st_atime, st.st_mtime), manifest, path))
    named = {o["digest"] for _, m, _ in entries for o in m.outputs.values()}
    kept_blobs = {o["digest"] for _, m, _ in entries if m.key in locked for o in m.outputs.values()}
    budget = keep_size
    doomed: list[tuple[Manifest, Path]] = []
    for _, m, path in sorted(entries, key=lambda e: -e[0]):   # most recently used first
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
            doomed.append((m, path))
    for m, path in doomed:   # manifests first: no reader may find a manifest whose blobs are gone
        report.removed.append(Removal("local", "manifest", m.key, len(m.to_bytes()), m.kind))
        if not dry_run:
            discard_path(path)   # a read-only store stops here, before any blob goes: exit 3, nothing lost
    now = time.time()
    for blob in sorted((store.root / "cas").glob("*/*")):
        if blob.name.startswith(".") or blob.name in kept_blobs:
            report.kept_blobs += blob.name in kept_blobs
            continue
        try:
            st = blob.stat()
        except FileNotFoundError:
            continue
        if blob.name not in named and now - st.st_ctime < grace_s:
            report.young_orphans += 1
            continue
        report.removed.append(Removal("local", "blob", blob.name, st.st_size))
        if not dry_run:
            discard_path(blob)
    return report


def gc_remote(remote: S3Remote, docs: list[dict], *, dry_run: bool = False,
              grace_s: float = ORPHAN_GRACE_S) -> GcReport:
    """Remove every remote manifest no lockfile references, then every blob no remaining manifest names (blobs no
    manifest names at all only once older than `grace_s`: a publish uploads blobs before its manifest)."""
    from concurrent.futures import ThreadPoolExecutor

    from .store.s3 import POOL_THREADS

    report = GcReport(dry_run=dry_run)
    locked = referenced_keys(docs)
    listed = {m.name: m for m in remote.list_manifests()}
    blobs = list(remote.list_blobs())
    with ThreadPoolExecutor(POOL_THREADS) as pool:
        manifests = dict(zip(listed, pool.map(remote.get_manifest, listed)))
    named = {o["digest"] for m in manifests.values() if m for o in m.outputs.values()}
    kept_blobs = {o["digest"] for k, m in manifests.items() if m and k in locked for o in m.outputs.values()}
    doomed = sorted(k for k in listed if k not in locked)
    report.kept_manifests = len(listed) - len(doomed)
    for key in doomed:
        m = manifests.get(key)
        report.removed.append(Removal(remote.url, "manifest", key, listed[key].size, m.kind if m else ""))
    if not dry_run:
        remote.delete([remote.manifest_key(k) for k in doomed])
    now = time.time()
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


def _read_manifest(path: Path) -> Manifest | None:
    """Read a manifest without marking it used (O_NOATIME where allowed), so gc does not disturb the LRU order."""
    import json

    flags = os.O_RDONLY | getattr(os, "O_NOATIME", 0)
    try:
        try:
            fd = os.open(path, flags)
        except PermissionError:
            fd = os.open(path, os.O_RDONLY)   # O_NOATIME needs ownership of the file
        with os.fdopen(fd, "rb") as f:
            return Manifest.from_json(json.loads(f.read()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


# --- progress on stderr ----------------------------------------------------------------------------------------------

class TransferDisplay:
    """Transfer progress on stderr: a rich bar with bytes/s on a TTY (unless `bars` is False, e.g. under the build's
    live display), plain lines with rates elsewhere. Thread-safe; implements store.remote.Progress."""

    LINE_EVERY_S = 5.0

    def __init__(self, bars: bool | None = None):
        self.bars = sys.stderr.isatty() if bars is None else bars
        self._lock = threading.Lock()
        self._bar = None
        self._task = None
        self.verb, self.files, self.total, self.done, self.started, self._last_line = "", 0, 0, 0, 0.0, 0.0
        self.files_done = 0

    def begin(self, verb: str, files: int, total_bytes: int) -> None:
        self.verb, self.files, self.total, self.done, self.files_done = verb, files, total_bytes, 0, 0
        self.started = self._last_line = time.monotonic()
        if not files:
            return
        if self.bars:
            from rich.progress import (BarColumn, DownloadColumn, Progress as Bar, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)

            from .render import console_err

            self._bar = Bar(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                            TimeRemainingColumn(), console=console_err(), transient=True)
            self._bar.start()
            self._task = self._bar.add_task(f"{verb} {_files(files)}", total=total_bytes)
        else:
            self._line(f"{verb} {_files(files)}, {_human(total_bytes)}")
        self.started = self._last_line = time.monotonic()   # the rate counts transfer time, not setup

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            if self._bar is not None:
                self._bar.update(self._task, advance=nbytes)
            elif self.files and time.monotonic() - self._last_line >= self.LINE_EVERY_S:
                self._last_line = time.monotonic()
                self._line(f"  {self.verb}: {_human(self.done)} of {_human(self.total)} ({self._rate()})")

    def file_done(self, name: str) -> None:
        with self._lock:
            self.files_done += 1

    def end(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        if self.files and self.files_done == self.files:   # a transfer that failed is reported by its error
            self._line(f"{self.verb}ed {_files(self.files)}, {_human(self.done)} in "
                       f"{time.monotonic() - self.started:.1f}s ({self._rate()})")

    def _rate(self) -> str:
        return f"{_human(self.done / max(time.monotonic() - self.started, 1e-6))}/s"

    @staticmethod
    def _line(text: str) -> None:
        from .render import console_err

        console_err().print(text, markup=False, highlight=False, soft_wrap=True)


def _files(n: int) -> str:
    return f"{n} file" if n == 1 else f"{n} files"


def _human(n: float) -> str:
    from .render import human_bytes

    return human_bytes(int(n))


__all__ = ["GcReport", "NoProgress", "ORPHAN_GRACE_S", "PushReport", "Removal", "TransferDisplay", "gc_local",
           "gc_remote", "locked_nodes", "parse_duration", "parse_size", "publish", "pull_bundle", "recipe_names"]
