"""The source checkpoint's files on the machine a step runs on, for every step that reads its bytes
(Step.reads_checkpoint: convert, shard, materialize, reference): found through the snapshot the fetch step recorded (a
local checkpoint at its path, a Hub model in the HF cache), and a Hub model fetched again here where this machine lacks
it (a Ray worker other than the fetch's).

Machinery, not a step's code: every file is checked against the digest the snapshot records before a step reads it,
so where the files are found cannot change a step's output, and no step's key holds this module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from qbuild.core.errors import InfraError, UserError
from qbuild.hub.snapshot import locate, read_snapshot
from qbuild.planning.step import Checkpoint, Context, Source
from qbuild.recipe.params import FetchHub


def locate_checkpoint(snapshot_dir: Path, source: Source, scratch: Path, log: Callable[[str], None],
                      store=None) -> Checkpoint:
    """The checkpoint of the snapshot at `snapshot_dir` on this machine. A local checkpoint must be at the path the
    plan names (`source`); a Hub model missing from this machine's HF cache is downloaded at the snapshot's commit by
    the fetch step itself, and must give the snapshot's files."""
    snapshot = read_snapshot(snapshot_dir)
    digests = {name: meta["digest"] for name, meta in snapshot["files"].items()}
    try:
        return Checkpoint(locate(snapshot, source.path), digests)
    except UserError:
        if snapshot["source"] != "hf":
            raise
    _fetch_again(snapshot, scratch, log, store)
    return Checkpoint(locate(snapshot, source.path), digests)


def _fetch_again(snapshot: dict, scratch: Path, log: Callable[[str], None], store) -> None:
    from qbuild.steps.fetch import Fetch

    repo, commit = snapshot["repo"], snapshot["revision"]
    log(f"{repo}@{commit[:12]} is not in this machine's HF cache: fetching it")
    out = scratch / "fetched"
    out.mkdir()
    Fetch.run(Context(FetchHub("hf", repo, commit), {}, out, scratch, log=log, store=store))
    if read_snapshot(out)["files"] != snapshot["files"]:
        raise InfraError(f"model.hf: {repo}@{commit[:12]}: the files fetched on this machine differ from the "
                         "snapshot the build is keyed on")
