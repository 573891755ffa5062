"""compile: a recipe's compiled graphs on one backend.

CPU backends (export, inductor): one graph, a submodel at one bucket, with no weights at all: <graph>-<bucket>.pt2
(torch.export program or AOTInductor package; weights are graph inputs) and <graph>-<bucket>.json (its call
signature). Timings go to the log, never into outputs, so the same key gives byte-identical artifacts on any machine.

Neuron: the text node is NxDI's compiled directory of the whole text model (model.pt with every CTE and TKG bucket,
NxDI's neuron_config.json, metaneff/); a vision node is one traced encoder, vision_encoder_<bucket>.pt, with the
vision weights inlined (its input `converted`).
"""

from __future__ import annotations

from qbuild.core import jsonio
from qbuild.build.actions import RunContext
from qbuild.backends import graph_file
from qbuild.recipe.params import CpuTextCompile, CpuVisionCompile, NeuronCompile, NeuronVisionCompile, parse_compile


def run(ctx: RunContext) -> None:
    p = parse_compile(ctx.params)
    if p.backend == "neuron":
        _neuron(ctx, p)
    else:
        _cpu(ctx, p)


def _cpu(ctx: RunContext, p: CpuTextCompile | CpuVisionCompile) -> None:
    import torch

    from qbuild.backends.export import export_graph

    name = f"{p.graph}-{p.bucket}"
    traced = export_graph(p)
    signature = dict(traced.signature, backend=p.backend)
    target = ctx.out / graph_file(p.graph, p.bucket)
    if p.backend == "export":
        torch.export.save(traced.program, target)
    else:
        from qbuild.backends.inductor import package

        ctx.log(f"{name}: AOTInductor {package(traced.program, target, ctx.scratch):.1f}s")
    (ctx.out / f"{name}.json").write_text(jsonio.dumps(signature, indent=1, sort_keys=True))
    ctx.log(f"{name}: exported in {traced.seconds:.1f}s")


def _neuron(ctx: RunContext, p: NeuronCompile) -> None:
    from qbuild.backends import neuron

    cache = neuron.compile_cache_url(ctx.store)
    if isinstance(p, NeuronVisionCompile):
        neuron.compile_vision(p, ctx.inputs["port"], ctx.inputs["converted"] / "vision" / "model.safetensors",
                              ctx.out, ctx.scratch, cache, ctx.log)
    else:
        neuron.compile_text(p, ctx.inputs["port"], ctx.out, ctx.scratch, cache, ctx.log)
