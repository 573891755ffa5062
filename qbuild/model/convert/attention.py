"""Gated GQA full attention (docs/nxd-layout.md section 2): the q/gate split at convert time, and how the
attention tensors are divided across tensor-parallel ranks at shard time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:   # the rules import torch where they run it: a header check builds their tables without it
    import torch

from qbuild.model.convert.rule import Row, same


def split_query_gate(arch, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF q_proj (nH*2D, ...) interleaved per head [h0 query | h0 gate | h1 query | ...] -> query, gate (nH*D, ...).

    Works on any trailing shape, so an FP8 `.scale` (nH*2D, 1) splits the same way as its weight.
    """
    d = arch.head_dim
    heads = w.reshape(-1, 2 * d, *w.shape[1:])
    return heads[:, :d].reshape(-1, *w.shape[1:]), heads[:, d:].reshape(-1, *w.shape[1:])


ATTENTION = (
    Row("self_attn.q_proj.weight", lambda d: (d.num_heads * 2 * d.head_dim, d.hidden_size),
        ("self_attn.q_proj.weight", "self_attn.output_gate_proj.weight"), split_query_gate),
    Row("self_attn.k_proj.weight", lambda d: (d.kv_dim, d.hidden_size), ("self_attn.k_proj.weight",), same),
    Row("self_attn.v_proj.weight", lambda d: (d.kv_dim, d.hidden_size), ("self_attn.v_proj.weight",), same),
    Row("self_attn.o_proj.weight", lambda d: (d.hidden_size, d.num_heads * d.head_dim), ("self_attn.o_proj.weight",),
        same),
)


def kv_head_shards(t: torch.Tensor, num_kv_heads: int, tp: int) -> list[torch.Tensor]:
    """Per-rank k/v rows (or their FP8 scales): contiguous kv heads when tp <= nKV, else rank r gets kv head
    r * nKV // tp whole (the heads are replicated so every rank keeps its GQA group's keys and values)."""
    heads = t.chunk(num_kv_heads, dim=0)
    if tp <= num_kv_heads:
        return list(t.chunk(tp, dim=0))
    return [heads[r * num_kv_heads // tp] for r in range(tp)]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """NxDI's fused Wqkv of one rank: cat(query, k, v) on dim 0 (the output gate stays separate)."""
    import torch

    return torch.cat([q, k, v], dim=0)


def split_qkv(wqkv: torch.Tensor, q_rows: int, kv_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of fuse_qkv: one rank's Wqkv -> (q, k, v), given the rank's q rows and k (= v) rows."""
    q, k, v = wqkv.split([q_rows, kv_rows, kv_rows])
    return q, k, v
