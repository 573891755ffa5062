"""The local store: a content-addressed blob store plus an action cache of manifests.

Layout under the store root:
    cas/ab/<blake3>          immutable blobs (read-only files), shared by every manifest that names them
    ac/ab/<key>.json         one manifest per action key: the key's preimage and the output tree
    staging/<key>.<nonce>/   a step's scratch space while it runs
    locks/<key>.lock         held while a key is being built, so concurrent processes build it once

Every write is stage + fsync + rename; a manifest is written only after all its blobs are in place, so a
process killed at any point leaves either a complete entry or none (plus garbage that `verify`/`gc` clears).

Other processes (builds, `gc`, `store verify --repair`) change the store while this one reads it, so nothing here
tests a path and then acts on what the test said: an entry is looked at once (one lstat, or one descriptor), a name
that vanished meanwhile is skipped, and a removal happens only if the name still holds the very file that was judged,
checked again under the lock its writers take (docs/architecture.md section 5).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import stat
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from qbuild.core.errors import InfraError
from qbuild.core.hashing import digest_file
from qbuild.core.files import (PARTIAL, atomic_write, clone_or_copy, discard_path, infra_error, link_or_copy,
                                read_regular, safe_join, same_file, staged_for)
from qbuild.store.manifest import Manifest, tree_digest

# Taken shared by every writer of a blob, exclusively by every remover (locks/cas.lock): see `discard_blobs`.
CAS_LOCK = "cas.lock"
# A partial write of a manifest this old has no writer left (a rename follows its write within moments).
ABANDONED_WRITE_S = 3600.0
# A blob's mtime is set this far back when it is stored, so that any later write into it (by a step that writes into
# an input, which is a hardlink to it: qbuild/execution/job.py) moves its mtime, even within the clock tick it was made in.
BLOB_BACKDATE_NS = 10**9


class CorruptBlobError(InfraError):
    """A blob that cannot be used: its bytes no longer match its digest, or (`missing`) it is gone from the store,
    removed meanwhile by gc or by hand. Either way every entry naming it is a miss and its producer is rebuilt."""

    def __init__(self, digest: str, message: str, missing: bool = False):
        super().__init__(message)
        self.digest = digest
        self.missing = missing

    def __reduce__(self):
        return (CorruptBlobError, (self.digest, str(self), self.missing))


class LocalStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise InfraError(f"{self.root}: the store is not a directory; point --store (or QBUILD_STORE) at a "
                             "directory")

    def __repr__(self) -> str:
        return f"LocalStore({self.root})"

    @property
    def local(self) -> "LocalStore":
        """The local part of this store, for reads that must not go through to a remote: all of it."""
        return self

    # --- paths ---------------------------------------------------------------------------------------------
    def blob_path(self, digest: str) -> Path:
        return self.root / "cas" / digest[:2] / digest

    def manifest_path(self, key: str) -> Path:
        return self.root / "ac" / key[:2] / f"{key}.json"

    # --- action cache --------------------------------------------------------------------------------------
    def get_manifest(self, key: str) -> Manifest | None:
        try:
            manifest = Manifest.from_json(json.loads(read_regular(self.manifest_path(key))[0]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            # Absent, or a manifest that cannot be read (or something else in its place): treated as absent; the
            # rebuild replaces it atomically.
            return None
        # An entry whose blobs are gone (removed as corrupt, or by gc) is a miss, so the node is rebuilt.
        if not all(self.has_blob(o["digest"]) for o in manifest.outputs.values()):
            return None
        return manifest

    def put_manifest(self, manifest: Manifest) -> None:
        """Record `manifest`; CorruptBlobError (missing) where a blob it names is not in the store, as when one was
        removed as corrupt (`store verify --repair`) after this process put it: the step is built again."""
        for rel, meta in sorted(manifest.outputs.items()):
            if not self.has_blob(meta["digest"]):
                raise CorruptBlobError(meta["digest"], f"{rel}: blob {meta['digest'][:16]} of key {manifest.key[:16]} "
                                                       "left the store before its entry was written; it will be "
                                                       "rebuilt", missing=True)
        path = self.manifest_path(manifest.key)
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                discard_path(path)   # a directory in its place would make every commit of this key fail
        except FileNotFoundError:
            pass
        atomic_write(path, manifest.to_bytes())

    def commit(self, manifest: Manifest) -> None:
        """Record a freshly built result (a remote-backed store also publishes it when asked to push)."""
        self.put_manifest(manifest)

    def manifests(self) -> Iterator[Manifest]:
        for path in sorted((self.root / "ac").glob("*/*.json")):
            m = self.get_manifest(path.stem)
            if m is not None:
                yield m

    # --- blobs ---------------------------------------------------------------------------------------------
    def has_blob(self, digest: str) -> bool:
        return self.blob_path(digest).is_file()

    def put_file(self, src: Path, digest: str | None = None) -> str:
        """Move `src` into the CAS (it is consumed). Returns its digest.

        A blob already there is claimed instead (`_claim`), so that a gc running meanwhile sees it as just written and
        keeps it; one it removed first is put back from `src`."""
        digest = digest or digest_file(src)
        dst = self.blob_path(digest)
        try:
            size = os.stat(src).st_size
            with self.cas_lock():
                if _claim(dst, size):
                    src.unlink()
                    return digest
            with open(src, "rb+") as f:
                os.fsync(f.fileno())
            _backdate(src)
            os.chmod(src, 0o444)
            with self.cas_lock():
                try:
                    if not stat.S_ISREG(os.lstat(dst).st_mode):
                        discard_path(dst)   # a directory or a link squats the blob's name: the blob replaces it
                except FileNotFoundError:
                    dst.parent.mkdir(parents=True, exist_ok=True)
                os.replace(src, dst)
        except OSError as e:
            raise infra_error(e, dst) from None
        return digest

    @contextmanager
    def cas_lock(self, *, exclusive: bool = False) -> Iterator[None]:
        """Shared while a blob is put or claimed, exclusive while blobs are removed (`discard_blobs`), so a removal
        that checks a blob again under it never takes one put back or claimed since it was judged. Writers never
        wait on each other; a remover waits for the puts under way (each a rename or a chmod) and none starts until
        it is done."""
        path = self.root / "locks" / CAS_LOCK
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as e:
            raise infra_error(e, path) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)   # releases the flock

    def discard_blobs(self, judged: list[tuple[Path, os.stat_result]]) -> list[Path]:
        """Remove each blob of `judged` (its path and the lstat it was judged by) whose name still holds that file,
        untouched (`same_file`); returns those removed. A blob put back, claimed or linked since stays."""
        removed = []
        with self.cas_lock(exclusive=True):
            for path, then in judged:
                if _unchanged(path, then):
                    discard_path(path)
                    removed.append(path)
        return removed

    def discard_manifest(self, path: Path, judged: os.stat_result) -> bool:
        """Remove the manifest at `path` if it still is the file `judged` was taken of; whether it went. Checked
        under its key's lock, which a build holds while it commits: a manifest a build put back meanwhile stays, and
        so does one whose key a build holds now (it replaces it)."""
        try:
            with self.lock(path.stem, timeout=0):
                if not _unchanged(path, judged):
                    return False
                discard_path(path)
                return True
        except TimeoutError:
            return False

    def ingest_tree(self, directory: Path) -> dict[str, dict]:
        """Move every file under `directory` into the CAS; returns {relative path: {digest, size}}."""
        outputs: dict[str, dict] = {}
        for path in sorted(directory.rglob("*")):
            if path.is_symlink():
                raise InfraError(f"{path}: a step may not write symlinks into its outputs")
            if not path.is_file():
                continue
            rel = path.relative_to(directory).as_posix()
            size = path.stat().st_size
            outputs[rel] = {"digest": self.put_file(path), "size": size}
        return outputs

    def ensure_blobs(self, outputs: dict[str, dict]) -> None:
        """Make the blobs of an output tree local before reading them. A no-op here; a remote-backed store
        downloads (and checks) the ones it lacks. Call it before reading a blob's bytes through `blob_path`."""

    def materialize(self, outputs: dict[str, dict], dest: Path, *, verify: bool = False,
                    share: bool = True) -> None:
        """Lay out an output tree under `dest`: with `share`, by hardlinking blobs (copying across filesystems), so
        the files ARE the store's read-only blobs; without, as files that share no inode with the store (a reflink
        where the filesystem supports one, else a copy), for a writer the read-only bit does not stop (root).
        With `verify` each blob's bytes are checked first. CorruptBlobError for a blob that is corrupt (removed here,
        so every entry naming it is rebuilt) or missing (removed meanwhile, by gc or by hand)."""
        self.ensure_blobs(outputs)
        for rel, meta in sorted(outputs.items()):
            target = safe_join(dest, rel)
            blob = self.blob_path(meta["digest"])
            if verify:
                self._check_blob(blob, meta["digest"], rel)
            target.unlink(missing_ok=True)
            try:
                (link_or_copy if share else clone_or_copy)(blob, target)
            except (FileNotFoundError, InfraError):   # link_or_copy reports a vanished source as an InfraError
                if os.path.lexists(blob):
                    raise
                raise self._missing(meta["digest"], rel) from None

    def _check_blob(self, blob: Path, digest: str, rel: str) -> None:
        """Raise CorruptBlobError unless the blob at `blob` holds `digest`'s bytes; drop it where it does not (if the
        name still holds the file that was hashed: one put back meanwhile is checked again)."""
        for _ in range(2):
            try:
                st = os.lstat(blob)
                if stat.S_ISREG(st.st_mode) and digest_file(blob) == digest:
                    return
            except FileNotFoundError:
                raise self._missing(digest, rel) from None
            if self.discard_blobs([(blob, st)]):
                raise CorruptBlobError(digest, f"{rel}: stored blob {digest[:16]} was corrupt and has been removed; "
                                               "it will be rebuilt")
        raise CorruptBlobError(digest, f"{rel}: stored blob {digest[:16]} changed while it was checked; it will be "
                                       "rebuilt")

    @staticmethod
    def _missing(digest: str, rel: str) -> CorruptBlobError:
        # Removed under us (by gc, or by hand): every entry naming it is a miss now, so it is rebuilt.
        return CorruptBlobError(digest, f"{rel}: stored blob {digest[:16]} is missing from the store (removed "
                                        "meanwhile); it will be rebuilt", missing=True)

    # --- staging and locks ---------------------------------------------------------------------------------
    def check_writable(self) -> None:
        """Raise InfraError unless new entries can be written here (called before a build starts any step)."""
        try:
            probe = self.staging_dir("write-check")
        except OSError as e:
            raise InfraError(f"{self.root}: cannot write to the store ({e.strerror or e}); use a writable --store") \
                from None
        shutil.rmtree(probe, ignore_errors=True)   # `store verify --repair` may have taken it already

    def staging_dir(self, key: str) -> Path:
        d = self.root / "staging" / f"{key}.{uuid.uuid4().hex[:12]}"
        d.mkdir(parents=True)
        return d

    def clear_staging(self, key: str) -> None:
        """Remove leftovers of an earlier, killed build of `key` (call while holding its lock)."""
        for d in (self.root / "staging").glob(f"{key}.*"):
            shutil.rmtree(d, ignore_errors=True)

    @contextmanager
    def lock(self, key: str, timeout: float = -1) -> Iterator[None]:
        from filelock import FileLock   # only builds take locks; planning never loads it

        path = self.root / "locks" / f"{key}.lock"
        lock = FileLock(str(path), timeout=timeout)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            lock.acquire()
        except TimeoutError:
            raise
        except OSError as e:   # a read-only store: exit 3 naming it
            raise infra_error(e, path) from None
        try:
            yield
        finally:
            lock.release()

    # --- maintenance ---------------------------------------------------------------------------------------
    def verify(self, repair: bool = False) -> list[str]:
        """Check every blob's digest, every manifest's blobs and the staging dirs; returns one line per problem
        found. (`qbuild store verify` also checks the side caches the backends register: qbuild.store.side_cache.)

        Builds and gc may run meanwhile: an entry removed or replaced between its listing and its check is no
        problem (gc removes a manifest before its blobs; a build replaces a file whole), and `repair` removes only
        the very file found wrong."""
        judged, bad_blobs = [], set()
        for blob in sorted((self.root / "cas").glob("*/*")):
            st = _corrupt(blob)
            if st is not None:
                judged.append((blob, st))
                bad_blobs.add(blob.name)
        problems = [f"corrupt blob {blob}" for blob, _ in judged]
        if repair and judged:
            self.discard_blobs(judged)
        for path in sorted((self.root / "ac").glob("*/*.json")):
            found = self._manifest_problem(path, bad_blobs)
            if found is not None:
                problems.append(found[0])
                if repair:
                    self.discard_manifest(path, found[1])
        for path, st in self.abandoned_writes():
            problems.append(f"abandoned partial write {path}")
            if repair:
                self.discard_abandoned([(path, st)])
        return problems + self._verify_staging(repair)

    def abandoned_writes(self, older_than_s: float = ABANDONED_WRITE_S) -> list[tuple[Path, os.stat_result]]:
        """The temporary files of manifest writes (store.files.staged: `.<name>.partial-<nonce>` beside the entry)
        older than `older_than_s`, with the lstat each was judged by: a write killed between its write and its rename
        leaves one. A live write renames its file within moments, so one that old has no writer."""
        found, now = [], time.time()
        for path in sorted((self.root / "ac").glob(f"*/.*{PARTIAL}*")):
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue   # renamed into place or removed meanwhile
            if now - st.st_mtime >= older_than_s:
                found.append((path, st))
        return found

    def discard_abandoned(self, judged: list[tuple[Path, os.stat_result]]) -> list[Path]:
        """Remove each abandoned partial write of `judged` that is still the file it was judged by and whose key no
        build holds (a build commits under its key's lock); those removed."""
        removed = []
        for path, st in judged:
            key = Path(staged_for(path)).stem
            try:
                with self.lock(key, timeout=0):
                    if _unchanged(path, st):
                        discard_path(path)
                        removed.append(path)
            except TimeoutError:
                continue
        return removed

    def _manifest_problem(self, path: Path, bad_blobs: set[str]) -> tuple[str, os.stat_result] | None:
        """What is wrong with the manifest at `path` and the lstat it was judged by; None where nothing is, or where
        the name no longer holds the file that was read (removed or replaced meanwhile)."""
        try:
            st = os.lstat(path)
            m = Manifest.from_json(json.loads(read_regular(path)[0]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            problem = f"unreadable manifest {path}"
        else:
            missing = [p for p, o in m.outputs.items() if o["digest"] in bad_blobs or not self.has_blob(o["digest"])]
            if missing:
                problem = f"manifest {m.key[:16]} ({m.kind}) lost {', '.join(missing)}"
            elif tree_digest(m.outputs) != m.digest:
                problem = f"manifest {m.key[:16]} ({m.kind}) has a wrong tree digest"
            else:
                return None
        return (problem, st) if _unchanged(path, st) else None

    def _verify_staging(self, repair: bool) -> list[str]:
        problems = []
        for d in sorted((self.root / "staging").glob("*")):
            key = d.name.split(".")[0]
            try:
                with self.lock(key, timeout=0):
                    if not os.path.lexists(d):
                        continue   # its build finished and removed it meanwhile (under this lock, no one adds it)
                    problems.append(f"orphaned staging {d.name}")
                    if repair:
                        shutil.rmtree(d, ignore_errors=True)
            except TimeoutError:
                continue  # a live build owns it
        return problems


def _backdate(path: Path) -> None:
    """Set a new blob's mtime BLOB_BACKDATE_NS back; a file linked elsewhere too (an output a step linked from its
    input, which was a blob before) keeps its own, which another step may be checking as an input."""
    st = os.stat(path)
    if st.st_nlink == 1:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - BLOB_BACKDATE_NS))


def _claim(blob: Path, size: int) -> bool:
    """Whether the store already holds a blob of `size` bytes at `blob`; if so, mark it just written (a chmod sets its
    ctime, which gc reads as its age: docs/architecture.md section 5) so that a gc running meanwhile keeps it. False
    where there is none, where another file squats the name or has another size (both replaced), and where the
    blob is another user's (replaced by this one's, which gc sees as new). Call under the shared CAS lock."""
    try:
        st = os.lstat(blob)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return False
        os.chmod(blob, 0o444)
    except (FileNotFoundError, PermissionError):
        return False
    return True


def _unchanged(path: Path, judged: os.stat_result) -> bool:
    """Whether `path` still holds the file `judged` was taken of, untouched since."""
    try:
        return same_file(judged, os.lstat(path))
    except FileNotFoundError:
        return False


def _corrupt(blob: Path) -> os.stat_result | None:
    """The lstat of the blob at `blob` if it is corrupt: anything but a regular file (a directory, a FIFO someone put
    there) is as corrupt as wrong bytes. None where it is sound, gone (removed meanwhile: nothing left to check), or
    replaced while it was hashed (the new file is checked next time)."""
    try:
        st = os.lstat(blob)
        if not blob.name.startswith(".") and stat.S_ISREG(st.st_mode) and digest_file(blob) == blob.name:
            return None
    except FileNotFoundError:
        return None
    return st if _unchanged(blob, st) else None
