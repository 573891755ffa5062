"""Digests and keys: BLAKE3 over canonical JSON and over files, with a stat cache for large files."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import blake3

# Files above this are hashed with blake3's own thread pool over a memory map.
_MMAP_THRESHOLD = 8 << 20


def canonical_json(obj: Any) -> bytes:
    """The one serialisation every key and digest is computed over: sorted keys, no whitespace, UTF-8."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


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


class StatCache:
    """Maps (device, inode, size, mtime_ns) of a file to its BLAKE3 digest, so unchanged files are never re-hashed.

    Backed by SQLite in WAL mode so concurrent qbuild processes can share it; a lost write only costs a re-hash.
    """

    def __init__(self, path: Path):
        self.path = path
        self._local = threading.local()

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            import sqlite3   # only where a file is digested; a cached plan never opens the stat cache

            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=30)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("CREATE TABLE IF NOT EXISTS files (dev INTEGER, ino INTEGER, size INTEGER, mtime INTEGER,"
                       " digest TEXT, PRIMARY KEY (dev, ino, size, mtime))")
            self._local.db = db
        return db

    def digest(self, path: Path) -> str:
        st = path.stat()
        ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        row = self._db().execute("SELECT digest FROM files WHERE dev=? AND ino=? AND size=? AND mtime=?",
                                 ident).fetchone()
        if row:
            return row[0]
        digest = digest_file(path)
        with self._db() as db:
            db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?)", (*ident, digest))
        return digest


def default_stat_cache() -> StatCache:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return StatCache(Path(base) / "qbuild" / "statcache.sqlite")
