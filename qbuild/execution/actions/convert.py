"""convert: an HF checkpoint snapshot -> the description of its NxDI-layout text weights (tp-independent), the
vision weights, config and tokenizer (qbuild.model.convert.convert.describe_checkpoint); materialize: the converted
text weights written out in full, for `qbuild compile --keep-intermediates` (convert_checkpoint, as a build stored
them before the description)."""

from __future__ import annotations

import os

from qbuild.execution.actions import RunContext
from qbuild.execution.actions.checkpoint import source_files
from qbuild.recipe.params import ConvertParams


def run(ctx: RunContext) -> None:
    from qbuild.model.convert.convert import describe_checkpoint

    p: ConvertParams = ctx.params
    files, digests = source_files(ctx)
    info = describe_checkpoint(next(iter(files.values())).parent, ctx.out, files=files, digests=digests,
                               dtype=p.dtype, fp8=p.fp8)
    if info.get("family") != p.family:
        raise ValueError(f"checkpoint family {info.get('family')} differs from the planned {p.family}")
    ctx.log(f"described {info['text_tensors']} text tensors; wrote {info['vision_tensors']} vision tensors")


def materialize(ctx: RunContext) -> None:
    from qbuild.model.convert.convert import materialise

    files, digests = source_files(ctx)
    # two threads: one step's expert transposes overlap another's kernel copies; each holds one step's inputs
    info = materialise(ctx.inputs["converted"], ctx.out, files=files, digests=digests,
                       workers=min(2, os.cpu_count() or 1))
    ctx.log(f"materialised {info['tensors']} converted tensors ({info['bytes']} bytes)")
