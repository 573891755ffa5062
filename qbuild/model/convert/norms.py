"""RMSNorm "+1" (docs/nxd-layout.md section 1): HF's decoder norms are zero-centred (out = rmsnorm(x) * (1 + w)),
NxDI's are standard (out = rmsnorm(x) * w), so w -> w + 1, computed and kept in float32.

This table is the one place the +1 applies. The DeltaNet gated norm (`linear_attn.norm`, initialised to ones, a
standard norm already) and the vision LayerNorms are deliberately absent from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:   # the rules import torch where they run it: a header check builds their tables without it
    import torch

from qbuild.model.convert.rule import Row


def plus_one(arch, w: torch.Tensor) -> tuple[torch.Tensor]:
    return (w.float() + 1.0,)


def _hidden(d):
    return (d.hidden_size,)


def _head(d):
    return (d.head_dim,)


FINAL_NORM = Row("norm.weight", _hidden, ("norm.weight",), plus_one, keep_fp32=True)
LAYER_NORMS = (
    Row("input_layernorm.weight", _hidden, ("input_layernorm.weight",), plus_one, keep_fp32=True),
    Row("post_attention_layernorm.weight", _hidden, ("post_attention_layernorm.weight",), plus_one, keep_fp32=True),
)
# Full-attention layers only; renamed to NxDI's q_layernorm / k_layernorm.
ATTENTION_NORMS = (
    Row("self_attn.q_norm.weight", _head, ("self_attn.q_layernorm.weight",), plus_one, keep_fp32=True),
    Row("self_attn.k_norm.weight", _head, ("self_attn.k_layernorm.weight",), plus_one, keep_fp32=True),
)
