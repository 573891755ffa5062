"""Model sources: where a fetched snapshot's bytes live on this machine, checked against the snapshot's digests.

A snapshot (the fetch action's output) names files by content digest only, so keys are the same on every
machine. The bytes stay where they are: in the local checkpoint directory, or in the Hugging Face cache.
"""

from __future__ import annotations

import json
from pathlib import Path

from .arch import hf_cached_snapshot
from .errors import UserError
from .hashing import default_stat_cache


def read_snapshot(directory: Path) -> dict:
    return json.loads((directory / "snapshot.json").read_text())


def locate(snapshot: dict, context: dict) -> dict[str, Path]:
    """Map each file of `snapshot` to a path on this machine whose content matches the recorded digest."""
    if snapshot["source"] == "path":
        root = Path(context["path"])
        cache = default_stat_cache()
        files = {}
        for name, meta in snapshot["files"].items():
            path = root / name
            if not path.is_file():
                raise UserError(f"{path}: missing; the checkpoint changed since it was planned")
            if "blake3:" + cache.digest(path) != meta["digest"]:
                raise UserError(f"{path}: content changed since it was planned; run the command again")
            files[name] = path
        return files
    found = hf_cached_snapshot(snapshot["repo"], snapshot["revision"])
    if found is None:
        raise UserError(f"{snapshot['repo']}@{snapshot['revision'][:12]}: not in the HF cache on this machine")
    files = {}
    for name, meta in snapshot["files"].items():
        path = found[1] / name
        if not path.is_file() or path.stat().st_size != meta["size"]:
            raise UserError(f"{path}: missing or truncated in the HF cache; run `qbuild compile` to fetch it again")
        files[name] = path
    return files
