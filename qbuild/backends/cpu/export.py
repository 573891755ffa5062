"""torch.export of one graph of the reference model, with every weight a graph INPUT.

The exported program's signature is `forward(weights, *args)`: `weights` is the flat dict of the model's
NxDI-named rank tensors (`TextModel.state_dict()`: sharded tensors stacked on a leading rank dim). The model is
held outside the traced module and called through torch.func.functional_call, so no weight value is captured;
only architecture-derived constants (rotary frequencies, expert ids) live in the program.

Graphs (B batch_size, S bucket; each graph's model has max_seq_len = its bucket, the host pads the caches):
    cte:    (weights, tokens, position_ids, seq_lens) -> (logits (B, S, V), state tuple with L = S)
            tokens are ids (B, S) for text-only families, embeddings (B, S, H) for the VL families (the host
            embeds and inserts image features); position_ids (B, S), or (3, B, S) with mRoPE.
    tkg:    (weights, input_ids (B, 1), position_ids, positions (B,), state with L = S) -> (logits (B, 1, V), state)
    extend: (weights, tokens (B, C) or (B, C, H), position_ids, starts (B,), seq_lens (B,), state with L = S)
            -> (logits (B, C, V), state): a prefill piece of C tokens (the params' `chunk`) continuing the state
    vision: (weights, hidden (S, hidden), mask (1, 1, S, S), cos (S, head_dim), sin (S, head_dim)) -> features
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from qbuild.core.dtypes import torch_dtype
from qbuild.backends.cpu.params import CpuTextCompile, CpuVisionCompile


class Functional(torch.nn.Module):
    """`forward(weights, *args)` = module(*args) with its parameters and buffers taken from `weights`."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self._module = [module]  # a list, so the module is not registered and none of its tensors is saved

    def forward(self, weights: dict[str, torch.Tensor], *args):
        return torch.func.functional_call(self._module[0], weights, args)


@dataclass
class Traced:
    program: torch.export.ExportedProgram
    signature: dict        # what the runtime needs to call it: input kinds, shapes, dtypes
    seconds: float


def text_model(params: CpuTextCompile, max_seq_len: int):
    """The reference text model of the architecture in compile params, at this graph's KV length."""
    from qbuild.model.modeling import TextModel

    return TextModel(params.text, tp=params.tp, ep=params.ep, dtype=torch_dtype(params.dtype), max_seq_len=max_seq_len)


def text_inputs(model, graph: str, batch: int, bucket: int, chunk: int | None = None) -> tuple:
    """Example inputs of a text graph (values are irrelevant: shapes and dtypes define the program)."""
    arch = model.arch
    mrope = arch.mrope_section is not None
    length = {"cte": bucket, "extend": chunk}.get(graph, 1)
    positions = torch.zeros((3, batch, length) if mrope else (batch, length), dtype=torch.long)
    tokens = (torch.zeros(batch, length, arch.hidden_size, dtype=model.dtype) if mrope
              else torch.zeros(batch, length, dtype=torch.long))
    if graph == "cte":
        return tokens, positions, torch.full((batch,), bucket, dtype=torch.long)
    state = tuple(torch.zeros(shape, dtype=dtype) for shape, dtype in model.state_shapes(batch))
    if graph == "extend":
        return tokens, positions, torch.zeros(batch, dtype=torch.long), torch.full((batch,), chunk), state
    return torch.zeros(batch, 1, dtype=torch.long), positions, torch.zeros(batch, dtype=torch.long), state


def _example_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Zeros of the module's parameter shapes: torch.export.save keeps the example inputs in the program, so random
    initial values would make two compiles of one key differ byte for byte."""
    return {k: torch.zeros_like(v) for k, v in module.state_dict().items()}


def _export(module: torch.nn.Module, weights: dict, args: tuple) -> torch.export.ExportedProgram:
    import torch.fx.config

    # Each node's stack trace names the absolute path of the source that made it, and a compile must be the same
    # bytes in every checkout and on every machine: the program keeps none. Not recording them at all
    # (torch/fx/config.py, do_not_emit_stack_traces, v2.13.0) takes a quarter off each trace and gives the same bytes.
    recording = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        with torch.no_grad():
            program = torch.export.export(Functional(module), (weights, *args), strict=False)
    finally:
        torch.fx.config.do_not_emit_stack_traces = recording
    for node in program.graph.nodes:
        node.meta.pop("stack_trace", None)
    return program


_METHODS = {"cte": "prefill", "tkg": "decode", "extend": "extend"}   # graph -> the TextModel method it traces


def export_text(params: CpuTextCompile) -> Traced:
    from qbuild.model.modeling import EntryPoint

    graph, bucket, batch = params.graph, params.bucket, params.batch_size
    start = time.monotonic()
    model = text_model(params, max_seq_len=bucket).eval()
    weights = _example_weights(model)
    args = text_inputs(model, graph, batch, bucket, params.chunk)
    program = _export(EntryPoint(model, _METHODS[graph]), weights, args)
    signature = {"graph": graph, "bucket": bucket, "chunk": params.chunk, "batch_size": batch,
                 "embeds": model.arch.mrope_section is not None,
                 "mrope": model.arch.mrope_section is not None, "max_seq_len": bucket,
                 "weights": {k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in weights.items()},
                 "state_names": model.state_names(),
                 "state": [[list(s), str(d).removeprefix("torch.")] for s, d in model.state_shapes(batch)]}
    return Traced(program, signature, time.monotonic() - start)


def export_vision(params: CpuVisionCompile) -> Traced:
    from qbuild.model.modeling.vision import VisionEncoder, vision_example_inputs

    start = time.monotonic()
    dtype = torch_dtype(params.dtype)
    encoder = VisionEncoder(params.vision, dtype=dtype, tp=params.tp).eval()
    weights = _example_weights(encoder)
    args = vision_example_inputs(params.vision, params.bucket, dtype)
    program = _export(encoder, weights, args)
    signature = {"graph": "vision", "bucket": params.bucket, "tp": params.tp,
                 "weights": {k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in weights.items()}}
    return Traced(program, signature, time.monotonic() - start)


def export_graph(params: CpuTextCompile | CpuVisionCompile) -> Traced:
    return export_vision(params) if isinstance(params, CpuVisionCompile) else export_text(params)
