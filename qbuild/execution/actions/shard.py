"""shard: converted text weights -> weights/tp{r}_sharded_checkpoint.safetensors per rank, made by streaming the
source checkpoint through the convert step's description (qbuild.model.convert.shard.shard_checkpoint), by the rules of
the layout its params name (qbuild.backends.shard_layout: the reference model's, or a backend's own)."""

from __future__ import annotations

import os

from qbuild import backends
from qbuild.execution.actions import RunContext
from qbuild.execution.actions.checkpoint import source_files
from qbuild.recipe.params import ShardParams


def run(ctx: RunContext) -> None:
    from qbuild.model.convert.shard import shard_checkpoint

    p: ShardParams = ctx.params
    # A planned shard has the snapshot; materialised converted weights (convert_checkpoint's) need no checkpoint.
    files, digests = source_files(ctx) if "snapshot" in ctx.inputs else (None, None)
    # two threads: one unit's transposes and casts overlap another's kernel copies; memory stays one big unit's
    shard_checkpoint(ctx.inputs["converted"], ctx.out, layout=backends.shard_layout(p.layout), ranks=p.ranks,
                     fused_qkv=p.fused_qkv, dtype=p.dtype, files=files, digests=digests,
                     workers=min(2, os.cpu_count() or 1),
                     meter=None if ctx.progress is None else ctx.progress.meter("write"))
