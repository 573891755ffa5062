"""Contract double of NxDI modules/attention/gqa.py: how many q and kv heads each rank holds.

docs/nxdi.md section 4 states the tp > n_kv case (kv heads replicated to tp, q heads zero-padded to a multiple of tp);
the exact conditions below are NxDI's `determine_sharding_strategy` / `get_shardable_head_counts` as read through the
source (gqa.py; docs/nxdi.md section 4): kv heads change only when n_kv < tp or n_kv % tp != 0.
"""

from __future__ import annotations

import enum


class GQA(enum.Enum):
    CONVERT_TO_MHA = "convert-to-mha"
    REPLICATE_TO_TP_DEGREE = "replicate-to-tp-degree"


def determine_sharding_strategy(tp_degree: int, source_key_value_heads: int) -> GQA:
    if tp_degree % source_key_value_heads != 0:
        return GQA.CONVERT_TO_MHA
    return GQA.REPLICATE_TO_TP_DEGREE


def get_number_of_extra_heads(num_heads: int, tp_degree: int) -> int:
    return (-num_heads) % tp_degree


def get_shardable_head_counts(tp_degree: int, num_attention_heads: int, num_key_value_heads: int,
                              sharding_strategy: GQA) -> tuple[int, int]:
    heads = num_attention_heads + get_number_of_extra_heads(num_attention_heads, tp_degree)
    kv_heads = num_key_value_heads
    if num_attention_heads == num_key_value_heads:
        kv_heads = heads
    elif num_key_value_heads < tp_degree or num_key_value_heads % tp_degree != 0:
        if sharding_strategy == GQA.REPLICATE_TO_TP_DEGREE:
            assert tp_degree % num_key_value_heads == 0, \
                "GQA.REPLICATE_TO_TP_DEGREE requires tp_degree to be divisible by num_key_value_heads"
            kv_heads = tp_degree
        else:
            kv_heads = heads
    return heads, kv_heads


def attention_weights(prefix: str, tp: int, num_heads: int, num_kv_heads: int, head_dim: int, hidden: int,
                      dtype: str, fused_qkv: bool) -> dict:
    """The per-rank q/k/v/o weights of NxDI's GQA attention under the names its preshard hooks give them
    (docs/nxdi.md section 4: `self_attn.{q,k,v}_proj` -> `self_attn.qkv_proj.{q,k,v}_proj`, `Wqkv` ->
    `qkv_proj.Wqkv`, `o_proj` -> `o_proj.o_proj`; fused Wqkv per rank is [Q_r|K_r|V_r] of the padded lengths; o_proj
    padded like q on dim 1). No biases: the Qwen3.5 attention has none, and a shard that carried one is refused."""
    from neuronx_distributed_inference._nxd import column, row

    strategy = determine_sharding_strategy(tp, num_kv_heads)
    heads, kv_heads = get_shardable_head_counts(tp, num_heads, num_kv_heads, strategy)
    out = {}
    if fused_qkv:
        out[f"{prefix}.qkv_proj.Wqkv.weight"] = column((heads + 2 * kv_heads) * head_dim, hidden, tp, dtype)
    else:
        out[f"{prefix}.qkv_proj.q_proj.weight"] = column(heads * head_dim, hidden, tp, dtype)
        out[f"{prefix}.qkv_proj.k_proj.weight"] = column(kv_heads * head_dim, hidden, tp, dtype)
        out[f"{prefix}.qkv_proj.v_proj.weight"] = column(kv_heads * head_dim, hidden, tp, dtype)
    out[f"{prefix}.o_proj.o_proj.weight"] = row(hidden, heads * head_dim, tp, dtype)
    return out
