"""A local store backed by a remote one: reads go through to the remote, commits can push to it.

`get_manifest(key)` answers from the local store; on a local miss it reads the remote manifest, checks it (its key
is the hash of its preimage, its tree digest matches its outputs, its paths stay inside a tree), checks that the
remote holds each blob it names that is not local, with that blob's size (HEADs, in parallel), and returns it
WITHOUT downloading its blobs: deciding that a step is cached costs one small GET and a HEAD per blob, whatever the
step's size. An entry whose blob is gone or has another size is a miss (the step is rebuilt, and a push of the
rebuilt entry uploads the blobs the remote lacks), never a hit that fails later; `unusable(key)` says why. Bytes of
the right size but the wrong content are found when downloaded (below). The checked manifest is kept in memory, so
repeated lookups do not ask the remote again.

Blobs come down lazily, when something needs their bytes: `ensure_blobs(outputs)` (called by `materialize`, so by
every job laying out its inputs and by `pull`, and by the code that reads a blob directly) downloads the missing
ones in parallel and checks each blob's BLAKE3 digest (a blob that does not match is refused, naming the object,
and nothing of it enters the CAS). A remote manifest is written locally only once all its blobs are local, so the
local invariant "a manifest's blobs are present" holds for downloaded entries too.

Pushing uploads blobs first and the manifest last with a conditional put, so a reader of the remote never sees
a manifest whose blobs are missing, and an interrupted push leaves only unreferenced blobs (which the next push
reuses and `qbuild gc --remote` clears).

A push and a remote gc never overlap. A push that finds a blob present uploads nothing for it and names it in its
manifest; a gc running meanwhile could delete that blob (no manifest it read named it) before the manifest lands.
So each holds a lease object under `<prefix>/leases/` while it works: it writes its own, then lists the others. A
push that sees a live gc lease withdraws its own and waits; a gc that sees live push leases waits for them to end.
Listing after writing, with S3's strongly consistent listing, means that of a push and a gc that start together at
least one sees the other. A lease is live while its holder refreshes it (every LEASE_REFRESH_S), or, written by a
process of this machine and pid namespace, while that process runs; gc removes dead ones.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Union

from qbuild.core.errors import InfraError
from qbuild.core.hashing import digest_file, digest_json
from qbuild.core.threads import map_all
from qbuild.core.files import safe_join
from qbuild.store.spec import StoreSpec
from qbuild.store.local import CorruptBlobError, LocalStore
from qbuild.store.manifest import Manifest, tree_digest
from qbuild.store.s3 import TRANSFER_THREADS, S3Remote

Store = Union[LocalStore, "RemoteStore"]    # `store.local` is the local part of either (a LocalStore is its own)


UPLOAD_THREADS = 4      # files going up at once (each large one in TRANSFER_THREADS parts)
LEASE_REFRESH_S = 30.0  # how often a holder rewrites its lease
LEASE_TTL_S = 120.0     # a lease not rewritten for this long (by the server's clock) belongs to a process that is gone
LEASE_WAIT_S = 900.0    # how long a push waits for a gc to finish, or a gc for the pushes under way


def _process_start(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (/proc/<pid>/stat field 22): with the pid it names
    one process, whatever reuses the pid later. None where /proc does not tell."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _pid_namespace() -> str | None:
    """This boot of this machine and this process's pid namespace: where a lease's pid can be looked up."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


class RemoteLease:
    """This process's lease on a remote: `kind` "push" or "gc". Written by `write`, rewritten every LEASE_REFRESH_S
    by a thread once `keep` is called, removed by `release`."""

    def __init__(self, remote: S3Remote, kind: str):
        self.remote, self.kind = remote, kind
        self.name = f"{kind}-{uuid.uuid4().hex}"
        self.body = json.dumps({"kind": kind, "host": socket.gethostname(), "pid": os.getpid(),
                                "start": _process_start(os.getpid()), "namespace": _pid_namespace(),
                                "since": time.time()}).encode()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._written = time.monotonic()
        self.refresh_error: InfraError | None = None   # the last refresh that failed, while the lease has lapsed

    def write(self) -> None:
        self.remote.put_lease(self.name, self.body)
        self._written = time.monotonic()

    @property
    def lapsed(self) -> bool:
        """Whether refreshes failed long enough for another process to take this lease's holder for gone."""
        return self.refresh_error is not None and time.monotonic() - self._written >= LEASE_TTL_S

    def keep(self) -> None:
        self._stop.clear()

        def refresh() -> None:
            interval = LEASE_REFRESH_S
            while not self._stop.wait(interval):
                try:
                    self.write()
                    interval, self.refresh_error = LEASE_REFRESH_S, None
                except InfraError as e:
                    # Retried sooner, so that one failed request does not let the lease go stale; the holder
                    # learns of a lapse when it releases (holding).
                    interval, self.refresh_error = LEASE_REFRESH_S / 6, e

        self._thread = threading.Thread(target=refresh, name=f"qbuild-lease-{self.kind}", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.withdraw()

    def withdraw(self) -> None:
        """Remove the lease object (the refresh thread, if any, keeps running)."""
        try:
            self.remote.delete_lease(self.name)
        except InfraError:
            # Without s3:DeleteObject here, mark it released; failing that it goes stale after LEASE_TTL_S.
            try:
                self.remote.put_lease(self.name, json.dumps({"kind": self.kind, "released": True}).encode())
            except InfraError:
                pass


def live_leases(remote: S3Remote, kind: str, *, exclude: str = "", reap: bool = False) -> list[dict]:
    """The bodies of the live leases of `kind` on `remote` (but `exclude`, the caller's own); with `reap`, dead
    leases of any kind are deleted."""
    listed, now = remote.list_leases()
    live = []
    for obj in listed:
        if obj.name == exclude or not (reap or obj.name.startswith(f"{kind}-")):
            continue
        body = remote.get_lease(obj.name)
        if body is None and obj.name.startswith(f"{kind}-"):
            body = {}   # released meanwhile (gone) or unreadable: judged by its age alone
        if body is not None and _alive(body, obj.modified, now):
            if obj.name.startswith(f"{kind}-"):
                live.append(dict(body, name=obj.name))
        elif reap:
            try:
                remote.delete_lease(obj.name)
            except InfraError:
                pass
    return live


def _alive(body: dict, modified, now) -> bool:
    if body.get("released"):
        return False
    if body.get("namespace") is not None and body.get("namespace") == _pid_namespace() and body.get("start"):
        return _process_start(int(body.get("pid", 0))) == body["start"]
    age = ((now.timestamp() if now is not None else time.time()) - modified.timestamp())
    return age < LEASE_TTL_S


@contextmanager
def holding(remote: S3Remote, kind: str, wait_s: float = LEASE_WAIT_S) -> Iterator[RemoteLease]:
    """Hold a lease of `kind` ("push" or "gc") on `remote` for the block: a push once no gc is live (it withdraws
    its lease while it waits, so the gc can go on), a gc once no push is live (keeping its lease, so no new push
    starts). InfraError, one line naming the remote and the holder, after `wait_s` seconds of waiting."""
    lease = RemoteLease(remote, kind)
    other = "gc" if kind == "push" else "push"
    deadline, delay = time.monotonic() + wait_s, 0.1
    while True:
        lease.write()
        try:
            blocking = live_leases(remote, other, exclude=lease.name, reap=kind == "gc")
        except BaseException:
            lease.release()
            raise
        if not blocking:
            break
        if kind == "push":
            lease.withdraw()
        if time.monotonic() > deadline:
            lease.release()
            holder = blocking[0]
            raise InfraError(f"{remote.url}: a {other} (host {holder.get('host', '?')}, pid {holder.get('pid', '?')}) "
                             f"has held the remote for the {wait_s:.0f} s this {kind} waited; run it again once that "
                             f"is done, or remove {remote.object_url(remote.lease_key(holder['name']))} if that "
                             "process is gone")
        time.sleep(delay)
        delay = min(delay * 2, 2.0)
    lease.keep()
    try:
        yield lease
    finally:
        lapsed, error = lease.lapsed, lease.refresh_error
        lease.release()
    if lapsed:
        # The work finished, but for a while no one could see it held the remote: a gc may have run meanwhile.
        raise InfraError(f"{remote.url}: this {kind}'s lease went unrefreshed for over {LEASE_TTL_S:.0f} s "
                         f"({error}); a gc may have run meanwhile: run the {kind} again")


class Progress(Protocol):
    """Byte-level progress of one batch of transfers. `advance` is called from worker threads."""

    def begin(self, verb: str, files: int, total_bytes: int) -> None: ...
    def advance(self, nbytes: int) -> None: ...
    def file_done(self, name: str) -> None: ...
    def end(self) -> None: ...


class NoProgress:
    def begin(self, verb: str, files: int, total_bytes: int) -> None:
        pass

    def advance(self, nbytes: int) -> None:
        pass

    def file_done(self, name: str) -> None:
        pass

    def end(self) -> None:
        pass


@dataclass
class PushReport:
    blobs_uploaded: int = 0
    bytes_uploaded: int = 0
    blobs_present: int = 0
    blobs_repaired: int = 0         # on the remote but missing or not matching their digest: uploaded again
    manifests_uploaded: int = 0
    manifests_present: int = 0
    seconds: float = 0.0
    keys: list[str] = field(default_factory=list)     # manifests this push wrote

    def to_json(self) -> dict:
        return {"bytes_uploaded": self.bytes_uploaded, "blobs_uploaded": self.blobs_uploaded,
                "blobs_present": self.blobs_present, "blobs_repaired": self.blobs_repaired,
                "manifests_uploaded": self.manifests_uploaded, "manifests_present": self.manifests_present,
                "seconds": round(self.seconds, 3)}


class RemoteStore:
    """A local store (`local`) read through to a remote one (`remote`); `push=True` uploads every commit. Lookups
    never download blobs (see the module docstring); downloads report to `progress`. One object serves a whole
    command: the remote manifests it has checked are kept on it, so each is read from the remote once."""

    def __init__(self, local: LocalStore, remote: S3Remote, *, push: bool = False, progress: Progress | None = None):
        self.local = local
        self.remote = remote
        self.push = push
        self.progress: Progress = progress or NoProgress()
        self._pending: dict[str, Manifest] = {}     # checked remote manifests whose blobs are not all local yet
        self._unusable: dict[str, str] = {}         # key -> why the remote's manifest of it is not used
        self._pending_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RemoteStore({self.root}, {self.remote.url})"

    @property
    def root(self) -> Path:
        return self.local.root

    def blob_path(self, digest: str) -> Path:
        return self.local.blob_path(digest)

    def check_writable(self) -> None:
        self.local.check_writable()

    # --- read-through ----------------------------------------------------------------------------------------------
    def get_manifest(self, key: str) -> Manifest | None:
        local = self.local.get_manifest(key)
        if local is not None:
            return local
        with self._pending_lock:
            manifest = self._pending.get(key)
            if key in self._unusable:
                return None
        if manifest is None:
            manifest = self.remote.get_manifest(key)
            if manifest is None:
                return None
            self._check_manifest(key, manifest)
            problem = self._missing_blob(manifest)
            with self._pending_lock:
                if problem is not None:
                    self._unusable[key] = problem
                    return None
                self._pending[key] = manifest
        self._record_complete([manifest])   # a worker process may have downloaded its blobs already
        return manifest

    def unusable(self, key: str) -> str | None:
        """Why the remote's entry of `key` was found unusable by this store (a blob gone or of another size), if it
        was: get_manifest then answers None."""
        with self._pending_lock:
            return self._unusable.get(key)

    def _missing_blob(self, m: Manifest) -> str | None:
        """One line naming the first blob of `m` that is neither local nor on the remote with its size; None when
        every blob is in one place or the other."""
        wanted = {o["digest"]: (rel, o["size"]) for rel, o in sorted(m.outputs.items())
                  if not self.local.has_blob(o["digest"])}
        sizes = self.remote.blob_sizes(wanted)
        for digest, (rel, size) in sorted(wanted.items(), key=lambda kv: kv[1]):
            where = self.remote.object_url(self.remote.blob_key(digest))
            if digest not in sizes:
                return (f"{where}: blob of {rel} is missing on the remote although its manifest names it; "
                        f"{self.remote.repair_hint()}")
            if sizes[digest] != size:
                return (f"{where}: blob of {rel} has {sizes[digest]} bytes on the remote, its manifest says {size}; "
                        f"{self.remote.repair_hint()}")
        return None

    def _check_manifest(self, key: str, m: Manifest) -> None:
        where = self.remote.object_url(self.remote.manifest_key(key))
        if m.key != key or digest_json(m.preimage) != key:
            raise InfraError(f"{where}: manifest does not belong to key {key[:16]} (its preimage hashes elsewhere); "
                             "refusing it")
        if tree_digest(m.outputs) != m.digest:
            raise InfraError(f"{where}: manifest's tree digest does not match its outputs; refusing it")
        for rel in m.outputs:
            safe_join(self.root, rel)

    def ensure_blobs(self, outputs: dict[str, dict]) -> None:
        """Download the blobs of `outputs` that are not local, each checked against its digest, then record locally
        every remote manifest this store has returned whose blobs are now all here."""
        missing: dict[str, tuple[str, int]] = {}
        for rel, meta in sorted(outputs.items()):
            if not self.local.has_blob(meta["digest"]):
                missing.setdefault(meta["digest"], (rel, meta["size"]))
        if missing:
            name = f"fetch-{digest_json(sorted(missing))[:16]}"
            # Held while downloading, so `store verify --repair` sees the staging dir as live, not orphaned.
            with self.local.lock(name):
                missing = {d: v for d, v in missing.items() if not self.local.has_blob(d)}   # another process's?
                if missing:
                    stage = self.local.staging_dir(name)
                    try:
                        self._download_all(missing, stage)
                    finally:
                        shutil.rmtree(stage, ignore_errors=True)
        self._record_complete()

    def materialize(self, outputs: dict[str, dict], dest: Path, *, verify: bool = False, share: bool = True) -> None:
        """LocalStore.materialize, once the blobs it lays out are downloaded."""
        self.ensure_blobs(outputs)
        self.local.materialize(outputs, dest, verify=verify, share=share)

    def _record_complete(self, manifests: list[Manifest] | None = None) -> None:
        """Write locally those of `manifests` (default: every pending remote hit) whose blobs are all local. Whether
        they are is put_manifest's answer, given as it writes: one that names a blob not here (not downloaded yet, or
        removed meanwhile by gc) stays pending, and its blobs come down when it is used."""
        with self._pending_lock:
            candidates = list(self._pending.values()) if manifests is None else manifests
        for m in candidates:
            try:
                self.local.put_manifest(m)
            except CorruptBlobError as e:
                if not e.missing:
                    raise
                continue
            with self._pending_lock:
                self._pending.pop(m.key, None)

    def _download_all(self, missing: dict[str, tuple[str, int]], stage: Path) -> None:
        self.progress.begin("download", len(missing), sum(s for _, s in missing.values()))

        def one(item: tuple[str, tuple[str, int]]) -> None:
            digest, (rel, size) = item
            tmp = stage / digest
            self.remote.download_blob(digest, tmp, self.progress.advance)
            got = digest_file(tmp)
            if got != digest or tmp.stat().st_size != size:
                tmp.unlink(missing_ok=True)
                raise InfraError(f"{self.remote.object_url(self.remote.blob_key(digest))}: downloaded blob of {rel} "
                                 f"does not match its digest (got {got[:16]}, want {digest[:16]}); refusing it; "
                                 f"{self.remote.repair_hint()}")
            self.local.put_file(tmp, digest)
            self.progress.file_done(rel)

        try:
            map_all(one, sorted(missing.items()), TRANSFER_THREADS)
        finally:
            self.progress.end()

    # --- push ------------------------------------------------------------------------------------------------------
    def commit(self, manifest: Manifest) -> None:
        """Record a freshly built result locally, and upload it when this store pushes."""
        self.local.commit(manifest)
        if self.push:
            # An entry rebuilt because the remote's was unusable: its blobs are checked and mended even though the
            # remote holds its manifest.
            push_manifests(self.local, self.remote, [manifest], self.progress,
                           repair={manifest.key} if self.unusable(manifest.key) else ())


def push_manifests(store: LocalStore, remote: S3Remote, manifests: Iterable[Manifest],
                   progress: Progress | None = None, *, verify_remote: bool = False,
                   repair: Iterable[str] = ()) -> PushReport:
    """Upload `manifests` (from `store`) that the remote lacks: missing blobs first, then each manifest with a
    conditional put. Blob presence is checked in bulk; files go up in parallel, large ones in parallel parts.

    A blob counts as present when the remote has an object of its name and size. The blobs of a manifest the remote
    holds already are checked too for the keys in `repair` (by name and size) and, with `verify_remote`, for every
    given manifest, whose blobs are then read back and hashed; one that is missing or does not match is uploaded
    again: the repair for a remote object lost or corrupted after it was written."""
    progress = progress or NoProgress()
    start = time.monotonic()
    report = PushReport()
    todo = {m.key: m for m in manifests}
    if not todo:
        return report
    # From the first presence check to the last manifest: a blob found present must stay until the manifest
    # naming it is up (see the module docstring).
    with holding(remote, "push"):
        _push(store, remote, todo, progress, verify_remote, set(repair), report)
    report.seconds = time.monotonic() - start
    return report


def _push(store: LocalStore, remote: S3Remote, todo: dict[str, Manifest], progress: Progress, verify_remote: bool,
          repair: set[str], report: PushReport) -> None:
    present = remote.has_manifests(todo)
    report.manifests_present = len(present)
    checked = {k: m for k, m in todo.items() if k not in present or verify_remote or k in repair}
    todo = {k: m for k, m in todo.items() if k not in present}
    blobs: dict[str, tuple[str, int]] = {}
    for m in checked.values():
        for rel, meta in sorted(m.outputs.items()):
            blobs.setdefault(meta["digest"], (rel, meta["size"]))
    sizes = remote.blob_sizes(blobs)
    have = {d for d, size in sizes.items() if size == blobs[d][1]}    # an object of another size is not the blob
    if verify_remote:
        have = remote_blobs_matching(remote, {d: blobs[d] for d in have}, progress)
    named_remotely = {o["digest"] for k, m in checked.items() if k in present for o in m.outputs.values()}
    report.blobs_repaired = len((set(sizes) - have) | (named_remotely - set(sizes)))
    report.blobs_present = len(have)
    send = {d: v for d, v in blobs.items() if d not in have}
    upload_blobs(store, remote, send, progress)
    report.blobs_uploaded = len(send)
    report.bytes_uploaded = sum(s for _, s in send.values())
    for key, m in todo.items():   # blobs are all up: only now may a reader see the manifests
        if remote.put_manifest(m):
            report.manifests_uploaded += 1
            report.keys.append(key)
        else:
            report.manifests_present += 1


def upload_blobs(store: LocalStore, remote: S3Remote, blobs: dict[str, tuple[str, int]],
                 progress: Progress | None = None) -> None:
    """Upload `blobs` (digest -> (path in its tree, size)) from `store`, in parallel, largest first. Each is hashed
    first: a blob corrupt on this disk must never become the remote's copy."""
    progress = progress or NoProgress()
    for digest, (rel, _) in blobs.items():
        if not store.has_blob(digest):
            raise InfraError(f"{store.blob_path(digest)}: blob of {rel} is missing from the local store; "
                             "run `qbuild store verify --repair` and rebuild")
    progress.begin("upload", len(blobs), sum(s for _, s in blobs.values()))

    def one(item: tuple[str, tuple[str, int]]) -> None:
        digest, (rel, _) = item
        path = store.blob_path(digest)
        if digest_file(path) != digest:
            raise InfraError(f"{path}: local blob of {rel} does not match its digest; not uploading it. "
                             "Run `qbuild store verify --repair` and rebuild")
        remote.upload_blob(path, digest, progress.advance)
        progress.file_done(rel)

    try:
        map_all(one, sorted(blobs.items(), key=lambda kv: -kv[1][1]), UPLOAD_THREADS)
    finally:
        progress.end()


def remote_blobs_matching(remote: S3Remote, blobs: dict[str, tuple[str, int]], progress: Progress) -> set[str]:
    """The subset of `blobs` (digest -> (path, size)) whose bytes on the remote hash to their digest."""
    sound: set[str] = set()
    lock = threading.Lock()
    progress.begin("check", len(blobs), sum(size for _, size in blobs.values()))

    def one(item: tuple[str, tuple[str, int]]) -> None:
        digest, (rel, _) = item
        if remote.blob_digest(digest, progress.advance) == digest:
            with lock:
                sound.add(digest)
        progress.file_done(rel)

    try:
        map_all(one, sorted(blobs.items()), TRANSFER_THREADS)
    finally:
        progress.end()
    return sound


def open_store(spec: StoreSpec, progress: Progress | None = None, *, probe: bool = False) -> Store:
    """The local store, read through to spec.remote when one is set, its downloads reported to `progress`. Open it
    once per command: a remote-backed store keeps what it has checked. With `probe` (a command's own store, not a
    worker's), the remote's bucket is checked on its first use. It lives here, not in the package, so that code
    which only writes files (a step) does not have the remote's code, and boto3, in its keys."""
    local = LocalStore(Path(spec.local))
    if spec.remote is None:
        return local
    return RemoteStore(local, S3Remote(spec.remote, probe=probe), push=spec.push, progress=progress)
