"""The sharded checkpoints NxD itself writes (docs/nxdi.md section 4), for the three public port lineages, so the neuron
backend ships per-rank files that NxD loads as they are.

How NxD produces them (NxD = aws-neuron/neuronx-distributed @ fbac349, NxDI = aws-neuron/neuronx-distributed-inference
@ 4bcdc54 unless a line says otherwise): ModelBuilder.shard_checkpoint (NxD trace/model_builder.py) builds the
context-encoding module, loads the checkpoint through the port's converter, runs every module's preshard_hook, deletes
every key the module's state_dict lacks (NxD trace/trace.py preprocess_checkpoint), casts each tensor to its
parameter's dtype (model_builder.py cast_weights), then per rank slices the NxD parallel layers and copies the rest
whole (trace.py shard_children). So a shard holds exactly the module's parameters that the checkpoint supplies, under
the module's names. The CPU layout (shard.py) keeps qbuild's names and is not affected by anything here.

Ports:
- "nxd-main": contrib/models/Qwen3.5-35B-A3B/src/modeling_qwen35.py (the Qwen3.5-2B port has the same module names).
  DeltaNet tensor-parallel; MoE under `mlp.moe.`; shared expert as plain Column/RowParallelLinear.
- "nxd-main-replicated": contrib/models/Qwen3.5-27B/src/modeling_qwen35.py, PR 128 @ 550e2ab. The main port's
  attention, dense MLP, embedding and lm_head; DeltaNet replicated (nn.Linear / nn.Conv1d / nn.Parameter, L258-281)
  under the HF names its converter keeps (convert_qwen35_hf_to_neuron_state_dict, L1878).
- "nxd-moe": contrib/models/Qwen3-Coder-Next/src/modeling_qwen35_moe.py, PR 170 @ 753c7f5. DeltaNet replicated
  (nn.Linear / nn.Conv1d / nn.Parameter); MoE directly under `mlp.`; shared expert wrapped in
  SigmoidGatedSharedExperts around NxD's SharedExperts.

Ranks (a RankLayout, qbuild.model.ranks): `world` is NxD's world size: ModelBuilder.shard_checkpoint writes one
tp{r}_sharded_checkpoint.safetensors for each r < world_size (NxD trace/model_builder.py shard_checkpoint /
shard_weights_with_cache), and NxDI sets world_size = tp_degree * pp_degree * ep_degree (NxDI models/config.py:384).
`dense_tp` is NxDI's tp_degree, so NxD's ep_degree is world / dense_tp. Two worlds are modelled:
- ep_degree 1 (dense_tp = world): the experts use NxD's MoE process groups of moe_tp_degree = world / moe_ep and
  moe_ep_degree = moe_ep inside the one tp group (NxD modules/moe/moe_process_group.py);
- NxD's EP world (dense_tp = moe_tp = world / moe_ep, ep_degree = moe_ep_degree = moe_ep), the one configuration a
  public port validated (Coder-Next README @ 753c7f5: tp_degree 8, ep_degree = moe_ep_degree 4, moe_tp_degree 8,
  32 ranks).
In both, rank r is moe-tp rank r % moe_tp of expert-parallel rank r // moe_tp: initialize_model_parallel makes each
tensor-parallel group a block of contiguous ranks and strides the expert-parallel groups by its size (NxD
parallel_layers/parallel_state.py ascending_ring_PG_group), and the MoE groups are built the same way from
(moe_tp, moe_ep). Every other NxD parallel layer (attention, embed_tokens, lm_head, the shared expert, the main
port's DeltaNet and dense MLP) has num_partitions = the size of its tensor-parallel group,
get_tensor_model_parallel_group() of dense_tp ranks (NxD parallel_layers/layers.py, modules/moe/shared_experts.py:128),
and shard_children gives rank r slice `rank % num_partitions` (NxD trace/trace.py:801): split over dense_tp and
identical in every copy. The GQA head counts follow that group too (NxDI modules/attention/attention_base.py:197
tp_degree = tensor_model_parallel_group.size()), as does the main port's DeltaNet reorder (modeling_qwen35.py
_reorder_deltanet_qkv_for_tp reads neuron_config.tp_degree).

The expert intermediate is never padded here: ExpertMLPsV2 / Experts build gate_up as (E_local, H, 2I/moe_tp) from
config.intermediate_size (NxD modules/moe/experts.py, expert_mlps_v2.py preshard_hook pads nothing), the main port sets
intermediate_size = moe_intermediate_size and never pads, and the Coder-Next config assigns intermediate_size before
maybe_pad_intermediate, so a padded checkpoint would fail shard_children's shape check.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from qbuild.core.dtypes import torch_dtype
from qbuild.model.arch import Arch
from qbuild.model.convert import attention, deltanet, embeddings, experts
from qbuild.model.convert.errors import CheckpointError, ShardError
from qbuild.model.convert.parallel import Placement, ShardStep, column, qkv_trios, replicate, row
from qbuild.model.ranks import RankLayout

NXD_MAIN = "nxd-main"
NXD_MAIN_REPLICATED = "nxd-main-replicated"
NXD_MOE = "nxd-moe"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


# --- Gated GQA: NxDI modules/attention/gqa.py (@ c63afe0, unchanged at 4bcdc54) ---------------------------------

@dataclass(frozen=True)
class Gqa:
    """NxD's sharded head counts: determine_sharding_strategy + get_shardable_head_counts."""
    replicate: bool    # REPLICATE_TO_TP_DEGREE (tp % nKV == 0), else CONVERT_TO_MHA
    num_heads: int     # q heads, zero-padded up to a multiple of tp (NxD parallel_layers/pad.py)
    num_kv_heads: int  # kv heads after replication / padding


def gqa(d: Arch, tp: int) -> Gqa:
    replicate_kv = tp % d.num_kv_heads == 0
    heads = d.num_heads + (-d.num_heads) % tp
    if d.num_heads == d.num_kv_heads:
        kv = heads
    elif d.num_kv_heads < tp or d.num_kv_heads % tp:
        kv = tp if replicate_kv else heads
    else:
        kv = d.num_kv_heads
    return Gqa(replicate_kv, heads, kv)


def gqa_supported(d: Arch, tp: int) -> bool:
    """False where NxD's own sharding fails: CONVERT_TO_MHA on a GQA model that needs its kv heads replicated.
    gqa.py replicates k/v to nH heads, then maybe_pad_tail computes the padding from the SOURCE kv head count and
    returns nH/nKV times too many rows, which shard_children rejects ("expected shape ... but found ...")."""
    g = gqa(d, tp)
    return g.replicate or g.num_kv_heads == d.num_kv_heads or d.num_heads == d.num_kv_heads


def _zero_heads(t: torch.Tensor, dim: int, num_heads: int, groups: int, per_group: int) -> torch.Tensor:
    """`t` with `per_group` zero heads appended after each of `groups` equal runs of heads along `dim`."""
    # Zero bits are +0.0 in every float format, and torch.cat has no float8 kernel on every build.
    bits = t.view(torch.uint8) if t.dtype in FP8_DTYPES else t
    head = bits.shape[dim] // num_heads
    runs = bits.unflatten(dim, (groups, -1))
    zeros = runs.new_zeros(*runs.shape[:dim + 1], per_group * head, *runs.shape[dim + 2:])
    out = torch.cat([runs, zeros], dim=dim + 1).flatten(dim, dim + 1)
    return out.view(t.dtype) if bits is not t else out


def pad_q_heads(t: torch.Tensor, dim: int, d: Arch, tp: int) -> torch.Tensor:
    """q rows (dim 0) or o_proj columns (dim 1) with NxD's zero heads: REPLICATE pads after each group of nH/nKV
    heads (maybe_pad_interleaved), CONVERT_TO_MHA at the tail (maybe_pad_tail)."""
    g = gqa(d, tp)
    extra = g.num_heads - d.num_heads
    if extra == 0:
        return t
    groups = d.num_kv_heads if g.replicate else 1
    return _zero_heads(t, dim, d.num_heads, groups, extra // groups)


def q_heads(t, d, p):
    return list(pad_q_heads(t, 0, d, p.world).chunk(p.world, dim=0))


def o_heads(t, d, p):
    return list(pad_q_heads(t, 1, d, p.world).chunk(p.world, dim=1))


def kv_heads(t, d, p):
    """REPLICATE: kv heads repeat_interleave'd to tp, so rank r holds source head r*nKV//tp (or contiguous heads when
    nKV == tp), which is attention.kv_head_shards. CONVERT_TO_MHA on an MHA model: zero heads at the tail."""
    g = gqa(d, p.world)
    if g.replicate:
        return attention.kv_head_shards(t, d.num_kv_heads, p.world)
    full = t
    if g.num_kv_heads != d.num_kv_heads:
        full = _zero_heads(t, 0, d.num_kv_heads, 1, g.num_kv_heads - d.num_kv_heads)
    return list(full.chunk(p.world, dim=0))


# --- Other placements ------------------------------------------------------------------------------------------

def hidden_columns(t, d, p):
    """ParallelEmbedding(shard_across_embedding=True): (V, H/tp), partition dim 1 (NxD parallel_layers/layers.py)."""
    return list(t.chunk(p.world, dim=1))


def hidden_columns_pad_row_zeroed(t, d, p):
    """The Coder-Next converter zeroes embed_tokens[pad_token_id] before sharding (753c7f5
    convert_qwen35_hf_to_neuron_state_dict, "Zero out the pad token embedding")."""
    if d.pad_token_id is not None:
        t = embeddings.zero_row(t, d.pad_token_id)
    return hidden_columns(t, d, p)


def deltanet_qkv(t, d, p):
    """The main port reorders in_proj_qkv and conv1d channels to per-rank [Q_r | K_r | V_r] when tp > 1
    (_reorder_deltanet_qkv_for_tp / _reorder_deltanet_qkv_channels_for_tp) before ColumnParallelLinear's dim-0 slice."""
    return deltanet.qkv_shards(t, d, p.world)


def experts_gate_up(t, d, p):
    """ExpertFusedColumnParallelLinear, stride 2: each of gate and up sliced on dim 2 (trace.py create_local_weight),
    then this rank's experts (create_local_weight_with_expert_parallel). An expert-wise FP8 scale (E, 1, 2I) follows
    the weight (quantization_layers.py _setup_for_scale partitions it when per_channel_axis == partition dim)."""
    return (experts.gate_up_shard(t, p.moe_ep, p.moe_tp, p.group(r), p.moe_rank(r)) for r in range(p.world))


def experts_down(t, d, p):
    """ExpertFusedRowParallelLinear: dim 1 sliced over moe_tp, then this rank's experts."""
    return [experts.down_shard(t, p.moe_ep, p.moe_tp, p.group(r), p.moe_rank(r)) for r in range(p.world)]


def experts_only(t, d, p):
    """The row-parallel expert scale (E, 1, H): not tensor-partitioned, but expert-parallel like every parameter of
    an expert layer (moe_parallel_layers.py _mark_expert_parallel_weights)."""
    return [experts.expert_group(t, p.moe_ep, p.group(r)) for r in range(p.world)]


def conv1d_replicated(t, d, p):
    """nn.Conv1d(conv_dim, conv_dim, K, groups=conv_dim).weight is (conv_dim, 1, K): the converted (conv_dim, K)
    with its channel dim restored."""
    return replicate(t.unsqueeze(1), d, p)


def vector_replicated(t, d, p):
    """nn.Parameter A_log / dt_bias of shape (Hv,): the converted (Hv, 1) flattened."""
    return replicate(t.reshape(-1), d, p)


def over_dense_tp(place: Placement) -> Placement:
    """`place` over NxD's tensor-parallel group, the dense_tp ranks every non-expert parallel layer is split over, with
    rank r holding slice r % dense_tp: shard_children's partition_rank = rank % num_partitions (NxD trace/trace.py:801)
    with num_partitions = tensor_parallel_group.size() (NxD parallel_layers/layers.py). So each expert-parallel copy
    of the group holds the same slices. `place` sees a layout of dense_tp ranks and nothing of the experts."""
    def placed(t, d, p):
        pieces = list(place(t, d, RankLayout.split(p.dense_tp)))
        return [pieces[p.dense_rank(r)] for r in range(p.world)]
    return placed


# --- Rule tables -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rule:
    target: str                     # the NxD parameter name of the weight (the scale is the same module's `.scale`)
    weight: Placement
    scale: Placement | None = None  # None: the module is never an FP8 one in this lineage
    experts: bool = False           # an ExpertMLPsV2 parameter: placed over all ranks by expert group and moe_tp
                                    # slice; every other rule's placements go through over_dense_tp

    @property
    def scale_target(self) -> str:
        return self.target.removesuffix(".weight") + ".scale"


# Both ports: NeuronAttentionBase (NxDI modules/attention/attention_base.py init_gqa_properties) wraps q/k/v in
# GroupQueryAttention_QKV `qkv_proj` and o_proj in GroupQueryAttention_O `o_proj`, whose preshard hooks rename the
# converter's keys; the output gate is the ports' own ColumnParallelLinear; norms are copied whole. A row-parallel
# per-channel scale (out, 1) is replicated (quantization_layers.py: not partitioned unless per_channel_axis is the
# partition dim); q/k/v scales are padded and replicated with their rows (gqa.py should_pad_scale).
_COMMON: dict[str, Rule] = {
    "embed_tokens": Rule("embed_tokens.weight", hidden_columns),
    "lm_head": Rule("lm_head.weight", column),
    "norm": Rule("norm.weight", replicate),
    "input_layernorm": Rule("input_layernorm.weight", replicate),
    "post_attention_layernorm": Rule("post_attention_layernorm.weight", replicate),
    "self_attn.q_proj": Rule("self_attn.qkv_proj.q_proj.weight", q_heads, q_heads),
    "self_attn.k_proj": Rule("self_attn.qkv_proj.k_proj.weight", kv_heads, kv_heads),
    "self_attn.v_proj": Rule("self_attn.qkv_proj.v_proj.weight", kv_heads, kv_heads),
    "self_attn.o_proj": Rule("self_attn.o_proj.o_proj.weight", o_heads, replicate),
    "self_attn.output_gate_proj": Rule("self_attn.output_gate_proj.weight", column, column),
    "self_attn.q_layernorm": Rule("self_attn.q_layernorm.weight", replicate),
    "self_attn.k_layernorm": Rule("self_attn.k_layernorm.weight", replicate),
}

# Qwen3.5-35B-A3B port (4bcdc54): NeuronGatedDeltaNet keeps every projection, and conv1d / A_log / dt_bias as
# ColumnParallelLinear "parameter containers", all split over the tp group.
_TENSOR_PARALLEL_DELTANET: dict[str, Rule] = {
    "linear_attn.in_proj_qkv": Rule("linear_attn.in_proj_qkv.weight", deltanet_qkv, deltanet_qkv),
    "linear_attn.conv1d_weight": Rule("linear_attn.conv1d_weight.weight", deltanet_qkv),
    "linear_attn.in_proj_z": Rule("linear_attn.in_proj_z.weight", column, column),
    "linear_attn.in_proj_a": Rule("linear_attn.in_proj_a.weight", column, column),
    "linear_attn.in_proj_b": Rule("linear_attn.in_proj_b.weight", column, column),
    "linear_attn.A_log_weight": Rule("linear_attn.A_log_weight.weight", column),
    "linear_attn.dt_bias_weight": Rule("linear_attn.dt_bias_weight.weight", column),
    "linear_attn.norm": Rule("linear_attn.norm.weight", replicate),
    "linear_attn.out_proj": Rule("linear_attn.out_proj.weight", row, replicate),
}

# Qwen35MLP, Column/RowParallelLinear over the full tp group (the 35B-A3B port @ 4bcdc54; the Qwen3.5-27B port
# @ 550e2ab L1383-1412).
_DENSE_MLP: dict[str, Rule] = {
    "mlp.gate_proj": Rule("mlp.gate_proj.weight", column, column),
    "mlp.up_proj": Rule("mlp.up_proj.weight", column, column),
    "mlp.down_proj": Rule("mlp.down_proj.weight", row, replicate),
}

# Qwen3.5-35B-A3B port (4bcdc54): the shared expert of Qwen35MoEBlock is Column/RowParallelLinear over the full tp
# group; the routed experts are initialize_moe_module under `mlp.moe`.
MAIN_RULES: dict[str, Rule] = {
    **_COMMON,
    **_TENSOR_PARALLEL_DELTANET,
    **_DENSE_MLP,
    "mlp.moe.router.linear_router": Rule("mlp.moe.router.linear_router.weight", replicate),
    experts.GATE_UP: Rule(f"{experts.GATE_UP}.weight", experts_gate_up, experts_gate_up, experts=True),
    experts.DOWN: Rule(f"{experts.DOWN}.weight", experts_down, experts_only, experts=True),
    "mlp.shared_gate_proj": Rule("mlp.shared_gate_proj.weight", column, column),
    "mlp.shared_up_proj": Rule("mlp.shared_up_proj.weight", column, column),
    "mlp.shared_down_proj": Rule("mlp.shared_down_proj.weight", row, replicate),
    "mlp.shared_expert_gate": Rule("mlp.shared_expert_gate.weight", replicate),
}

# NeuronGatedDeltaNet of plain nn.Linear / nn.Conv1d / nn.Parameter, whole on every rank, under the HF names (the
# Coder-Next port @ 753c7f5 and the Qwen3.5-27B port @ 550e2ab L258-281). NxD quantizes only its parallel layers
# (quantization_mappings.py), so these are never FP8.
_REPLICATED_DELTANET: dict[str, Rule] = {
    "linear_attn.in_proj_qkv": Rule("linear_attn.in_proj_qkv.weight", replicate),
    "linear_attn.conv1d_weight": Rule("linear_attn.conv1d.weight", conv1d_replicated),
    "linear_attn.in_proj_z": Rule("linear_attn.in_proj_z.weight", replicate),
    "linear_attn.in_proj_a": Rule("linear_attn.in_proj_a.weight", replicate),
    "linear_attn.in_proj_b": Rule("linear_attn.in_proj_b.weight", replicate),
    "linear_attn.A_log_weight": Rule("linear_attn.A_log", vector_replicated),
    "linear_attn.dt_bias_weight": Rule("linear_attn.dt_bias", vector_replicated),
    "linear_attn.norm": Rule("linear_attn.norm.weight", replicate),
    "linear_attn.out_proj": Rule("linear_attn.out_proj.weight", replicate),
}

# Qwen3.5-27B port (550e2ab): attention, embedding and lm_head as the main port names and splits them
# (NeuronAttentionBase with the output gate L1167-1219, ParallelEmbedding shard_across_embedding and a
# ColumnParallelLinear lm_head L1532-1555), the replicated DeltaNet, and a dense MLP in every layer (L1427).
MAIN_REPLICATED_RULES: dict[str, Rule] = {**_COMMON, **_REPLICATED_DELTANET, **_DENSE_MLP}

# Qwen3-Coder-Next port (753c7f5): NeuronGatedDeltaNet is nn.Linear / nn.Conv1d / nn.Parameter (replicated, and
# never quantized: NxD quantization_mappings.py converts only its parallel layers); the decoder's `mlp` is the MoE
# module itself (router, expert_mlps) with `shared_experts` = SigmoidGatedSharedExperts(SharedExperts(...),
# sigmoid_gate); SharedExperts' Column/RowParallelLinear use the full tp group (NxD modules/moe/shared_experts.py).
MOE_RULES: dict[str, Rule] = {
    **_COMMON,
    "embed_tokens": Rule("embed_tokens.weight", hidden_columns_pad_row_zeroed),
    **_REPLICATED_DELTANET,
    "mlp.moe.router.linear_router": Rule("mlp.router.linear_router.weight", replicate),
    experts.GATE_UP: Rule("mlp.expert_mlps.mlp_op.gate_up_proj.weight", experts_gate_up, experts_gate_up,
                         experts=True),
    experts.DOWN: Rule("mlp.expert_mlps.mlp_op.down_proj.weight", experts_down, experts_only, experts=True),
    "mlp.shared_gate_proj": Rule("mlp.shared_experts.shared_experts.gate_proj.weight", column, column),
    "mlp.shared_up_proj": Rule("mlp.shared_experts.shared_experts.up_proj.weight", column, column),
    "mlp.shared_down_proj": Rule("mlp.shared_experts.shared_experts.down_proj.weight", row, replicate),
    "mlp.shared_expert_gate": Rule("mlp.shared_experts.sigmoid_gate.weight", replicate),
}


@dataclass(frozen=True)
class Lineage:
    name: str
    rules: dict[str, Rule]
    expert_mlps: str                # layer-relative ExpertMLPsV2 prefix, where its spmd_rank lives
    tensor_parallel_deltanet: bool
    fuses_qkv_scales: bool          # the port's converter concatenates q/k/v FP8 scales into Wqkv.scale


LINEAGES: dict[str, Lineage] = {
    NXD_MAIN: Lineage(NXD_MAIN, MAIN_RULES, "mlp.moe.expert_mlps", tensor_parallel_deltanet=True,
                      fuses_qkv_scales=True),
    # The 27B's and Coder-Next's converters fuse only the weights; a quantized Wqkv's preshard hook would then find
    # no scale (550e2ab L1976-1993, 753c7f5).
    NXD_MAIN_REPLICATED: Lineage(NXD_MAIN_REPLICATED, MAIN_REPLICATED_RULES, "mlp.moe.expert_mlps",
                                 tensor_parallel_deltanet=False, fuses_qkv_scales=False),
    NXD_MOE: Lineage(NXD_MOE, MOE_RULES, "mlp.expert_mlps", tensor_parallel_deltanet=False,
                     fuses_qkv_scales=False),
}


def check_nxd_layout(d: Arch, p: RankLayout, lineage: Lineage) -> None:
    """ShardError unless NxD can shard a model of architecture `d` under `p` for this port lineage."""
    def need(ok: bool, why: str) -> None:
        if not ok:
            raise ShardError(f"{lineage.name} {p.describe()}: {why}")

    # The two worlds of the module docstring. Any other dense_tp would make NxD's ep_degree (world / dense_tp) differ
    # from moe_ep_degree, which no port runs (Coder-Next README @ 753c7f5: "moe_ep_degree=4, # Must match
    # ep_degree").
    need(p.dense_tp in (p.world, p.moe_tp),
         "dense_tp must be the world (NxD ep_degree 1) or moe_tp (NxD's EP world: ep_degree = moe_ep_degree)")
    need(p.moe_ep == 1 or bool(d.moe_layers), "expert groups (moe_ep > 1) need a mixture-of-experts model")
    need(lineage.name != NXD_MOE or bool(d.moe_layers), "the Coder-Next port builds routed experts in every "
                                                        "layer; this model has none")
    need(not d.moe_layers or len(d.moe_layers) == d.num_layers,
         "the port builds every layer of a mixture-of-experts model as MoE, but this model has dense layers")
    need(lineage.name != NXD_MAIN_REPLICATED or not d.moe_layers,
         "the Qwen3.5-27B port builds a dense MLP in every layer; this model has routed experts")
    need(lineage.name != NXD_MOE or not d.tie_word_embeddings,
         "the Coder-Next port has no tied-embedding support (update_state_dict_for_tied_weights)")
    # Every non-expert parallel layer is split over the dense_tp group (over_dense_tp).
    need(d.hidden_size % p.dense_tp == 0 and d.vocab_size % p.dense_tp == 0,
         f"embed_tokens splits hidden {d.hidden_size} and lm_head vocab {d.vocab_size}: both must divide by dense_tp")
    need(d.num_heads * d.head_dim % p.dense_tp == 0,
         f"output_gate_proj rows {d.num_heads * d.head_dim} must divide by dense_tp")
    need(gqa_supported(d, p.dense_tp), f"{d.num_kv_heads} kv heads with dense_tp % kv != 0: NxD's CONVERT_TO_MHA "
                                       "mis-sizes the replicated k/v of a GQA model (gqa.py maybe_pad_tail)")
    if lineage.tensor_parallel_deltanet and "linear_attention" in d.layer_types:
        need(d.num_k_heads % p.dense_tp == 0 and d.num_v_heads % p.dense_tp == 0,
             f"DeltaNet key/value heads ({d.num_k_heads}/{d.num_v_heads}) must both be divisible by dense_tp")
    if not d.moe_layers and d.intermediate_size is not None:
        need(d.intermediate_size % p.dense_tp == 0,
             f"dense intermediate {d.intermediate_size} does not split into {p.dense_tp}")
    if d.moe_layers:
        need(d.num_experts % p.moe_ep == 0, f"{d.num_experts} experts do not split into {p.moe_ep} groups")
        need(d.moe_intermediate_size % p.moe_tp == 0,
             f"expert intermediate {d.moe_intermediate_size} must divide by moe_tp {p.moe_tp}")
        need(d.shared_intermediate_size % p.dense_tp == 0,
             f"shared-expert intermediate {d.shared_intermediate_size} must divide by dense_tp (it is split over "
             "the full tp group)")


# --- The program -------------------------------------------------------------------------------------------------

def cast(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """NxD's dtypes: DecoderModelInstance.load_module casts every floating parameter but FP8 to the model dtype and
    puts `*scale` back to float32 (NxDI models/model_wrapper.py @ ef2731e), and cast_weights casts each checkpoint
    tensor to its parameter's dtype. Norms, A_log, conv and the router (created float32) therefore end up in the
    model dtype."""
    if name.endswith(".scale"):
        return t.to(torch.float32)
    if t.dtype in FP8_DTYPES or not t.is_floating_point():
        return t
    return t.to(dtype)


def _rank_tensors(d: Arch, p: RankLayout, lineage: Lineage) -> ShardStep:
    """SPMDRank parameters (NxD parallel_layers/layers.py:1543): `rank` (1,) int32 with num_partitions = the SPMDRank's
    world_size, so rank r holds [r % world_size] (trace.py:801).
    - The ports' converters write `rank_util.rank` and `layers.N.self_attn.rank_util.rank` (full-attention layers) as
      arange(tp_degree) (Coder-Next modeling_qwen35_moe.py:2369 / 2429 @ 753c7f5, 35B-A3B modeling_qwen35.py:6449 /
      6664 @ 4bcdc54), for SPMDRank(world_size=tp_degree) (NxDI models/model_base.py:94,
      modules/attention/attention_base.py:195): rank r holds [r % dense_tp].
    - ExpertMLPsV2.preshard_hook writes `spmd_rank.rank` as arange(world size) for SPMDRank(world_size=
      get_world_group().size()) (NxD expert_mlps_v2.py:123 / create_spmd_ranks:1511): rank r holds [r], the global
      rank (enable_spmd_rank = parallelize_token_to_block_mapping, True by default in NxD modules/moe/moe_configs.py).
      When the MoE expert-parallel group is larger than 1 it adds `spmd_rank.local_expert_indices`: each rank's
      expert-parallel group's experts, (1, E/ep) (expert_mlps_v2.py:138, create_spmd_ranks:1514)."""
    names = ["rank_util.rank"] + [f"layers.{i}.self_attn.rank_util.rank"
                                  for i in range(d.num_layers) if d.is_full_attention(i)]
    experts = [f"layers.{i}.{lineage.expert_mlps}.spmd_rank." for i in range(d.num_layers) if d.is_moe_layer(i)]
    local = d.num_experts // p.moe_ep if d.moe_layers else 0

    def fn() -> list[dict[str, torch.Tensor]]:
        out = []
        for r in range(p.world):
            rank = {n: torch.tensor([p.dense_rank(r)], dtype=torch.int32) for n in names}
            for e in experts:
                rank[f"{e}rank"] = torch.tensor([r], dtype=torch.int32)
                if p.moe_ep > 1:
                    first = p.group(r) * local
                    rank[f"{e}local_expert_indices"] = torch.arange(first, first + local, dtype=torch.int32)[None]
            out.append(rank)
        return out
    return ShardStep((), fn)


_LAYER = re.compile(r"(layers\.\d+\.)(.+)")


def _rule(name: str, lineage: Lineage, label: str) -> tuple[str, Placement]:
    """(NxD name, placement) of the converted tensor `name`."""
    m = _LAYER.fullmatch(name)
    prefix, rest = (m[1], m[2]) if m else ("", name)
    module, _, kind = rest.rpartition(".")
    rule = lineage.rules.get(module)
    if rule is not None and kind == "weight":
        return prefix + rule.target, rule.weight if rule.experts else over_dense_tp(rule.weight)
    if rule is not None and kind == "scale" and rule.scale is not None:
        return prefix + rule.scale_target, rule.scale if rule.experts else over_dense_tp(rule.scale)
    raise CheckpointError(label, f"has no {lineage.name} shard rule (the port has no such parameter, or keeps it "
                                 "in a module NxD does not quantize)", name)


def _single(name: str, target: str, place: Placement, d: Arch, p: RankLayout,
            dtype: torch.dtype) -> ShardStep:
    def fn(t: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        t = cast(target, t, dtype)  # before placing: one cast copy at most, shared by replicated ranks
        per_tensor_scale = target.endswith(".scale") and tuple(t.shape) == (1,)  # a per-tensor scale: replicated
        pieces = replicate(t, d, p) if per_tensor_scale else place(t, d, p)
        return ({target: x} for x in pieces)
    return ShardStep((name,), fn)


def _fused_qkv(layer: int, kind: str, d: Arch, p: RankLayout, dtype: torch.dtype) -> ShardStep:
    """GroupQueryAttention_QKV with fused_qkv: each rank's Wqkv is [Q_r | K_r | V_r] of the padded / replicated heads
    (gqa.py preshard_hook, then trace.py create_local_weight_qkv), over the dense_tp group like every attention
    layer (over_dense_tp)."""
    base = f"layers.{layer}.self_attn."
    names = tuple(f"{base}{x}_proj.{kind}" for x in "qkv")
    target = f"{base}qkv_proj.Wqkv.{kind}"
    group = RankLayout.split(p.dense_tp)

    def fn(q, k, v):
        q, k, v = (cast(target, x, dtype) for x in (q, k, v))
        parts = zip(q_heads(q, d, group), kv_heads(k, d, group), kv_heads(v, d, group))
        fused = [attention.fuse_qkv(*qkv) for qkv in parts]
        return [{target: fused[p.dense_rank(r)]} for r in range(p.world)]
    return ShardStep(names, fn)


def nxd_program(d: Arch, names, p: RankLayout, lineage: Lineage, fused_qkv: bool, dtype: torch.dtype,
                label: str) -> list[ShardStep]:
    steps = [_rank_tensors(d, p, lineage)]
    fused: set[str] = set()
    for i, kind, trio in (qkv_trios(d, names, label) if fused_qkv else []):
        if kind == "scale" and not lineage.fuses_qkv_scales:
            raise CheckpointError(label, f"is an FP8 scale, but the {lineage.name} port's converter fuses Wqkv "
                                         "without its scales", trio[0])
        steps.append(_fused_qkv(i, kind, d, p, dtype))
        fused.update(trio)
    for name in names:
        if name not in fused:
            steps.append(_single(name, *_rule(name, lineage, label), d, p, dtype))
    return steps


@dataclass(frozen=True)
class NxdLayout:
    """The files NxD writes for one port lineage (qbuild.model.convert.parallel.ShardLayout): NxD's names, splits and
    dtypes, every floating tensor cast to the model dtype."""

    lineage: Lineage

    @property
    def name(self) -> str:
        return self.lineage.name

    def program(self, d: Arch, names, ranks: RankLayout, fused_qkv: bool, dtype: str | None,
                label: str) -> list[ShardStep]:
        if dtype is None:
            raise ShardError(f"layout {self.name} needs dtype, the model dtype NxD casts every weight to")
        check_nxd_layout(d, ranks, self.lineage)
        return nxd_program(d, names, ranks, self.lineage, fused_qkv, torch_dtype(dtype), label)


MAIN, MAIN_REPLICATED, MOE = (NxdLayout(LINEAGES[name]) for name in (NXD_MAIN, NXD_MAIN_REPLICATED, NXD_MOE))
