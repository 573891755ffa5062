"""shard: converted text weights -> weights/tp{r}_sharded_checkpoint.safetensors per rank, made by streaming the
source checkpoint through the convert step's description (qbuild.model.convert.shard.shard_checkpoint), by the rules of
the layout its params name (qbuild.backends.shard_layout: the reference model's, or a backend's own, whose module the
node's key holds, with the conversion rules of the recipe's family, which the description's steps run)."""

from __future__ import annotations

import os

from qbuild import backends
from qbuild.core.units import GIB
from qbuild.model.sizes import largest_tensor_bytes
from qbuild.planning.step import Context, PlannedNode, Step
from qbuild.recipe.params import ShardParams


class Shard(Step):
    kind = "shard"
    params = ShardParams
    inputs = ("converted",)
    reads_checkpoint = True

    @classmethod
    def plan(cls, recipe) -> None:
        p = recipe.backend_plan.shard
        # Every source node a backend adds (a port) is an input of the shard, package and verify steps.
        recipe.add(PlannedNode("shard", cls.kind, f"shard {p.layout} {p.ranks.describe()}", p,
                               {"converted": "convert", "snapshot": "fetch", **recipe.source_roles()},
                               recipe.sizes.weights, 3 * largest_tensor_bytes(recipe.arch, 4) + GIB // 2,
                               recipe.source, code=(recipe.layout_module(p.layout), *recipe.rule_modules)))

    @classmethod
    def run(cls, ctx: Context) -> None:
        from qbuild.model.convert.shard import shard_checkpoint

        p: ShardParams = ctx.params
        # A planned shard reads the checkpoint; materialized converted weights (convert_checkpoint's) need none.
        files, digests = (ctx.checkpoint.files, ctx.checkpoint.digests) if ctx.checkpoint else (None, None)
        # two threads: one unit's transposes and casts overlap another's kernel copies; memory stays one big unit's
        shard_checkpoint(ctx.inputs["converted"], ctx.out, layout=backends.shard_layout(p.layout), ranks=p.ranks,
                         fused_qkv=p.fused_qkv, dtype=p.dtype, files=files, digests=digests,
                         workers=min(2, os.cpu_count() or 1),
                         meter=None if ctx.progress is None else ctx.progress.meter("write"))
