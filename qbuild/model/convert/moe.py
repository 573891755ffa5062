"""Mixture of experts (docs/nxd-layout.md section 4): HF's two expert storage forms -> NxDI ExpertMLPsV2, and how
experts are divided across expert-parallel groups and moe_tp ranks at shard time.

NxDI layout (E experts, H hidden, I expert intermediate):
  mlp.moe.expert_mlps.mlp_op.gate_up_proj.weight (E, H, 2I): [:, :, :I] = gate^T, [:, :, I:] = up^T
  mlp.moe.expert_mlps.mlp_op.down_proj.weight    (E, I, H)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:   # the rules import torch where they run it: a header check builds their tables without it
    import torch

from qbuild.model.convert.steps import Row, Step, rule_name, same

GATE_UP = "mlp.moe.expert_mlps.mlp_op.gate_up_proj"
DOWN = "mlp.moe.expert_mlps.mlp_op.down_proj"

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


def expert_group(t: torch.Tensor, ep: int, group: int) -> torch.Tensor:
    """Experts [group*E/ep, (group+1)*E/ep) of an (E, ...) tensor."""
    return t.chunk(ep, dim=0)[group]


def gate_up_shard(t: torch.Tensor, ep: int, moe_tp: int, group: int, j: int):
    """One rank's gate_up (E/ep, H, 2*I_r) (or its FP8 scale (E/ep, 1, 2*I_r)), I_r = I / moe_tp: the group's experts,
    and moe_tp slice j of both the gate and the up halves. With moe_tp > 1 no strided view holds that slice, so it is
    a safetensors_io.Deferred, laid out a few experts at a time as it is written."""
    from qbuild.model.convert.safetensors_io import Deferred

    g = expert_group(t, ep, group)
    two_i = g.shape[-1]
    if moe_tp == 1:
        return g
    part = g.reshape(*g.shape[:-1], 2, two_i // 2).chunk(moe_tp, dim=-1)[j]    # (E/ep, H, 2, I_r), a view
    transposed = part.dim() == 4 and part.stride(1) == 1 and part.shape[1] > 1

    def fill(out: torch.Tensor, start: int) -> None:
        piece = part[start:start + out.shape[0]]
        dst = out.view(piece.shape)
        if transposed:
            _gather_transposed(dst, piece)
        else:
            dst.copy_(piece)

    return Deferred((*g.shape[:-1], 2 * part.shape[-1]), g.dtype, fill)


def _gather_transposed(out: torch.Tensor, part: torch.Tensor) -> None:
    """out = part, for `part` (E, H, 2, I_r) whose H is its innermost dim (a transposed view of HF's (E, 2I, H) rows,
    as gate_up_from_fused gives it) and `out` (E, H, 2, I_r) contiguous: per expert, its rank's gate and up rows are
    gathered (contiguous copies) and transposed in one 2D copy, which torch runs through its cache-blocked transpose
    kernel; the generic strided copy of the whole slice is about twice as slow."""
    import torch

    e, h, _, i_r = part.shape
    rows = part.permute(0, 2, 3, 1)                           # (E, 2, I_r, H): H contiguous
    tmp = torch.empty(2, i_r, h, dtype=out.dtype, device=out.device)
    for x in range(e):
        tmp.copy_(rows[x])
        out[x].view(h, 2 * i_r).copy_(tmp.view(2 * i_r, h).T)


def down_shard(t: torch.Tensor, ep: int, moe_tp: int, group: int, j: int) -> torch.Tensor:
    """One rank's down_proj (E/ep, I_r, H): the group's experts and moe_tp slice j of the intermediate dim (dim 1)."""
    return expert_group(t, ep, group).chunk(moe_tp, dim=1)[j]
