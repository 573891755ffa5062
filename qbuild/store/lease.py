"""Build leases: how a running build tells `qbuild gc` what it must not remove.

A build holds `<store>/leases/<pid>-<nonce>.lease` for its lifetime, with an exclusive flock on it. The first line
is a JSON header with the time the build started; each later line is the key of an entry the build has used (a
cache hit) or produced. gc keeps every entry a live lease names and every entry written since the oldest live
lease began (the build's fresh outputs, including blobs whose manifest is not committed yet).

A lease whose flock can be taken belongs to a build that is gone (killed, crashed): gc removes it, so a dead build
never protects anything beyond the grace period. Lines are appended, never rewritten, so a reader sees at worst a
partial last line, which names no key and is ignored.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from qbuild.core.errors import InfraError
from qbuild.core.files import infra_error

LEASES_DIR = "leases"
# mtimes and time.time() come from one clock, but a filesystem may round an mtime down (to 1 or 2 s on some).
CLOCK_SLACK_S = 2.0


class Lease:
    """A held lease; `add` records a key the build depends on. Release it with `close` (or use it as a context)."""

    def __init__(self, store_root: Path):
        directory = Path(store_root) / LEASES_DIR
        try:
            directory.mkdir(parents=True, exist_ok=True)
            name = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
            tmp = directory / f".{name}.tmp"
            self._file = open(tmp, "a")
            # Locked before it takes its real name, so gc never sees this lease unlocked and takes it for dead.
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX)
            self.since = time.time()
            self._file.write(json.dumps({"pid": os.getpid(), "since": self.since}) + "\n")
            self._file.flush()
            self.path = directory / f"{name}.lease"
            os.replace(tmp, self.path)
        except OSError as e:
            raise infra_error(e, directory) from None
        self._keys: set[str] = set()

    def add(self, key: str) -> None:
        if key in self._keys:
            return
        self._keys.add(key)
        self._file.write(key + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file.closed:
            return
        self.path.unlink(missing_ok=True)
        self._file.close()   # releases the flock

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_lease(store_root: Path) -> Lease | None:
    """A lease on the store at `store_root`, or None where none can be written (a read-only store, which no gc can
    change either; a build reports why it cannot write there before it starts a step)."""
    try:
        return Lease(store_root)
    except InfraError:
        return None


@dataclass
class LiveLeases:
    """What the running builds of a store hold: the start of the oldest, and every key any of them named."""

    count: int = 0
    since: float | None = None
    keys: set[str] = field(default_factory=set)
    dead: list[Path] = field(default_factory=list)   # leases nobody holds: their builds are gone

    def protects(self, mtime: float) -> bool:
        return self.since is not None and mtime >= self.since - CLOCK_SLACK_S

    def reap(self) -> None:
        """Remove the leases of the builds that are gone (a lease's name is its build's own: it never comes back)."""
        for path in self.dead:
            path.unlink(missing_ok=True)
        self.dead.clear()


def live_leases(store_root: Path, *, reap: bool = True) -> LiveLeases:
    """Read the leases of live builds; with `reap`, remove those of builds that are gone."""
    out = LiveLeases()
    for path in sorted((Path(store_root) / LEASES_DIR).glob("*.lease")):
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            continue   # released meanwhile
        with f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                lines = f.read().decode("utf-8", "replace").split("\n")
                try:
                    since = float(json.loads(lines[0])["since"])
                except (ValueError, KeyError, TypeError):
                    since = 0.0   # a live build's lease we cannot read: protect everything it might have written
                out.count += 1
                out.since = since if out.since is None else min(out.since, since)
                out.keys.update(k for k in lines[1:-1] if k)
                continue
            out.dead.append(path)   # nobody holds it: its build is gone
    if reap:
        out.reap()
    return out
