"""Grouped-query softmax attention, the reference form used by both prefill and decode."""

from __future__ import annotations

import torch


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v with each kv head serving a contiguous group of query heads.

    Args:
        q: (B, Nq, Sq, D) queries.
        k, v: (B, Nkv, Sk, D); Nq is a multiple of Nkv.
        allowed: bool, broadcastable to (B, 1, Sq, Sk): which keys each query may see. Every query must be
            allowed at least one key (its own position), so no row is fully masked.
        scale: the logit scale, D^-0.5 for these models.
    Returns:
        (B, Nq, Sq, D) in q's dtype; the softmax runs in float32.
    """
    batch, num_q, len_q, dim = q.shape
    num_kv = k.shape[1]
    # (B, Nkv, G, Sq, D): query heads h = j*G + i share kv head j, as HF's repeat_kv lays them out.
    q_grouped = q.reshape(batch, num_kv, num_q // num_kv, len_q, dim)
    scores = (q_grouped @ k[:, :, None].transpose(-1, -2)) * scale  # (B, Nkv, G, Sq, Sk)
    scores = scores.float().masked_fill(~allowed[:, :, None], float("-inf"))
    probs = scores.softmax(-1).to(v.dtype)
    return (probs @ v[:, :, None]).reshape(batch, num_q, len_q, dim)
