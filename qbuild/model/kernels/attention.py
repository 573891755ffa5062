"""Grouped-query softmax attention: the form prefill, extend and decode use, and the plain one it is tested against.

Both take the same arguments in the same order:
    q        (B, Nq, Sq, D)   queries
    k, v     (B, Nkv, Sk, D)  keys and values; Nq is a multiple of Nkv, and query heads h = j*G + i share kv head j
                              (G = Nq / Nkv), as HF's repeat_kv lays them out
    allowed  bool, broadcastable to (B, 1, Sq, Sk): which keys each query may see; every query must be allowed at
             least one key (its own position), so no row is fully masked
    scale    the logit scale, D^-0.5 for these models
and return (B, Nq, Sq, D) in q's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v through torch's scaled_dot_product_attention, which on the CPU is a fused
    kernel that never materializes the (Sq, Sk) scores: a chunked prefill attends from each chunk to a KV bucket of
    thousands of slots, where the plain form spends most of a prefill."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def naive_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """The same as written: scores, mask, a float32 softmax, the weighted values (the oracle of the fused form)."""
    batch, num_q, len_q, dim = q.shape
    num_kv = k.shape[1]
    q_grouped = q.reshape(batch, num_kv, num_q // num_kv, len_q, dim)   # (B, Nkv, G, Sq, D)
    scores = (q_grouped @ k[:, :, None].transpose(-1, -2)) * scale  # (B, Nkv, G, Sq, Sk)
    scores = scores.float().masked_fill(~allowed[:, :, None], float("-inf"))
    probs = scores.softmax(-1).to(v.dtype)
    return (probs @ v[:, :, None]).reshape(batch, num_q, len_q, dim)
