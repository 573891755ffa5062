"""compile: one graph (a submodel at a bucket) of an architecture, on one backend. Reads no weights at all.

Output (CPU backends): <graph>-<bucket>.pt2 (torch.export program or AOTInductor package; weights are graph
inputs) and <graph>-<bucket>.json (its call signature). Timings go to the log, never into outputs, so
the same key gives byte-identical artifacts on any machine or executor. Neuron: NxDI's compiled artifacts and
neuron_config.json under <graph>-<bucket>/.
"""

from __future__ import annotations

from .. import jsonio
from ..actions import RunContext
from ..backends import graph_file


def run(ctx: RunContext) -> None:
    p = ctx.params
    name = f"{p['graph']}-{p['bucket']}"
    if p["backend"] == "neuron":
        from ..backends.neuron import compile_graph

        compile_graph(p, ctx.out / name, ctx.scratch, ctx.log)
        return
    import torch

    from ..backends.export import export_graph

    traced = export_graph(p)
    signature = dict(traced.signature, backend=p["backend"])
    target = ctx.out / graph_file(p["graph"], p["bucket"])
    if p["backend"] == "export":
        torch.export.save(traced.program, target)
    elif p["backend"] == "inductor":
        from ..backends.inductor import package

        ctx.log(f"{name}: AOTInductor {package(traced.program, target, ctx.scratch):.1f}s")
    else:
        raise ValueError(f"unknown backend {p['backend']!r}")
    (ctx.out / f"{name}.json").write_text(jsonio.dumps(signature, indent=1, sort_keys=True))
    ctx.log(f"{name}: exported in {traced.seconds:.1f}s")
