"""Mixture of experts (docs/nxd-layout.md section 4): HF's two expert storage forms -> NxDI ExpertMLPsV2
(qbuild.model.convert.experts: its tensors, and how they divide across ranks), the router and the shared expert."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:   # the rules import torch where they run it: a header check builds their tables without it
    import torch

from qbuild.model.convert.experts import DOWN, GATE_UP
from qbuild.model.convert.rule import Row, Step, rule_name, same

ROUTER_AND_SHARED = (
    Row("mlp.gate.weight", lambda d: (d.num_experts, d.hidden_size), ("mlp.moe.router.linear_router.weight",), same),
    Row("mlp.shared_expert.gate_proj.weight", lambda d: (d.shared_intermediate_size, d.hidden_size),
        ("mlp.shared_gate_proj.weight",), same),
    Row("mlp.shared_expert.up_proj.weight", lambda d: (d.shared_intermediate_size, d.hidden_size),
        ("mlp.shared_up_proj.weight",), same),
    Row("mlp.shared_expert.down_proj.weight", lambda d: (d.hidden_size, d.shared_intermediate_size),
        ("mlp.shared_down_proj.weight",), same),
    Row("mlp.shared_expert_gate.weight", lambda d: (1, d.hidden_size), ("mlp.shared_expert_gate.weight",), same),
)


# Source rows copied per block when transposing. torch's plain permuted copy walks the source with a stride of a
# whole row for every element and runs ~3x slower on expert-sized bf16 matrices; a block of 32 rows stays in cache.
_TRANSPOSE_ROWS = 32


def copy_transposed(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst[..., c, r] = src[..., r, c], copied in blocks of source rows; returns dst."""
    for r0 in range(0, src.shape[-2], _TRANSPOSE_ROWS):
        dst[..., r0:r0 + _TRANSPOSE_ROWS].copy_(src[..., r0:r0 + _TRANSPOSE_ROWS, :].transpose(-1, -2))
    return dst


def gate_up_from_fused(w: torch.Tensor) -> tuple[torch.Tensor]:
    """Fused HF gate_up_proj (E, 2I, H), rows [gate | up] -> (E, H, 2I) with columns [gate^T | up^T].

    A transposed view, not a copy: the writer lays it out a few experts at a time (safetensors_io.write_at), so
    the output is never materialized whole."""
    return (w.transpose(-1, -2),)


def down_from_fused(w: torch.Tensor) -> tuple[torch.Tensor]:
    """Fused HF down_proj (E, H, I) -> (E, I, H), as a transposed view (see gate_up_from_fused)."""
    return (w.transpose(-1, -2),)


def gate_up_from_experts(*gate_up: torch.Tensor) -> tuple[torch.Tensor]:
    """Per-expert (gate_0, up_0, gate_1, up_1, ...), each (I, H) -> (E, H, 2I) = [gate^T | up^T] per expert."""
    import torch

    gates, ups = gate_up[0::2], gate_up[1::2]
    i, h = gates[0].shape
    out = torch.empty(len(gates), h, 2 * i, dtype=gates[0].dtype, device=gates[0].device)
    for e, (g, u) in enumerate(zip(gates, ups)):
        copy_transposed(out[e, :, :i], g)
        copy_transposed(out[e, :, i:], u)
    return (out,)


def down_from_experts(*downs: torch.Tensor) -> tuple[torch.Tensor]:
    """Per-expert down_proj, each (H, I) -> (E, I, H)."""
    import torch

    h, i = downs[0].shape
    out = torch.empty(len(downs), i, h, dtype=downs[0].dtype, device=downs[0].device)
    for e, w in enumerate(downs):
        copy_transposed(out[e], w)
    return (out,)


def is_fused(names, hf: str) -> bool:
    """Whether layer prefix `hf` stores its experts fused (3D) rather than per expert."""
    return f"{hf}mlp.experts.gate_up_proj" in names or f"{hf}mlp.experts.down_proj" in names


def expert_steps(d, hf: str, nx: str, fused: bool) -> list[Step]:
    """The steps that build one layer's NxDI expert tensors, from whichever HF form the layer is stored in.

    The per-expert form gathers the layer's E tensors in one step: memory stays bounded by one layer's experts."""
    e, i, h = d.num_experts, d.moe_intermediate_size, d.hidden_size
    gate_up, down = f"{nx}{GATE_UP}.weight", f"{nx}{DOWN}.weight"
    def step(sources, shapes, target, fn) -> Step:
        return Step(tuple(sources), tuple(shapes), (target,), fn, rule=rule_name(fn))

    if fused:
        return [step((f"{hf}mlp.experts.gate_up_proj",), ((e, 2 * i, h),), gate_up, gate_up_from_fused),
                step((f"{hf}mlp.experts.down_proj",), ((e, h, i),), down, down_from_fused)]
    per = [f"{hf}mlp.experts.{x}.{p}_proj.weight" for x in range(e) for p in ("gate", "up")]
    downs = [f"{hf}mlp.experts.{x}.down_proj.weight" for x in range(e)]
    return [step(per, ((i, h),) * len(per), gate_up, gate_up_from_experts),
            step(downs, ((h, i),) * e, down, down_from_experts)]
