"""The source checkpoint's files on the machine a step runs on, for every step that reads its bytes (convert, shard,
materialize): found through the snapshot the fetch step recorded (a local checkpoint at its path, a Hub model in the
HF cache), and a Hub model fetched again here where this machine lacks it (a Ray worker other than the fetch's).
"""

from __future__ import annotations

from pathlib import Path

from qbuild.execution.actions import RunContext
from qbuild.core.errors import InfraError, UserError
from qbuild.recipe.params import FetchHub
from qbuild.hub.checkpoint import locate, read_snapshot


def source_files(ctx: RunContext) -> tuple[dict[str, Path], dict[str, str]]:
    """(file name -> its path here, file name -> its digest) of the checkpoint of the snapshot ctx.inputs["snapshot"].
    A local checkpoint must be at the path the plan names (ctx.context); a Hub model missing from this machine's HF
    cache is downloaded at the snapshot's commit by the fetch action itself, and must give the snapshot's files."""
    snapshot = read_snapshot(ctx.inputs["snapshot"])
    digests = {name: meta["digest"] for name, meta in snapshot["files"].items()}
    try:
        return locate(snapshot, ctx.context), digests
    except UserError:
        if snapshot["source"] != "hf":
            raise
    _fetch_again(snapshot, ctx)
    return locate(snapshot, ctx.context), digests


def _fetch_again(snapshot: dict, ctx: RunContext) -> None:
    from qbuild.execution.actions import fetch

    repo, commit = snapshot["repo"], snapshot["revision"]
    ctx.log(f"{repo}@{commit[:12]} is not in this machine's HF cache: fetching it")
    out = ctx.scratch / "fetched"
    out.mkdir()
    fetch.run(RunContext("fetch", FetchHub("hf", repo, commit), {}, out, ctx.scratch, ctx.context, ctx.log,
                         ctx.store))
    if read_snapshot(out)["files"] != snapshot["files"]:
        raise InfraError(f"model.hf: {repo}@{commit[:12]}: the files fetched on this machine differ from the "
                         "snapshot the build is keyed on")
