"""Torch reference kernels for the hybrid Qwen3.5 / Qwen3-Next models.

Their source is part of every compile key: a change here rebuilds every compiled graph. The package lives
inside qbuild because an unrelated PyPI package is named `kernels`.
"""

from qbuild.model.kernels.attention import gqa_attention, naive_gqa_attention
from qbuild.model.kernels.conv import causal_conv1d, causal_conv1d_update
from qbuild.model.kernels.deltanet import (
    CHUNK_SIZE,
    chunk_gated_delta_rule,
    naive_recurrent,
    recurrent_gated_delta_rule,
    unit_lower_triangular_inverse,
)

__all__ = [
    "CHUNK_SIZE",
    "causal_conv1d",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "gqa_attention",
    "naive_gqa_attention",
    "naive_recurrent",
    "recurrent_gated_delta_rule",
    "unit_lower_triangular_inverse",
]
