"""Reference decoder of the hybrid Qwen3.5 / Qwen3-Next models over NxDI-layout weights, in plain PyTorch.

It consumes exactly the per-rank shards the neuron backend gets (names and math: docs/nxd-layout.md)
and simulates tensor / expert parallelism in one process. Every sharded tensor is a parameter with a leading
rank dim R holding each rank's shard, under its NxDI name (`model.state_dict()` keys are the NxDI names);
replicated tensors are stored once. Each rank computes its partial output from its own shard; summing the
partials over R is the all-reduce. Inside a layer the ranks' heads sit side by side ("rank-merged": rank r's
head i is head r*N + i), which is exact because heads never mix before the row-parallel output projection.

Shapes are static and there is no data-dependent Python control flow, so `prefill`, `extend` and `decode` export
with torch.export (see `EntryPoint`). `prefill` starts a sequence; `extend` continues one from its state with a
chunk of tokens (chunked prefill, and a prefill resumed from a prefix-cache checkpoint); `decode` is `extend` of one
token. Legend for shape suffixes and docstrings:
    B batch, S sequence (a static bucket, right-padded), L max_seq_len (KV-cache slots), H hidden, V vocab,
    R ranks (= tp), N / Nkv attention heads per rank, D head_dim, P rotary dims, Hk / Hv DeltaNet key / value
    heads per rank, dk / dv their dims, C conv channels per rank, K conv taps, T tokens (B*S),
    E experts per rank, I intermediate size per rank.

State (a flat tuple; `state_names()` spells it out): for each layer in order, a DeltaNet layer contributes
    conv state (R, B, C, K-1) in the model dtype, then recurrent state (R, B, Hv, dk, dv) float32;
a full-attention layer contributes
    k cache (R, B, Nkv, L, D), then v cache (R, B, Nkv, L, D), in the model dtype.
Index [r] of any state tensor is rank r's tensor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from qbuild.model.kernels import (
    causal_conv1d,
    causal_conv1d_update,
    chunk_gated_delta_rule,
    gqa_attention,
    recurrent_gated_delta_rule,
)
from qbuild.model.arch import Arch
from qbuild.model.convert.unpack import unpack_rank

L2NORM_EPS = 1e-6  # DeltaNet's q/k L2 normalisation, as FLA and HF use


class Weight(nn.Module):
    """One NxDI tensor held as `.weight`, so parameter names are the NxDI names.

    sharded: the parameter has a leading rank dim (R, *shape), one shard per rank; else it is replicated and
    stored once. Filled with NaN until loaded, so a forgotten tensor cannot pass silently.
    """

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, ranks: int | None):
        super().__init__()
        self.sharded = ranks is not None
        full = (ranks, *shape) if self.sharded else tuple(shape)
        self.weight = nn.Parameter(torch.full(full, float("nan"), dtype=dtype), requires_grad=False)


class RankUtil(nn.Module):
    """NxDI's SPMD rank tensor: rank r's shard holds [r] (int32). Kept so the layout round-trips; unused in math."""

    def __init__(self, ranks: int):
        super().__init__()
        self.sharded = True
        self.register_buffer("rank", torch.full((ranks, 1), -1, dtype=torch.int32))


def column_parallel(x_BSH: torch.Tensor, w_ROH: torch.Tensor) -> torch.Tensor:
    """Each rank's projection of the replicated input, rank-merged: (B, S, H) x (R, O, H) -> (B, S, R, O)."""
    return torch.einsum("bsh,roh->bsro", x_BSH, w_ROH)


def row_parallel(x_BSRI: torch.Tensor, w_RHI: torch.Tensor) -> torch.Tensor:
    """Each rank's partial output projection, then the all-reduce: (B, S, R, I) x (R, H, I) -> (B, S, H)."""
    partial_RBSH = torch.einsum("bsri,rhi->rbsh", x_BSRI, w_RHI)
    return partial_RBSH.sum(0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Standard RMSNorm over the last dim in float32 (NxDI's: the HF +1 is already folded into `weight`)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + L2NORM_EPS)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_partial_rope(x_BSND: torch.Tensor, cos_BSP: torch.Tensor, sin_BSP: torch.Tensor) -> torch.Tensor:
    """RoPE on the first P dims of each head; the rest pass through."""
    rot = cos_BSP.shape[-1]
    x_rot, x_pass = x_BSND[..., :rot], x_BSND[..., rot:]
    cos, sin = cos_BSP[:, :, None].to(x_BSND.dtype), sin_BSP[:, :, None].to(x_BSND.dtype)
    return torch.cat([x_rot * cos + rotate_half(x_rot) * sin, x_pass], dim=-1)


def mrope_axes(arch: Arch) -> list[int]:
    """Which position row (0 t, 1 h, 2 w) drives each rotary frequency. Plain RoPE: all from row 0.

    Interleaved mRoPE (Qwen3.5): frequency j follows h if j % 3 == 1 and j < 3*section[1], w if j % 3 == 2 and
    j < 3*section[2], else t. As in transformers, the section need not sum to the frequency count there (its
    default [11, 11, 10] is applied to every head size). Non-interleaved (Qwen2-VL style): contiguous runs of
    section[0], [1], [2], which must cover every frequency.
    """
    num_freqs = arch.rotary_dim // 2
    section = arch.mrope_section
    if section is None:
        return [0] * num_freqs
    if len(section) != 3 or (not arch.mrope_interleaved and sum(section) != num_freqs):
        raise ValueError(f"mrope_section {section} must be 3 numbers summing to rotary_dim/2 = {num_freqs}")
    if not arch.mrope_interleaved:
        return [axis for axis, n in enumerate(section) for _ in range(n)]
    axes = []
    for j in range(num_freqs):
        if j % 3 == 1 and j < 3 * section[1]:
            axes.append(1)
        elif j % 3 == 2 and j < 3 * section[2]:
            axes.append(2)
        else:
            axes.append(0)
    return axes


class RotaryEmbedding(nn.Module):
    """cos / sin tables (B, S, P) from position ids (B, S) or 3-D mRoPE ids (3, B, S)."""

    def __init__(self, arch: Arch):
        super().__init__()
        dim = arch.rotary_dim
        inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("freq_axis", torch.tensor(mrope_axes(arch), dtype=torch.long), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if position_ids.ndim == 2:  # text positions: the same on every mRoPE axis
            position_ids = position_ids[None].expand(3, -1, -1)
        positions_FBS = position_ids[self.freq_axis]
        freqs_BSF = positions_FBS.permute(1, 2, 0).float() * self.inv_freq
        emb_BSP = torch.cat([freqs_BSF, freqs_BSF], dim=-1)
        return emb_BSP.cos(), emb_BSP.sin()


class GatedAttention(nn.Module):
    """Gated GQA: per-head q/k RMSNorm, partial RoPE, causal softmax attention, output * sigmoid(gate)."""

    def __init__(self, arch: Arch, tp: int, dtype: torch.dtype):
        super().__init__()
        if arch.num_heads % tp:
            raise ValueError(f"tp={tp} must divide num_attention_heads={arch.num_heads}")
        if (arch.num_kv_heads % tp) if tp <= arch.num_kv_heads else (tp % arch.num_kv_heads):
            raise ValueError(f"tp={tp} and num_kv_heads={arch.num_kv_heads}: one must divide the other")
        rank = arch.per_rank(tp)
        self.heads, self.kv_heads = rank.num_heads, rank.num_kv_heads
        self.head_dim, self.eps = arch.head_dim, arch.rms_norm_eps
        q_dim, kv_dim, hidden = self.heads * arch.head_dim, self.kv_heads * arch.head_dim, arch.hidden_size
        self.q_proj = Weight((q_dim, hidden), dtype, tp)
        self.output_gate_proj = Weight((q_dim, hidden), dtype, tp)
        self.k_proj = Weight((kv_dim, hidden), dtype, tp)
        self.v_proj = Weight((kv_dim, hidden), dtype, tp)
        self.o_proj = Weight((hidden, q_dim), dtype, tp)
        self.q_layernorm = Weight((arch.head_dim,), torch.float32, None)
        self.k_layernorm = Weight((arch.head_dim,), torch.float32, None)
        self.rank_util = RankUtil(tp)

    def _qkv(self, x_BSH, cos, sin):
        """-> q (B, R*N, S, D), k and v (B, R*Nkv, S, D), gate (B, S, R, N*D)."""
        batch, length, _ = x_BSH.shape
        q = column_parallel(x_BSH, self.q_proj.weight).reshape(batch, length, -1, self.head_dim)
        k = column_parallel(x_BSH, self.k_proj.weight).reshape(batch, length, -1, self.head_dim)
        v = column_parallel(x_BSH, self.v_proj.weight).reshape(batch, length, -1, self.head_dim)
        gate = column_parallel(x_BSH, self.output_gate_proj.weight)
        q = apply_partial_rope(rms_norm(q, self.q_layernorm.weight, self.eps), cos, sin)
        k = apply_partial_rope(rms_norm(k, self.k_layernorm.weight, self.eps), cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), gate

    def _output(self, attn_BNSD: torch.Tensor, gate_BSRO: torch.Tensor) -> torch.Tensor:
        ranks = gate_BSRO.shape[2]
        attn_BSRO = attn_BNSD.transpose(1, 2).reshape(gate_BSRO.shape[0], gate_BSRO.shape[1], ranks, -1)
        return row_parallel(attn_BSRO * torch.sigmoid(gate_BSRO), self.o_proj.weight)

    def _per_rank(self, cache_BRKLD: torch.Tensor) -> torch.Tensor:
        """(B, R*Nkv, L, D) -> (R, B, Nkv, L, D)."""
        batch, _, slots, dim = cache_BRKLD.shape
        return cache_BRKLD.reshape(batch, -1, self.kv_heads, slots, dim).transpose(0, 1).contiguous()

    def _rank_merged(self, cache_RBKLD: torch.Tensor) -> torch.Tensor:
        """(R, B, Nkv, L, D) -> (B, R*Nkv, L, D)."""
        ranks, batch, heads, slots, dim = cache_RBKLD.shape
        return cache_RBKLD.transpose(0, 1).reshape(batch, ranks * heads, slots, dim)

    def prefill(self, x_BSH, cos, sin, max_seq_len: int):
        """-> (out (B, S, H), k cache, v cache (R, B, Nkv, L, D)). Causal masking alone keeps the right-padding
        out of every real position; the padded slots of the cache are overwritten or masked by decode."""
        length = x_BSH.shape[1]
        q, k, v, gate = self._qkv(x_BSH, cos, sin)
        causal = torch.ones(length, length, dtype=torch.bool, device=x_BSH.device).tril()
        out = self._output(gqa_attention(q, k, v, causal[None, None], self.head_dim**-0.5), gate)
        pad = (0, 0, 0, max_seq_len - length)
        return out, self._per_rank(F.pad(k, pad)), self._per_rank(F.pad(v, pad))

    def extend(self, x_BSH, cos, sin, slots_BS, k_cache, v_cache):
        """Write each token's k/v at its slot (`slots_BS`, distinct within a row, < L), then let it attend to the
        slots at or before its own: the cached prefix and the chunk's earlier tokens. -> (out (B, S, H), k cache,
        v cache). Decode is S = 1. Padded tokens write slots past the real ones, which nothing reads before a real
        token overwrites them."""
        q, k, v, gate = self._qkv(x_BSH, cos, sin)
        k_all, v_all = self._rank_merged(k_cache), self._rank_merged(v_cache)
        slot = slots_BS.to(torch.long)[:, None, :, None].expand(-1, k.shape[1], -1, self.head_dim)
        k_all, v_all = k_all.scatter(2, slot, k), v_all.scatter(2, slot, v)
        cache_slots = torch.arange(k_all.shape[2], device=x_BSH.device)
        allowed = (cache_slots[None, None, :] <= slots_BS[:, :, None])[:, None]  # (B, 1, S, L)
        out = self._output(gqa_attention(q, k_all, v_all, allowed, self.head_dim**-0.5), gate)
        return out, self._per_rank(k_all), self._per_rank(v_all)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet: QKV projection, causal conv + silu, the gated delta rule, gated RMSNorm, out_proj."""

    def __init__(self, arch: Arch, tp: int, dtype: torch.dtype):
        super().__init__()
        if arch.num_k_heads % tp or arch.num_v_heads % tp:
            raise ValueError(f"tp={tp} must divide DeltaNet key heads ({arch.num_k_heads}) and value heads "
                             f"({arch.num_v_heads})")
        rank = arch.per_rank(tp)
        self.key_heads, self.value_heads = rank.num_k_heads, rank.num_v_heads
        self.dk, self.dv, self.eps = arch.k_head_dim, arch.v_head_dim, arch.rms_norm_eps
        self.taps = arch.conv_kernel
        self.channels = rank.conv_dim
        hidden, value_dim = arch.hidden_size, rank.value_dim
        self.in_proj_qkv = Weight((self.channels, hidden), dtype, tp)  # per rank rows [Q_r | K_r | V_r]
        self.in_proj_z = Weight((value_dim, hidden), dtype, tp)
        self.in_proj_a = Weight((self.value_heads, hidden), dtype, tp)
        self.in_proj_b = Weight((self.value_heads, hidden), dtype, tp)
        self.conv1d_weight = Weight((self.channels, self.taps), dtype, tp)
        self.A_log_weight = Weight((self.value_heads, 1), torch.float32, tp)
        self.dt_bias_weight = Weight((self.value_heads, 1), torch.float32, tp)
        self.norm = Weight((self.dv,), torch.float32, None)
        self.out_proj = Weight((hidden, value_dim), dtype, tp)

    def _conv_weight(self) -> torch.Tensor:
        """(R*C, K): depthwise conv is per channel, so the ranks' channels side by side form one conv."""
        return self.conv1d_weight.weight.flatten(0, 1)

    def _gates(self, x_BSH):
        """-> (g, beta), each (B, S, R*Hv): g = -exp(A_log) * softplus(a + dt_bias) <= 0 (log-decay), sigmoid(b)."""
        a = column_parallel(x_BSH, self.in_proj_a.weight).flatten(2)
        b = column_parallel(x_BSH, self.in_proj_b.weight).flatten(2)
        a_log, dt_bias = self.A_log_weight.weight.flatten(), self.dt_bias_weight.weight.flatten()
        g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
        return g, b.sigmoid()

    def _heads(self, mixed_BSRC: torch.Tensor):
        """Each rank's conv output -> rank-merged heads: q, k (B, S, R*Hk, dk) L2-normalised, v (B, S, R*Hv, dv)."""
        batch, length = mixed_BSRC.shape[:2]
        key_dim = self.key_heads * self.dk
        q, k, v = mixed_BSRC.split([key_dim, key_dim, self.value_heads * self.dv], dim=-1)
        q = l2_normalize(q.reshape(batch, length, -1, self.dk))
        k = l2_normalize(k.reshape(batch, length, -1, self.dk))
        return q, k, v.reshape(batch, length, -1, self.dv)

    def _output(self, core_BSHV: torch.Tensor, x_BSH: torch.Tensor) -> torch.Tensor:
        """Gated RMSNorm per value head (norm(core) * w * silu(z)), then out_proj and the all-reduce."""
        z = column_parallel(x_BSH, self.in_proj_z.weight)  # (B, S, R, Hv*dv)
        batch, length, ranks, _ = z.shape
        z = z.reshape(batch, length, -1, self.dv)
        normed = rms_norm(core_BSHV, self.norm.weight, self.eps)
        gated = (normed.float() * F.silu(z.float())).to(core_BSHV.dtype)
        return row_parallel(gated.reshape(batch, length, ranks, -1), self.out_proj.weight)

    def prefill(self, x_BSH, valid_BS, seq_lens_B, conv_state=None, recurrent_state=None):
        """-> (out (B, S, H), conv state (R, B, C, K-1), recurrent state (R, B, Hv, dk, dv) float32).

        From the given states (those of the tokens before this chunk), or from zeros (the start of a sequence).
        Right-padded steps are masked with beta = 0 and g = 0 (they leave the state untouched) and the conv
        state is gathered at each row's last real inputs, so the bucket padding never reaches the state."""
        batch, length, _ = x_BSH.shape
        mixed_BSRC = column_parallel(x_BSH, self.in_proj_qkv.weight)
        ranks = mixed_BSRC.shape[2]
        if conv_state is not None:
            conv_state = conv_state.transpose(0, 1).reshape(batch, ranks * self.channels, self.taps - 1)
            recurrent_state = recurrent_state.transpose(0, 1).reshape(batch, ranks * self.value_heads, self.dk,
                                                                      self.dv)
        conv_out, conv_state = causal_conv1d(mixed_BSRC.flatten(2).transpose(1, 2), self._conv_weight(),
                                             conv_state, seq_lens=seq_lens_B)
        mixed_BSRC = F.silu(conv_out).transpose(1, 2).reshape(batch, length, ranks, self.channels)
        q, k, v = self._heads(mixed_BSRC)
        g, beta = self._gates(x_BSH)
        valid = valid_BS[:, :, None]
        g, beta = torch.where(valid, g, 0.0), torch.where(valid, beta, torch.zeros_like(beta))
        core, recurrent = chunk_gated_delta_rule(q, k, v, g, beta, recurrent_state)
        conv_state = conv_state.reshape(batch, ranks, self.channels, self.taps - 1).transpose(0, 1).contiguous()
        recurrent = recurrent.reshape(batch, ranks, self.value_heads, self.dk, self.dv).transpose(0, 1).contiguous()
        return self._output(core, x_BSH), conv_state, recurrent

    def decode(self, x_B1H, conv_state, recurrent_state):
        """One step with the recurrent kernels. -> (out (B, 1, H), conv state, recurrent state) as in prefill."""
        ranks, batch = conv_state.shape[:2]
        mixed_BRC = column_parallel(x_B1H, self.in_proj_qkv.weight)[:, 0].flatten(1)
        conv_merged = conv_state.transpose(0, 1).reshape(batch, ranks * self.channels, self.taps - 1)
        conv_out, conv_merged = causal_conv1d_update(mixed_BRC, conv_merged, self._conv_weight())
        q, k, v = self._heads(F.silu(conv_out).reshape(batch, 1, ranks, self.channels))
        g, beta = self._gates(x_B1H)
        state = recurrent_state.transpose(0, 1).reshape(batch, ranks * self.value_heads, self.dk, self.dv)
        core, state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
        conv_state = conv_merged.reshape(batch, ranks, self.channels, self.taps - 1).transpose(0, 1).contiguous()
        state = state.reshape(batch, ranks, self.value_heads, self.dk, self.dv).transpose(0, 1).contiguous()
        return self._output(core, x_B1H), conv_state, state


class DenseMLP(nn.Module):
    """SwiGLU with the intermediate split across the moe_tp = tp // ep ranks of an expert group.

    In a dense model ep is 1 (a plain tp split). In an MoE model's dense layers (Qwen3-Next mlp_only_layers)
    the shard step splits the MLP like the shared expert: replicated across ep groups, so its partial is
    divided by ep before the all-reduce.
    """

    def __init__(self, arch: Arch, tp: int, ep: int, dtype: torch.dtype):
        super().__init__()
        moe_tp = tp // ep
        if arch.intermediate_size % moe_tp:
            raise ValueError(f"tp // ep = {moe_tp} must divide intermediate_size={arch.intermediate_size}")
        inter, self.ep = arch.intermediate_size // moe_tp, ep
        self.gate_proj = Weight((inter, arch.hidden_size), dtype, tp)
        self.up_proj = Weight((inter, arch.hidden_size), dtype, tp)
        self.down_proj = Weight((arch.hidden_size, inter), dtype, tp)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        act = F.silu(column_parallel(x_BSH, self.gate_proj.weight)) * column_parallel(x_BSH, self.up_proj.weight)
        partial_RBSH = torch.einsum("bsri,rhi->rbsh", act, self.down_proj.weight) / self.ep
        return partial_RBSH.sum(0)  # the all-reduce


class ExpertMLPs(nn.Module):
    """NxDI's `expert_mlps.mlp_op`: gate_up (R, E, H, 2I) [gate | up on the last dim], down (R, E, I, H)."""

    def __init__(self, experts: int, hidden: int, inter: int, dtype: torch.dtype, tp: int):
        super().__init__()
        self.gate_up_proj = Weight((experts, hidden, 2 * inter), dtype, tp)
        self.down_proj = Weight((experts, inter, hidden), dtype, tp)


class MoE(nn.Module):
    """Routed experts (softmax router over all experts, top-k) plus a sigmoid-gated shared expert.

    Rank r holds the experts of ep group r // moe_tp, with the intermediate slice r % moe_tp. Every rank runs
    the replicated router over the full expert set and applies its own experts densely (each expert on every
    token, weighted by the routing weight, which is 0 where the expert was not chosen): exact, static-shaped
    and O(E) work, which is what a reference wants. The shared expert is replicated across ep groups, so its
    partial is divided by ep before the all-reduce counts it ep times.
    """

    def __init__(self, arch: Arch, tp: int, ep: int, dtype: torch.dtype):
        super().__init__()
        if tp % ep or arch.num_experts % ep:
            raise ValueError(f"ep={ep} must divide tp={tp} and num_experts={arch.num_experts}")
        moe_tp = tp // ep
        if arch.moe_intermediate_size % moe_tp or arch.shared_intermediate_size % moe_tp:
            raise ValueError(f"moe_tp={moe_tp} must divide moe_intermediate_size={arch.moe_intermediate_size} and "
                             f"shared_expert_intermediate_size={arch.shared_intermediate_size}")
        self.top_k, self.ep, self.normalize = arch.num_experts_per_tok, ep, arch.norm_topk_prob
        self.num_experts, local = arch.num_experts, arch.num_experts // ep
        hidden, inter = arch.hidden_size, arch.moe_intermediate_size // moe_tp
        shared = arch.shared_intermediate_size // moe_tp
        self.moe = nn.Module()
        self.moe.router = nn.Module()
        self.moe.router.linear_router = Weight((arch.num_experts, hidden), dtype, None)
        self.moe.expert_mlps = nn.Module()
        self.moe.expert_mlps.mlp_op = ExpertMLPs(local, hidden, inter, dtype, tp)
        self.shared_gate_proj = Weight((shared, hidden), dtype, tp)
        self.shared_up_proj = Weight((shared, hidden), dtype, tp)
        self.shared_down_proj = Weight((hidden, shared), dtype, tp)
        self.shared_expert_gate = Weight((1, hidden), dtype, None)
        expert_ids = [[(r // moe_tp) * local + e for e in range(local)] for r in range(tp)]
        self.register_buffer("expert_ids", torch.tensor(expert_ids, dtype=torch.long), persistent=False)  # (R, E)

    def _routing(self, x_TH: torch.Tensor) -> torch.Tensor:
        """Dense routing weights (T, all experts): top-k of a float32 softmax, renormalised, 0 elsewhere."""
        logits = x_TH @ self.moe.router.linear_router.weight.T
        probs = logits.softmax(-1, dtype=torch.float32)
        top, index = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            top = top / top.sum(-1, keepdim=True)
        return torch.zeros_like(probs).scatter(1, index, top).to(logits.dtype)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x_BSH.shape
        x_TH = x_BSH.reshape(-1, hidden)
        weights_TRE = self._routing(x_TH)[:, self.expert_ids]
        mlp = self.moe.expert_mlps.mlp_op
        gate, up = torch.einsum("th,rehi->trei", x_TH, mlp.gate_up_proj.weight).chunk(2, dim=-1)
        expert_out = torch.einsum("trei,reih->treh", F.silu(gate) * up, mlp.down_proj.weight)
        routed_TRH = (expert_out * weights_TRE[..., None]).sum(2)
        x_1TH = x_TH[None]
        shared = F.silu(column_parallel(x_1TH, self.shared_gate_proj.weight)) * column_parallel(
            x_1TH, self.shared_up_proj.weight)
        shared_TRH = torch.einsum("tri,rhi->trh", shared[0], self.shared_down_proj.weight)
        shared_TRH = shared_TRH * torch.sigmoid(x_TH @ self.shared_expert_gate.weight.T)[:, :, None]
        partial_TRH = routed_TRH + shared_TRH / self.ep
        return partial_TRH.sum(1).reshape(batch, length, hidden)  # the all-reduce


class DecoderLayer(nn.Module):
    def __init__(self, arch: Arch, layer: int, tp: int, ep: int, dtype: torch.dtype):
        super().__init__()
        self.eps = arch.rms_norm_eps
        self.is_attention = arch.is_full_attention(layer)
        if self.is_attention:
            self.self_attn = GatedAttention(arch, tp, dtype)
        else:
            self.linear_attn = GatedDeltaNet(arch, tp, dtype)
        self.mlp = MoE(arch, tp, ep, dtype) if arch.is_moe_layer(layer) else DenseMLP(arch, tp, ep, dtype)
        self.input_layernorm = Weight((arch.hidden_size,), torch.float32, None)
        self.post_attention_layernorm = Weight((arch.hidden_size,), torch.float32, None)

    def feed_forward(self, h_BSH: torch.Tensor) -> torch.Tensor:
        return h_BSH + self.mlp(rms_norm(h_BSH, self.post_attention_layernorm.weight, self.eps))


class TextModel(nn.Module):
    """The text decoder over per-rank NxDI shards, tp ranks (and ep expert groups) simulated in one process.

    Build it, `load_shards` the rank state dicts, then `prefill` a right-padded bucket (and `extend` it chunk by
    chunk) and `decode` token by token, threading the state tuple through (layout in the module docstring and
    `state_names`).
    """

    def __init__(self, arch: Arch, tp: int = 1, ep: int = 1, dtype: torch.dtype = torch.float32,
                 max_seq_len: int = 256):
        super().__init__()
        if tp < 1 or ep < 1:
            raise ValueError(f"tp={tp} and ep={ep} must be >= 1")
        if ep > 1 and not arch.num_experts:
            raise ValueError(f"ep={ep} needs an MoE model; {arch.text_model_type} has no experts")
        self.arch, self.tp, self.ep, self.dtype, self.max_seq_len = arch, tp, ep, dtype, max_seq_len
        self.embed_tokens = Weight((arch.vocab_size, arch.hidden_size), dtype, None)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, tp, ep, dtype) for i in range(arch.num_layers))
        self.norm = Weight((arch.hidden_size,), torch.float32, None)
        self.lm_head = Weight((arch.vocab_size, arch.hidden_size), dtype, None)
        self.rank_util = RankUtil(tp)
        self.rotary = RotaryEmbedding(arch)

    # ---- state layout ------------------------------------------------------------------------------------
    def state_names(self) -> list[str]:
        """The name of each state tensor, in the order prefill returns and decode takes them."""
        names = []
        for i, layer in enumerate(self.layers):
            kinds = ("k_cache", "v_cache") if layer.is_attention else ("conv_state", "recurrent_state")
            names += [f"layers.{i}.{kind}" for kind in kinds]
        return names

    def state_shapes(self, batch: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of each state tensor for a batch size, in `state_names` order."""
        shapes = []
        for layer in self.layers:
            if layer.is_attention:
                attn = layer.self_attn
                kv = ((self.tp, batch, attn.kv_heads, self.max_seq_len, attn.head_dim), self.dtype)
                shapes += [kv, kv]
            else:
                dn = layer.linear_attn
                shapes += [((self.tp, batch, dn.channels, dn.taps - 1), self.dtype),
                           ((self.tp, batch, dn.value_heads, dn.dk, dn.dv), torch.float32)]
        return shapes

    # ---- forward passes ----------------------------------------------------------------------------------
    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """input ids (B, S) int -> embeddings; float (B, S, H) inputs are already embeddings (e.g. with images)."""
        if tokens.is_floating_point():
            return tokens.to(self.dtype)
        return F.embedding(tokens, self.embed_tokens.weight)

    def _logits(self, h_BSH: torch.Tensor) -> torch.Tensor:
        return rms_norm(h_BSH, self.norm.weight, self.arch.rms_norm_eps) @ self.lm_head.weight.T

    def _layers(self, h_BSH: torch.Tensor, mix) -> tuple[torch.Tensor, tuple]:
        """h through every layer; `mix(i, layer, normed)` is layer i's token mixer: (out, *its state tensors).
        -> (logits, the state tuple)."""
        state: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            out, *layer_state = mix(i, layer, rms_norm(h_BSH, layer.input_layernorm.weight, layer.eps))
            h_BSH = layer.feed_forward(h_BSH + out)
            state += layer_state
        return self._logits(h_BSH), tuple(state)

    def prefill(self, tokens: torch.Tensor, position_ids: torch.Tensor, seq_lens: torch.Tensor):
        """Run a right-padded prompt bucket from an empty state.

        Args:
            tokens: input ids (B, S) int64, or input embeddings (B, S, H) (see `qbuild.model.modeling.vision`).
            position_ids: (B, S) text positions, or (3, B, S) mRoPE positions; padded steps may hold anything.
            seq_lens: (B,) number of real tokens in each row (1 <= seq_lens <= S <= max_seq_len).
        Returns:
            logits (B, S, V) (rows past seq_lens are padding), and the state tuple (module docstring).
        """
        h = self._embed(tokens)
        length = h.shape[1]
        if length > self.max_seq_len:
            raise ValueError(f"prefill bucket {length} exceeds max_seq_len {self.max_seq_len}")
        cos, sin = self.rotary(position_ids)
        valid_BS = torch.arange(length, device=h.device)[None, :] < seq_lens[:, None]

        def mix(i, layer, normed):
            if layer.is_attention:
                return layer.self_attn.prefill(normed, cos, sin, self.max_seq_len)
            return layer.linear_attn.prefill(normed, valid_BS, seq_lens)

        return self._layers(h, mix)

    def extend(self, tokens: torch.Tensor, position_ids: torch.Tensor, starts: torch.Tensor, seq_lens: torch.Tensor,
               state: Sequence[torch.Tensor]):
        """Continue each row's sequence with a right-padded chunk: chunked prefill, or a prefill resumed from a
        prefix-cache checkpoint. The same arithmetic as `prefill` of the whole sequence, up to summation order.

        Args:
            tokens: input ids (B, S) int64, or input embeddings (B, S, H), as for `prefill`.
            position_ids: (B, S) text positions, or (3, B, S) mRoPE positions of the chunk's tokens.
            starts: (B,) the KV-cache slot of each row's first chunk token (the number of tokens before it);
                starts + S <= max_seq_len.
            seq_lens: (B,) number of real tokens of the chunk in each row (1 <= seq_lens <= S).
            state: the state of the tokens before the chunk (prefill's, extend's or decode's tuple).
        Returns:
            logits (B, S, V) of the chunk (rows past seq_lens are padding), and the new state tuple.
        """
        h = self._embed(tokens)
        length = h.shape[1]
        cos, sin = self.rotary(position_ids)
        offsets = torch.arange(length, device=h.device)
        slots_BS = starts[:, None] + offsets[None, :]
        valid_BS = offsets[None, :] < seq_lens[:, None]

        def mix(i, layer, normed):
            first, second = state[2 * i], state[2 * i + 1]
            if layer.is_attention:
                return layer.self_attn.extend(normed, cos, sin, slots_BS, first, second)
            return layer.linear_attn.prefill(normed, valid_BS, seq_lens, first, second)

        return self._layers(h, mix)

    def decode(self, input_ids: torch.Tensor, position_ids: torch.Tensor, positions: torch.Tensor,
               state: Sequence[torch.Tensor]):
        """One token per row: `extend` by one token, with DeltaNet's one-step recurrent kernels.

        Args:
            input_ids: (B, 1) int64.
            position_ids: (B, 1) text positions or (3, B, 1) mRoPE positions of this token.
            positions: (B,) the KV-cache slot of this token (its index in the sequence; < max_seq_len).
            state: the tuple prefill, extend or the previous decode returned.
        Returns:
            logits (B, 1, V) and the new state tuple.
        """
        h = self._embed(input_ids)
        cos, sin = self.rotary(position_ids)

        def mix(i, layer, normed):
            first, second = state[2 * i], state[2 * i + 1]
            if layer.is_attention:
                return layer.self_attn.extend(normed, cos, sin, positions[:, None], first, second)
            return layer.linear_attn.decode(normed, first, second)

        return self._layers(h, mix)

    # ---- weights -----------------------------------------------------------------------------------------
    def _targets(self) -> dict[str, tuple[torch.Tensor, bool]]:
        """NxDI name -> (the tensor to fill, whether it is sharded with a leading rank dim)."""
        targets = {}
        for prefix, module in self.named_modules():
            if isinstance(module, Weight):
                targets[f"{prefix}.weight"] = (module.weight, module.sharded)
            elif isinstance(module, RankUtil):
                targets[f"{prefix}.rank"] = (module.rank, True)
        return targets

    def load_shards(self, shards: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """Load one state dict per rank (NxDI names, as the shard step writes them), strictly.

        FP8 weights and a fused Wqkv are unpacked first, by the layout's own rule (qbuild.model.convert.unpack.unpack_rank).
        Raises ValueError naming the tensor on a missing or unexpected tensor, a wrong shape, a replicated tensor
        that differs between ranks, or a rank tensor that does not hold its rank.
        """
        if len(shards) != self.tp:
            raise ValueError(f"got {len(shards)} rank state dicts for tp={self.tp}")
        ranks = [unpack_rank(r, shard, self.arch, self.tp) for r, shard in enumerate(shards)]
        targets = self._targets()
        for r, tensors in enumerate(ranks):
            missing, unexpected = sorted(targets.keys() - tensors.keys()), sorted(tensors.keys() - targets.keys())
            if missing or unexpected:
                raise ValueError(f"rank {r} shard: missing tensors {missing}, unexpected tensors {unexpected}")
        with torch.no_grad():
            for name, (target, sharded) in targets.items():
                values = [tensors[name] for tensors in ranks]
                if sharded:
                    value = _stack_ranks(name, values, target.shape[1:])
                else:
                    value = values[0]
                    for r, other in enumerate(values[1:], start=1):
                        if other.shape != value.shape or not torch.equal(other, value):
                            raise ValueError(f"replicated tensor {name} differs between rank 0 and rank {r}")
                if value.shape != target.shape:
                    raise ValueError(f"tensor {name} has shape {tuple(value.shape)}, expected {tuple(target.shape)}")
                if name.endswith("rank_util.rank") and value.flatten().tolist() != list(range(self.tp)):
                    raise ValueError(f"tensor {name} holds ranks {value.flatten().tolist()}, expected 0..{self.tp - 1}")
                target.copy_(value)


def _stack_ranks(name: str, values: list[torch.Tensor], shard_shape: torch.Size) -> torch.Tensor:
    for r, value in enumerate(values):
        if value.shape != shard_shape:
            raise ValueError(f"tensor {name} of rank {r} has shape {tuple(value.shape)}, expected {tuple(shard_shape)}")
    return torch.stack(values)


class EntryPoint(nn.Module):
    """A torch.export-able view of one TextModel method (`prefill`, `extend` or `decode`) under the model's own names.

    It registers the model's children and buffers as its own (the same objects), so the exported graph's
    parameters keep the NxDI names, and forwards its arguments to the method.
    """

    def __init__(self, model: TextModel, method: Literal["prefill", "extend", "decode"]):
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        self._call = getattr(model, method)

    def forward(self, *args):
        return self._call(*args)


def text_position_ids(seq_len: int, batch: int = 1, offset: int = 0) -> torch.Tensor:
    """Plain text positions (B, S): offset, offset+1, ... for every row."""
    return (torch.arange(seq_len) + offset)[None].expand(batch, -1).contiguous()
