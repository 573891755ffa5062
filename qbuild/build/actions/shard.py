"""shard: converted text weights -> weights/tp{r}_sharded_checkpoint.safetensors per rank."""

from __future__ import annotations

from qbuild.build.actions import RunContext
from qbuild.recipe.params import ShardParams


def run(ctx: RunContext) -> None:
    from qbuild.model.convert.shard import shard_checkpoint

    p: ShardParams = ctx.params
    shard_checkpoint(ctx.inputs["converted"], ctx.out, tp=p.tp, ep=p.ep, fused_qkv=p.fused_qkv,
                     pad_intermediate_to=p.pad_intermediate_to, layout=p.layout, dtype=p.dtype, dense_tp=p.dense_tp)
