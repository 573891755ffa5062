"""The zero DeltaNet checkpoint banks the Qwen3.6-27B port's model takes as weights (prefix caching of the hybrid
layers), which NxD's sharding never writes, so the port adds them to every shard after compile.

Read from PR 173 @ 03db3ef, contrib/models/Qwen3.6-27B/test/integration/qwen36_27b_compile_fp8.py
(`_ensure_hybrid_checkpoint_weights`): per DeltaNet layer (numbered by its ordinal among the DeltaNet layers, not its
layer number), `hybrid_gdn_checkpoint_cache.recurrent_slots.<i>` (slots, Hv/tp, dk, dv) in float32 and
`hybrid_gdn_checkpoint_cache.conv_slots.<i>` (slots, conv_dim/tp, K - 1) in the model dtype, with
slots = max_gdn_checkpoint_slots (8, Qwen35InferenceConfig's default).
"""

from __future__ import annotations

import torch

from qbuild.model.arch import Arch
from qbuild.core.dtypes import torch_dtype

MAX_GDN_CHECKPOINT_SLOTS = 8


def gdn_checkpoint_banks(arch: Arch, tp: int, dtype: str,
                         slots: int = MAX_GDN_CHECKPOINT_SLOTS) -> dict[str, torch.Tensor]:
    """{name: zeros} of one rank (every rank holds the same shapes)."""
    rank = arch.per_rank(tp)
    gdn = [i for i, t in enumerate(arch.layer_types) if t == "linear_attention"]
    out = {}
    for idx in range(len(gdn)):
        out[f"hybrid_gdn_checkpoint_cache.recurrent_slots.{idx}"] = torch.zeros(
            (slots, rank.num_v_heads, arch.k_head_dim, arch.v_head_dim), dtype=torch.float32)
        out[f"hybrid_gdn_checkpoint_cache.conv_slots.{idx}"] = torch.zeros(
            (slots, rank.conv_dim, arch.conv_kernel - 1), dtype=torch_dtype(dtype))
    return out
