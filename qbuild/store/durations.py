"""How long a step about to be built will take, going by the store: the duration of the last build of the same kind
and architecture, from the manifests' meta "seconds" (the time the step ran, as qbuild.execution.job records it;
meta is in no key and no output digest).

For a compile, "the same" is, first, a manifest whose preimage has the very same params (the same architecture,
shapes, backend and compiler settings: an earlier build by other code or another toolchain); else one of the same
architecture (the params' "text" or "vision" fingerprint), graph and backend (other buckets). "Last" is the newest
manifest file. Only the local store is read (a remote hit counts once its entry is recorded here), once per build, at
the first timed step that must be built.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qbuild.store.local import LocalStore

# The params fields that fingerprint a compile's architecture (the backends' compile params: text: Arch, vision:
# VisionArch), and those that must agree besides.
ARCH_FIELDS = ("text", "vision")
ALSO_SAME = ("graph", "backend")


class Durations:
    """The durations of earlier builds in a local store, read on first use."""

    def __init__(self, store: LocalStore):
        self._root = Path(store.root)
        self._seen: dict[str, list[tuple[dict, float]]] = {}    # kind -> [(params, seconds)], newest first

    def expected(self, kind: str, preimage: dict) -> float | None:
        """Seconds the last build of `kind` like the one keyed by `preimage` took; None where none is stored."""
        params = preimage.get("params")
        earlier = self._of(kind)
        for same in (lambda p: p == params, lambda p: same_architecture(p, params)):
            for theirs, seconds in earlier:
                if same(theirs):
                    return seconds
        return None

    def _of(self, kind: str) -> list[tuple[dict, float]]:
        if kind not in self._seen:
            self._seen[kind] = _scan(self._root, kind)
        return self._seen[kind]


def same_architecture(a: object, b: object) -> bool:
    """Whether two steps' params describe the same architecture (ARCH_FIELDS), graph and backend."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    return any(f in a and a.get(f) == b.get(f) for f in ARCH_FIELDS) and \
        all(a.get(f) == b.get(f) for f in ALSO_SAME)


def _scan(root: Path, kind: str) -> list[tuple[dict, float]]:
    """(params, seconds) of every built manifest of `kind` under `root`, newest first. A manifest that cannot be read
    is skipped: this is an estimate, never a check."""
    found: list[tuple[float, dict, float]] = []
    quoted = json.dumps(kind).encode()
    for path in (root / "ac").glob("*/*.json"):
        try:
            raw = path.read_bytes()
            mtime = path.stat().st_mtime
            if quoted not in raw:        # most manifests are of other kinds: skip them before parsing
                continue
            doc = json.loads(raw)
            seconds, params = doc["meta"]["seconds"], doc["preimage"]["params"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if doc.get("kind") == kind and isinstance(seconds, (int, float)) and seconds > 0:
            found.append((mtime, params, float(seconds)))
    found.sort(key=lambda e: -e[0])
    return [(params, seconds) for _, params, seconds in found]
