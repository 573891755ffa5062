"""Gated DeltaNet (linear_attn, docs/nxd-layout.md section 3): renames and reshapes at convert time, Qwen3-Next's
grouped-projection de-interleave, and the per-rank [Q_r | K_r | V_r] channel selection used at shard time.

Channels of in_proj_qkv / conv1d are [Q all heads (key_dim) | K all heads (key_dim) | V all heads (value_dim)], so a
plain contiguous split would hand rank 0 only queries. `reorder_qkv_channels` is the one place this is handled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:   # the rules import torch where they run it: a header check builds their tables without it
    import torch

from qbuild.model.convert.rule import Row, same


def conv_weight(arch, w: torch.Tensor) -> tuple[torch.Tensor]:
    """conv1d.weight (conv_dim, 1, K) -> conv1d_weight.weight (conv_dim, K)."""
    return (w.squeeze(1),)


def as_column(arch, w: torch.Tensor) -> tuple[torch.Tensor]:
    """A_log / dt_bias (Hv,) -> (Hv, 1)."""
    return (w.reshape(-1, 1),)


def split_qkvz(arch, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next in_proj_qkvz (2*key_dim + 2*value_dim, H), grouped per key head as [q | k | v (r heads) | z (r heads)],
    -> in_proj_qkv (conv_dim, H) = cat(all q, all k, all v) and in_proj_z (value_dim, H); r = Hv / Hk."""
    import torch

    r = arch.num_v_heads // arch.num_k_heads
    dk, dv, h = arch.k_head_dim, arch.v_head_dim, w.shape[-1]
    q, k, v, z = w.reshape(arch.num_k_heads, 2 * dk + 2 * dv * r, h).split([dk, dk, dv * r, dv * r], dim=1)
    flat = lambda x: x.reshape(-1, h)  # noqa: E731  value head index = group * r + i
    return torch.cat([flat(q), flat(k), flat(v)]), flat(z)


def split_ba(arch, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next in_proj_ba (2*Hv, H), grouped per key head as [b (r) | a (r)] -> in_proj_b, in_proj_a (Hv, H)."""
    r = arch.num_v_heads // arch.num_k_heads
    b, a = w.reshape(arch.num_k_heads, 2 * r, w.shape[-1]).split([r, r], dim=1)
    return b.reshape(-1, w.shape[-1]), a.reshape(-1, w.shape[-1])


_COMMON = (
    Row("linear_attn.conv1d.weight", lambda d: (d.conv_dim, 1, d.conv_kernel),
        ("linear_attn.conv1d_weight.weight",), conv_weight),
    Row("linear_attn.A_log", lambda d: (d.num_v_heads,), ("linear_attn.A_log_weight.weight",), as_column),
    Row("linear_attn.dt_bias", lambda d: (d.num_v_heads,), ("linear_attn.dt_bias_weight.weight",), as_column),
    Row("linear_attn.norm.weight", lambda d: (d.v_head_dim,), ("linear_attn.norm.weight",), same),
    Row("linear_attn.out_proj.weight", lambda d: (d.hidden_size, d.value_dim), ("linear_attn.out_proj.weight",), same),
)
DELTANET = (
    Row("linear_attn.in_proj_qkv.weight", lambda d: (d.conv_dim, d.hidden_size), ("linear_attn.in_proj_qkv.weight",),
        same),
    Row("linear_attn.in_proj_z.weight", lambda d: (d.value_dim, d.hidden_size), ("linear_attn.in_proj_z.weight",),
        same),
    Row("linear_attn.in_proj_b.weight", lambda d: (d.num_v_heads, d.hidden_size), ("linear_attn.in_proj_b.weight",),
        same),
    Row("linear_attn.in_proj_a.weight", lambda d: (d.num_v_heads, d.hidden_size), ("linear_attn.in_proj_a.weight",),
        same),
) + _COMMON
GROUPED_DELTANET = (
    Row("linear_attn.in_proj_qkvz.weight", lambda d: (2 * d.key_dim + 2 * d.value_dim, d.hidden_size),
        ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight"), split_qkvz),
    Row("linear_attn.in_proj_ba.weight", lambda d: (2 * d.num_v_heads, d.hidden_size),
        ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"), split_ba),
) + _COMMON


def rank_channels(arch, tp: int, rank: int) -> torch.Tensor:
    """Channel indices of rank `rank` in a [Q | K | V] tensor: its key heads' Q, its key heads' K, its value heads' V."""
    import torch

    share = arch.per_rank(tp)
    kq, vq = share.key_dim, share.value_dim
    return torch.cat([torch.arange(rank * kq, (rank + 1) * kq),
                      arch.key_dim + torch.arange(rank * kq, (rank + 1) * kq),
                      2 * arch.key_dim + torch.arange(rank * vq, (rank + 1) * vq)])


def reorder_qkv_channels(t: torch.Tensor, arch, tp: int) -> torch.Tensor:
    """Reorder dim 0 of in_proj_qkv / conv1d (or an FP8 scale) so that contiguous tp slicing gives rank r
    [Q_r | K_r | V_r]. Worked example (key_dim 128, value_dim 256, tp 2):
    cat(s[0:64], s[128:192], s[256:384], s[64:128], s[192:256], s[384:512])."""
    import torch

    if tp == 1:
        return t
    # index_select, not t[index]: on the meta tensors a shard plan runs, advanced indexing imports torch's symbolic
    # shapes machinery (a third of a second); the result is the same copy.
    return t.index_select(0, torch.cat([rank_channels(arch, tp, r) for r in range(tp)]))


def qkv_shards(t: torch.Tensor, arch, tp: int) -> list[torch.Tensor]:
    return list(reorder_qkv_channels(t, arch, tp).chunk(tp, dim=0))
