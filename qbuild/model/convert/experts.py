"""NxDI's ExpertMLPsV2 tensors (docs/nxd-layout.md section 4), and how experts are divided across expert-parallel
groups and moe_tp ranks at shard time. What every layout and the FP8 rules know of experts, apart from the converter
that makes them from HF's forms (qbuild.model.convert.moe), which only the MoE families run.

Layout (E experts, H hidden, I expert intermediate):
  mlp.moe.expert_mlps.mlp_op.gate_up_proj.weight (E, H, 2I): [:, :, :I] = gate^T, [:, :, I:] = up^T
  mlp.moe.expert_mlps.mlp_op.down_proj.weight    (E, I, H)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

GATE_UP = "mlp.moe.expert_mlps.mlp_op.gate_up_proj"
DOWN = "mlp.moe.expert_mlps.mlp_op.down_proj"


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
