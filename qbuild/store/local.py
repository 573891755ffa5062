"""The local store: a content-addressed blob store plus an action cache of manifests.

Layout under the store root:
    cas/ab/<blake3>          immutable blobs (read-only files), shared by every manifest that names them
    ac/ab/<key>.json         one manifest per action key: the key's preimage and the output tree
    staging/<key>.<nonce>/   an action's scratch space while it runs
    locks/<key>.lock         held while a key is being built, so concurrent processes build it once

Every write is stage + fsync + rename; a manifest is written only after all its blobs are in place, so a
process killed at any point leaves either a complete entry or none (plus garbage that `verify`/`gc` clears).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from qbuild.core.errors import InfraError
from qbuild.core.hashing import digest_file
from qbuild.store.files import atomic_write, clone_or_copy, discard_path, infra_error, link_or_copy, safe_join
from qbuild.store.manifest import Manifest, tree_digest


class CorruptBlobError(InfraError):
    """A blob whose bytes no longer match its digest (found on use)."""

    def __init__(self, digest: str, message: str):
        super().__init__(message)
        self.digest = digest

    def __reduce__(self):
        return (CorruptBlobError, (self.digest, str(self)))


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
        path = self.manifest_path(key)
        if not path.is_file():   # absent, or something else in its place (a FIFO would block the read)
            return None
        try:
            manifest = Manifest.from_json(json.loads(path.read_bytes()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            # A manifest that cannot be read is treated as absent; the rebuild replaces it atomically.
            return None
        # An entry whose blobs are gone (removed as corrupt, or by gc) is a miss, so the node is rebuilt.
        if not all(self.has_blob(o["digest"]) for o in manifest.outputs.values()):
            return None
        return manifest

    def put_manifest(self, manifest: Manifest) -> None:
        missing = [p for p, o in manifest.outputs.items() if not self.has_blob(o["digest"])]
        assert not missing, f"manifest {manifest.key} names blobs not in the store: {missing}"
        path = self.manifest_path(manifest.key)
        if path.exists() and not path.is_file():
            discard_path(path)   # a directory in its place would make every commit of this key fail
        atomic_write(path, manifest.to_bytes())

    def commit(self, manifest: Manifest) -> None:
        """Record a freshly built result (a remote-backed store also publishes it when asked to push)."""
        self.put_manifest(manifest)

    def manifests(self) -> Iterator[Manifest]:
        for path in sorted((self.root / "ac").glob("*/*.json")):
            m = self.get_manifest(path.stem)
            if m is not None:
                yield m

    def delete_manifest(self, key: str) -> None:
        self.manifest_path(key).unlink(missing_ok=True)

    # --- blobs ---------------------------------------------------------------------------------------------
    def has_blob(self, digest: str) -> bool:
        return self.blob_path(digest).is_file()

    def put_file(self, src: Path, digest: str | None = None) -> str:
        """Move `src` into the CAS (it is consumed). Returns its digest."""
        digest = digest or digest_file(src)
        dst = self.blob_path(digest)
        if dst.is_file():
            src.unlink()
            return digest
        try:
            if dst.exists() or dst.is_symlink():
                discard_path(dst)   # a directory or a dangling link squats the blob's name: the blob replaces it
            dst.parent.mkdir(parents=True, exist_ok=True)
            with open(src, "rb+") as f:
                os.fsync(f.fileno())
            os.chmod(src, 0o444)
            os.replace(src, dst)
        except OSError as e:
            raise infra_error(e, dst) from None
        return digest

    def put_blob_from(self, src: Path, digest: str) -> None:
        """Copy a file whose digest is already known (e.g. downloaded and checked) into the CAS."""
        if self.has_blob(digest):
            return
        tmp = self.staging_dir(f"blob-{digest[:16]}") / "blob"
        shutil.copyfile(src, tmp)
        self.put_file(tmp, digest)
        shutil.rmtree(tmp.parent, ignore_errors=True)

    def ingest_tree(self, directory: Path) -> dict[str, dict]:
        """Move every file under `directory` into the CAS; returns {relative path: {digest, size}}."""
        outputs: dict[str, dict] = {}
        for path in sorted(directory.rglob("*")):
            if path.is_symlink():
                raise InfraError(f"{path}: actions may not write symlinks into their outputs")
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
        where the filesystem supports one, else a copy), for a writer the read-only bit does not stop (root)."""
        self.ensure_blobs(outputs)
        for rel, meta in sorted(outputs.items()):
            target = safe_join(dest, rel)
            blob = self.blob_path(meta["digest"])
            try:
                if verify and (not blob.is_file() or digest_file(blob) != meta["digest"]):
                    # Never serve it: drop the blob so every entry naming it becomes a miss and is rebuilt.
                    discard_path(blob)
                    raise CorruptBlobError(meta["digest"], f"{rel}: stored blob {meta['digest'][:16]} was corrupt "
                                                           "and has been removed; it will be rebuilt")
                if target.exists() or target.is_symlink():
                    target.unlink()
                (link_or_copy if share else clone_or_copy)(blob, target)
            except CorruptBlobError:
                raise
            except (FileNotFoundError, InfraError):   # link_or_copy reports a vanished source as an InfraError
                if blob.is_file():
                    raise
                # Removed under us (by gc, or by hand): every entry naming it is a miss now, so it is rebuilt.
                raise CorruptBlobError(meta["digest"], f"{rel}: stored blob {meta['digest'][:16]} is missing from "
                                                       "the store; it will be rebuilt") from None

    # --- staging and locks ---------------------------------------------------------------------------------
    def check_writable(self) -> None:
        """Raise InfraError unless new entries can be written here (called before a build starts any step)."""
        try:
            self.staging_dir("write-check").rmdir()
        except OSError as e:
            raise InfraError(f"{self.root}: cannot write to the store ({e.strerror or e}); use a writable --store") \
                from None

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
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path), timeout=timeout):
            yield

    # --- maintenance ---------------------------------------------------------------------------------------
    def verify(self, repair: bool = False) -> list[str]:
        """Check every blob's digest, every manifest's blobs and the staging dirs; returns one line per problem
        found. (`qbuild store verify` also checks the Neuron compile cache: qbuild.store.compile_cache.verify.)"""
        problems: list[str] = []
        bad_blobs: set[str] = set()
        for blob in sorted((self.root / "cas").glob("*/*")):
            # Anything but a regular file (a directory, a FIFO someone put there) is as corrupt as wrong bytes.
            try:
                bad = (blob.name.startswith(".") or not blob.is_file() or blob.is_symlink()
                       or digest_file(blob) != blob.name)
            except FileNotFoundError:
                continue   # removed meanwhile (by gc): nothing left to check
            if bad:
                problems.append(f"corrupt blob {blob}")
                bad_blobs.add(blob.name)
                if repair:
                    discard_path(blob)
        # Every manifest file, read directly: `manifests()` skips entries whose blobs are gone, which are exactly
        # the ones to report (and, with --repair, to drop so that they are rebuilt).
        for path in sorted((self.root / "ac").glob("*/*.json")):
            try:
                if not path.is_file():
                    raise OSError("not a regular file")
                m = Manifest.from_json(json.loads(path.read_bytes()))
            except FileNotFoundError:
                continue
            except (OSError, ValueError, KeyError, TypeError):
                problems.append(f"unreadable manifest {path}")
                if repair:
                    discard_path(path)
                continue
            missing = [p for p, o in m.outputs.items() if o["digest"] in bad_blobs or not self.has_blob(o["digest"])]
            if missing:
                problems.append(f"manifest {m.key[:16]} ({m.kind}) lost {', '.join(missing)}")
                if repair:
                    path.unlink(missing_ok=True)
            elif tree_digest(m.outputs) != m.digest:
                problems.append(f"manifest {m.key[:16]} ({m.kind}) has a wrong tree digest")
                if repair:
                    path.unlink(missing_ok=True)
        for d in sorted((self.root / "staging").glob("*")):
            key = d.name.split(".")[0]
            try:
                with self.lock(key, timeout=0):
                    problems.append(f"orphaned staging {d.name}")
                    if repair:
                        shutil.rmtree(d, ignore_errors=True)
            except TimeoutError:
                continue  # a live build owns it
        return problems
