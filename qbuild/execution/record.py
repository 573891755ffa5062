"""The build record: what the last build that wrote a lockfile did, step by step, for `qbuild report`'s timeline.

One small JSON document per lockfile, in this user's cache directory (`~/.cache/qbuild/builds/<the lockfile's
name>-<a digest of its absolute path>.json`), so a build leaves nothing in the working tree beside the lockfile. It is
replaced whole (staged, then renamed) when a build ends: readers see the old record or the new one, and of two builds
that end at once, the last to finish wins. It holds facts about a run (wall-clock times, the worker of each step), never
an input: nothing on the planning or keying path reads it, so it cannot move a key.

    {"version": 1, "lockfile": name, "host": the driver's host name, "started": unix time, "ended": unix time,
     "interrupted": bool,
     "steps": [{"id", "name", "kind", "outcome": built | cached | failed | skipped | interrupted,
                "start", "end": unix times, "worker": who ran it or null, "error": why it failed or was skipped,
                "built_seconds": for a cached step, how long its build took when it was built, "retries": n}]}
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

from qbuild.core import jsonio
from qbuild.core.errors import UserError
from qbuild.core.userfile import read_small_file
from qbuild.core.files import atomic_write

if TYPE_CHECKING:
    from qbuild.execution.engine import Event

RECORD_VERSION = 1
MAX_RECORD_BYTES = 64 << 20      # a build of every shipped recipe records a few hundred steps: tens of KiB
OUTCOMES = ("built", "cached", "failed", "skipped", "interrupted")


def record_path(lock_path: Path) -> Path:
    """Where the builds that write `lock_path` leave their record: one per lockfile, by its absolute path."""
    from qbuild.core.hashing import digest_json
    from qbuild.core.userdir import cache_dir

    where = digest_json({"lockfile": str(Path(lock_path).resolve())})[:16]
    return cache_dir("builds") / f"{Path(lock_path).name}-{where}.json"


class BuildRecorder:
    """Collects a build's events as they arrive (in the driver, from the engine's on_event) and writes the record."""

    def __init__(self, lock_path: Path, clock=time.time):
        self.lock_path = lock_path
        self._clock = clock
        self.started = clock()
        self.steps: dict[str, dict] = {}     # node id -> its step, in the order each node was first heard of

    def on_event(self, e: Event) -> None:
        now = self._clock()
        step = self.steps.get(e.node.id)
        if step is None:
            step = self.steps[e.node.id] = {"id": e.node.id, "name": e.node.name, "kind": e.node.kind,
                                            "outcome": "interrupted", "start": now, "end": None, "worker": None,
                                            "error": None, "built_seconds": None, "retries": 0}
        if e.kind == "start":
            step["start"], step["end"] = now, None     # a retry after a corrupt input starts the step again
            return
        if e.kind in ("corrupt", "missing"):
            step["retries"] += 1
            return
        step["outcome"], step["end"] = e.kind, now
        if e.kind in ("failed", "skipped"):
            step["error"] = e.error
        meta = e.manifest.meta if e.manifest is not None else {}
        if e.kind == "built":
            step["worker"] = meta.get("worker")
        if e.kind == "failed":
            step["worker"] = e.worker
        if e.kind == "cached" and step["end"] == step["start"]:
            step["built_seconds"] = meta.get("seconds")   # found in the store: its build was an earlier one's

    def to_json(self, interrupted: bool) -> dict:
        return {"version": RECORD_VERSION, "lockfile": self.lock_path.name, "host": socket.gethostname(),
                "started": self.started, "ended": self._clock(), "interrupted": interrupted,
                "steps": list(self.steps.values())}

    def write(self, interrupted: bool) -> Path:
        """Replace the lockfile's record with this build's (InfraError where it cannot be written)."""
        path = record_path(self.lock_path)
        atomic_write(path, (jsonio.dumps(self.to_json(interrupted), indent=1, sort_keys=True) + "\n").encode())
        return path


def read_record(lock_path: Path) -> tuple[dict | None, str | None]:
    """(the last build's record, None), or (None, why there is none to show): never recorded, or unreadable."""
    path = record_path(lock_path)
    if not path.is_file():
        return None, f"no build recorded for {lock_path} yet ({path}): `qbuild compile` writes it"
    try:
        doc = json.loads(read_small_file(path, MAX_RECORD_BYTES, "the build record"))
    except (ValueError, UserError) as e:   # not JSON, not UTF-8, not a regular file, too large
        return None, f"{path}: unreadable build record: {e}"
    if not isinstance(doc, dict) or doc.get("version") != RECORD_VERSION or not isinstance(doc.get("steps"), list):
        return None, f"{path}: not a build record of version {RECORD_VERSION}"
    return doc, None
