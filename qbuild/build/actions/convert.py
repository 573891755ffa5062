"""convert: an HF checkpoint snapshot -> NxDI-layout text weights (tp-independent) and vision weights."""

from __future__ import annotations

import os

from qbuild.build.actions import RunContext
from qbuild.recipe.params import ConvertParams
from qbuild.recipe.source import locate, read_snapshot


def run(ctx: RunContext) -> None:
    from qbuild.model.convert.convert import convert_checkpoint

    p: ConvertParams = ctx.params
    files = locate(read_snapshot(ctx.inputs["snapshot"]), ctx.context)
    src = next(iter(files.values())).parent
    # two threads: one step's expert transposes overlap another's kernel copies; each holds one step's inputs
    info = convert_checkpoint(src, ctx.out, files=files, dtype=p.dtype, fp8=p.fp8,
                              workers=min(2, os.cpu_count() or 1))
    if info.get("family") != p.family:
        raise ValueError(f"checkpoint family {info.get('family')} differs from the planned {p.family}")
    ctx.log(f"converted {info.get('tensors', '?')} tensors")
