"""Digests and keys: BLAKE3 over canonical JSON and over files, with a stat cache for large files; and the digests
the Hugging Face Hub names files by (sha256, git blob sha1), so that its files' bytes can be checked against them."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3

from qbuild.core import jsonio

# Files above this are hashed with blake3's own thread pool over a memory map.
_MMAP_THRESHOLD = 8 << 20


def canonical_json(obj: Any) -> bytes:
    """The one serialisation every key and digest is computed over: sorted keys, no whitespace, UTF-8."""
    return jsonio.dumps(obj, sort_keys=True, compact=True, ensure_ascii=False).encode()


def digest_bytes(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def digest_json(obj: Any) -> str:
    return digest_bytes(canonical_json(obj))


def digest_file(path: Path) -> str:
    """BLAKE3 of a file's bytes; large files are hashed multi-threaded from a memory map."""
    size = path.stat().st_size
    if size >= _MMAP_THRESHOLD:
        return blake3.blake3(max_threads=blake3.blake3.AUTO).update_mmap(path).hexdigest()
    with open(path, "rb") as f:
        return blake3.blake3(f.read()).hexdigest()


def sha256_file(path: Path) -> str:
    """sha256 of a file's bytes, streamed: what the Hub names an LFS file by."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def is_commit(value: object) -> bool:
    """Whether `value` is a full git commit id, 40 lowercase hex (what a key or a pin may hold), not a branch, a tag
    or a short sha: the one check of it, for the Hub's revisions, a port's rev and the lockfile's pins alike."""
    return isinstance(value, str) and len(value) == 40 and all(c in "0123456789abcdef" for c in value)


def git_blob_sha1(data: bytes) -> str:
    """git's blob id of `data` (see git_blob_sha1_file)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def git_blob_sha1_file(path: Path) -> str:
    """git's blob id of a file (sha1 of "blob <size>" NUL and the bytes), streamed: what the Hub names a file kept in
    git (not LFS) by."""
    with open(path, "rb") as f:
        header = b"blob %d\0" % os.fstat(f.fileno()).st_size
        return hashlib.file_digest(f, lambda: hashlib.sha1(header)).hexdigest()


# Algorithm (as a digest's "algo:" prefix names it) -> the function over a file, and the stat cache's table for it.
# blake3's table keeps its old name, so the digests already cached stay valid.
FILE_DIGESTS: dict[str, tuple[Callable[[Path], str], str]] = {
    "blake3": (digest_file, "files_v2"),
    "sha256": (sha256_file, "sha256_v1"),
    "git-sha1": (git_blob_sha1_file, "git_sha1_v1"),
}


# A file modified less than this long ago may still be changing within its timestamp's granularity, so its digest
# is never served from nor stored in the cache (git's "racy timestamp" rule).
RACY_WINDOW_NS = 60 * 10**9


class StatCache:
    """Maps (device, inode, size, mtime_ns, ctime_ns) of a file to its BLAKE3 digest (or, with `algo`, another digest of
    FILE_DIGESTS, each in its own table), so unchanged files are never re-hashed.

    ctime is part of the identity because tools restore mtime (`touch -r`, `rsync --times`, backup restores) but no
    user tool can set ctime back: a file rewritten in place with its old size and mtime still gets a new ctime.
    Files whose mtime is under RACY_WINDOW_NS old are always re-hashed. Backed by SQLite in WAL mode so concurrent
    qbuild processes can share it; a lost write only costs a re-hash.
    """

    def __init__(self, path: Path, hash_file: Callable[[Path], str] | None = None, algo: str = "blake3"):
        """`hash_file` digests a file the cache cannot answer for (default: the function of `algo`)."""
        self.path = path
        default, self._table = FILE_DIGESTS[algo]
        self.hash_file = hash_file or default
        self._local = threading.local()

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            import sqlite3   # only where a file is digested; a cached plan never opens the stat cache

            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=30)
            db.execute("PRAGMA journal_mode=WAL")
            # files_v2, a new table name: rows of the old (dev, ino, size, mtime) table must never answer a lookup.
            db.execute(f"CREATE TABLE IF NOT EXISTS {self._table} (dev INTEGER, ino INTEGER, size INTEGER, "
                       "mtime INTEGER, ctime INTEGER, digest TEXT, PRIMARY KEY (dev, ino, size, mtime, ctime))")
            self._local.db = db
        return db

    def digest(self, path: Path) -> str:
        st = path.stat()
        if time.time_ns() - st.st_mtime_ns < RACY_WINDOW_NS:
            return self.hash_file(path)
        ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        row = self._db().execute(f"SELECT digest FROM {self._table} WHERE dev=? AND ino=? AND size=? AND mtime=? "
                                 "AND ctime=?", ident).fetchone()
        if row:
            return row[0]
        digest = self.hash_file(path)
        with self._db() as db:
            db.execute(f"INSERT OR REPLACE INTO {self._table} VALUES (?, ?, ?, ?, ?, ?)", (*ident, digest))
        return digest


def default_stat_cache(algo: str = "blake3") -> StatCache:
    """This user's stat cache of `algo` digests (one SQLite file holds every algorithm's table)."""
    from qbuild.core.userdir import cache_dir

    return StatCache(cache_dir("statcache.sqlite"), algo=algo)
