"""convert: an HF checkpoint snapshot -> the description of its NxDI-layout text weights (tp-independent), the
vision weights, config and tokenizer (qbuild.model.convert.convert.describe_checkpoint); materialize: the converted
text weights written out in full, for `qbuild compile --keep-intermediates` (convert_checkpoint, as a build stored
them before the description)."""

from __future__ import annotations

import os

from qbuild.core.errors import UserError
from qbuild.core.units import GIB
from qbuild.model.sizes import description_bytes, largest_tensor_bytes, largest_vision_bytes
from qbuild.planning.step import Context, PlannedNode, Step
from qbuild.recipe.params import ConvertParams

def _params(recipe) -> ConvertParams:
    r = recipe.loaded.recipe
    return ConvertParams(recipe.arch.family, r.dtype, r.fp8)


class Convert(Step):
    kind = "convert"
    params = ConvertParams
    inputs = ("snapshot",)
    reads_checkpoint = True

    @classmethod
    def plan(cls, recipe) -> None:
        # The text weights are described, not written (the shard step streams the checkpoint through the
        # description); the vision weights are written: the bundle ships them as they are.
        p, arch = _params(recipe), recipe.arch
        recipe.add(PlannedNode("convert", cls.kind, f"convert {p.family} {p.dtype} fp8={p.fp8}", p, {"snapshot": "fetch"},
                               description_bytes(arch) + recipe.sizes.vision,
                               3 * largest_vision_bytes(arch) + GIB // 2, recipe.source, code=recipe.rule_modules))

    @classmethod
    def run(cls, ctx: Context) -> None:
        from qbuild.model.convert.convert import describe_checkpoint
        from qbuild.model.convert.errors import CheckpointError

        p: ConvertParams = ctx.params
        files, digests = ctx.checkpoint.files, ctx.checkpoint.digests
        directory = next(iter(files.values())).parent
        try:
            info = describe_checkpoint(directory, ctx.out, files=files, digests=digests, dtype=p.dtype, fp8=p.fp8)
        except CheckpointError as e:
            # a download whose tensors are not the ones the conversion program reads: the checkpoint is at fault
            raise UserError(f"{directory}{os.sep}{e}") from None
        if info.get("family") != p.family:
            raise ValueError(f"checkpoint family {info.get('family')} differs from the planned {p.family}")
        ctx.log(f"described {info['text_tensors']} text tensors; wrote {info['vision_tensors']} vision tensors")


class Materialize(Step):
    """The converted weights written out in full, built only on request (--keep-intermediates): no node reads them,
    and no role names them, so they are never locked."""

    kind = "materialize"
    params = ConvertParams
    inputs = ("converted", "snapshot")
    reads_checkpoint = True

    @classmethod
    def plan(cls, recipe) -> None:
        if not recipe.keep_intermediates:
            return
        p, arch = _params(recipe), recipe.arch
        recipe.kept = recipe.add(PlannedNode(
            None, cls.kind, f"materialize converted {p.family} {p.dtype} fp8={p.fp8}", p,
            {"converted": "convert", "snapshot": "fetch"}, recipe.sizes.weights + recipe.sizes.vision,
            3 * largest_tensor_bytes(arch, 4) + GIB // 2, recipe.source, code=recipe.rule_modules))

    @classmethod
    def run(cls, ctx: Context) -> None:
        from qbuild.model.convert.convert import materialize

        # two threads: one step's expert transposes overlap another's kernel copies; each holds one step's inputs
        info = materialize(ctx.inputs["converted"], ctx.out, files=ctx.checkpoint.files,
                           digests=ctx.checkpoint.digests, workers=min(2, os.cpu_count() or 1))
        ctx.log(f"materialized {info['tensors']} converted tensors ({info['bytes']} bytes)")
