"""Fake of the main-lineage port module contrib/models/Qwen3.5-35B-A3B/src/modeling_qwen35.py (NxDI main @ 4bcdc54;
the 2B, 27B and 3.6-27B ports share these parts), for the NxDI contract double.

It keeps what qbuild depends on (docs/nxdi.md section 15): the `src.` imports, Qwen35InferenceConfig's required
attributes and MoE detection, get_neuron_config_cls() returning NeuronConfig even for MoE, the app's
get_compiler_args(), the QWEN36_* switches read while tracing, and, in NeuronQwen35Model.rank_weights, the weights
the compiled model takes per rank under NxD's names (docs/nxdi.md section 4). Defaults the real config fills in for
missing fields (DeltaNet head counts, layer_types) are left out: a field qbuild forgot fails validation here instead
of silently taking the 35B's value.
"""

from __future__ import annotations

import json
import os

from neuronx_distributed_inference._nxd import (
    Weight,
    column,
    expert_dispatch,
    experts,
    parallel_embedding,
    replicated,
    replicated_deltanet,
    row,
    split,
    tp_rank,
    zeros,
)
from neuronx_distributed_inference.models.config import InferenceConfig, NeuronConfig
from neuronx_distributed_inference.models.model_base import NeuronBaseForCausalLM
from neuronx_distributed_inference.models.model_wrapper import CONTEXT_ENCODING_MODEL_TAG
from neuronx_distributed_inference.modules.attention.gqa import attention_weights

from src.hybrid_apc import init_hybrid_apc_scheduler_bridge

# The Qwen3.6-27B port (PR 173 @ 03db3ef) imports four functions of NxDI's modules/async_execution.py that only that
# PR's own NxDI tree has (L47-52); tests.nxdi_double.pr173_port() writes that copy, tests.nxdi_double.nxdi_tree() the
# tree.
IMPORTS_PR173_NXDI = False
if IMPORTS_PR173_NXDI:
    from neuronx_distributed_inference.modules.async_execution import (  # noqa: F401
        cancel_hybrid_apc_request,
        finish_hybrid_apc_request,
        prepare_hybrid_apc_model_inputs,
        prepare_hybrid_apc_request_for_execution,
    )

# The Qwen3.5-27B port (PR 128 @ 550e2ab) is this module with NeuronGatedDeltaNet's nn.Conv1d / nn.Linear /
# nn.Parameter whole on every rank (L258-281) and a dense MLP in every layer (L1427);
# tests.nxdi_double.replicated_deltanet_port() writes that copy.
TENSOR_PARALLEL_DELTANET = True
# Nor has that port use_text_only_cte_inputs: every context encoding is traced with vision inputs (input_generator
# L2040-2085 @ 550e2ab) and a text-only prompt gets the dummy at its last token (_get_model_outputs L2317-2328).
TEXT_ONLY_CTE_SWITCH = True


def _text_only_cte(config) -> bool:
    """Whether the context encoding was traced without vision inputs (empty tensors in their place)."""
    return TEXT_ONLY_CTE_SWITCH and config.use_text_only_cte_inputs


class Qwen35InferenceConfig(InferenceConfig):
    def __init__(self, neuron_config=None, fused_spec_config=None, load_config=None, metadata=None, **kwargs):
        # l.2165ff: MoE detection and the MoE fields, set before InferenceConfig assigns the kwargs.
        is_moe = str(kwargs.get("model_type", "")) == "qwen3_5_moe_text" or \
            ("num_experts" in kwargs and "moe_intermediate_size" in kwargs)
        kwargs["_is_moe"] = is_moe
        if is_moe:
            kwargs.setdefault("num_local_experts", kwargs.get("num_experts"))
            kwargs.setdefault("n_shared_experts", 1)
            kwargs.setdefault("intermediate_size", kwargs.get("moe_intermediate_size"))
        if TEXT_ONLY_CTE_SWITCH:
            kwargs.setdefault("use_text_only_cte_inputs", True)   # l.2324
        _hybrid_defaults(kwargs)
        super().__init__(neuron_config, fused_spec_config=fused_spec_config, load_config=load_config,
                         metadata=metadata, **kwargs)
        _check_hybrid(self)

    def get_required_attributes(self) -> list[str]:   # l.2423
        return ["head_dim", "hidden_act", "hidden_size", "intermediate_size", "max_position_embeddings",
                "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "rms_norm_eps", "rope_theta",
                "vocab_size",
                # DeltaNet-specific
                "linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel_dim", "layer_types"]

    @classmethod
    def get_neuron_config_cls(cls):
        # l.2446: "callers construct NeuronConfig explicitly, so we return the correct default for the common (dense)
        # case here" -- so a saved MoE config reads back as a plain NeuronConfig (its MoE keys are dropped).
        return NeuronConfig

    @classmethod
    def from_pretrained(cls, model_path: str, **kwargs) -> "Qwen35InferenceConfig":
        """l.2169: the HF config.json with text_config flattened (no pad_token_id, no mrope_section)."""
        neuron_config = kwargs.pop("neuron_config", None)
        if neuron_config is None:
            neuron_config = NeuronConfig(tp_degree=1, batch_size=1, seq_len=128, save_sharded_checkpoint=True)
        with open(os.path.join(model_path, "config.json")) as handle:
            config_dict = json.load(handle)
        text_config = config_dict.get("text_config", config_dict)
        rope_parameters = text_config.get("rope_parameters") or {}
        inference_config = dict(text_config)
        inference_config.setdefault("_name_or_path", model_path)
        inference_config.setdefault("model_type", text_config.get("model_type", "qwen3_5_text"))
        inference_config.setdefault("architectures", config_dict.get("architectures", []))
        inference_config.setdefault("tie_word_embeddings", config_dict.get("tie_word_embeddings", False))
        if "moe_intermediate_size" in text_config and "intermediate_size" not in inference_config:
            inference_config["intermediate_size"] = text_config["moe_intermediate_size"]
        for key in ("rope_theta", "partial_rotary_factor"):
            if key not in inference_config and key in rope_parameters:
                inference_config[key] = rope_parameters[key]
        inference_config.update(kwargs)
        return cls(neuron_config=neuron_config, **inference_config)


# --- the hybrid cache managers (PR 173 @ 03db3ef; docs/long-context.md section 5) ------------------------------------

def _hybrid_defaults(kwargs: dict) -> None:
    """Qwen35InferenceConfig's defaults of the hybrid cache fields (modeling_qwen35.py L2168-2216 @ 03db3ef)."""
    apc = bool(kwargs.setdefault("use_hybrid_apc_manager", False))
    for key in ("use_hybrid_cache_manager", "use_qwen_hybrid_chunked_prefill", "use_qwen_hybrid_chunked_prefill_nki"):
        kwargs.setdefault(key, False)
    kwargs.setdefault("gdn_checkpoint_interval", 256)
    kwargs.setdefault("max_gdn_checkpoint_slots", 8)
    kwargs.setdefault("hybrid_apc_require_vllm_metadata", apc)
    kwargs.setdefault("hybrid_apc_allow_local_hash_fallback", not apc)
    kwargs.setdefault("hybrid_apc_require_attention_block_refs", apc)
    kwargs.setdefault("hybrid_recurrent_cache_dtype", kwargs.get("gdn_recurrent_cache_dtype", "float32"))
    kwargs.setdefault("hybrid_conv_cache_dtype", kwargs.get("gdn_conv_cache_dtype", "bfloat16"))
    kwargs.setdefault("gdn_recurrent_cache_dtype", kwargs["hybrid_recurrent_cache_dtype"])
    kwargs.setdefault("gdn_conv_cache_dtype", kwargs["hybrid_conv_cache_dtype"])
    kwargs.setdefault("hybrid_cache_mode", "all")


def _cache_dtype(name: str, value) -> str:
    """_normalize_hybrid_cache_dtype (L543-564): float32 or bfloat16 (and their aliases) only."""
    aliases = {"fp32": "float32", "float32": "float32", "torch.float32": "float32", "bf16": "bfloat16",
               "bfloat16": "bfloat16", "torch.bfloat16": "bfloat16"}
    if str(value).lower() not in aliases:
        raise ValueError(f"{name} must be one of fp32/float32 or bf16/bfloat16, got {value}")
    return aliases[str(value).lower()]


def _check_hybrid(config) -> None:
    """The checks after construction (L2224-2296): positive interval and slots, the cache dtypes, the two managers
    exclusive, and the hybrid APC manager's v0 requirements."""
    if int(config.gdn_checkpoint_interval) <= 0:
        raise ValueError(f"gdn_checkpoint_interval must be positive, got {config.gdn_checkpoint_interval}")
    if int(config.max_gdn_checkpoint_slots) <= 0:
        raise ValueError(f"max_gdn_checkpoint_slots must be positive, got {config.max_gdn_checkpoint_slots}")
    config.hybrid_recurrent_cache_dtype = _cache_dtype("hybrid_recurrent_cache_dtype",
                                                       config.hybrid_recurrent_cache_dtype)
    config.hybrid_conv_cache_dtype = _cache_dtype("hybrid_conv_cache_dtype", config.hybrid_conv_cache_dtype)
    if config.use_hybrid_cache_manager and config.use_hybrid_apc_manager:
        raise ValueError("use_hybrid_cache_manager and use_hybrid_apc_manager are mutually exclusive")
    if not config.use_hybrid_apc_manager:
        return
    if config.hybrid_cache_mode != "all":
        raise ValueError("use_hybrid_apc_manager requires hybrid_cache_mode='all'")
    if config.hybrid_recurrent_cache_dtype != "float32":
        raise ValueError("use_hybrid_apc_manager requires float32 recurrent GDN checkpoint cache state")
    block = getattr(config.neuron_config, "pa_block_size", None)
    if block is not None and int(config.gdn_checkpoint_interval) != int(block):
        raise ValueError("use_hybrid_apc_manager v0 requires gdn_checkpoint_interval == pa_block_size")


def _checkpoint_banks(config, tp: int) -> dict[str, Weight]:
    """HybridGDNCheckpointCache (L4075-4140): per DeltaNet layer, by its ordinal among them, a recurrent bank
    (slots, Hv/tp, dk, dv) and a conv bank (slots, conv_dim/tp, K - 1) in their cache dtypes, zeros."""
    gdn = [i for i, kind in enumerate(config.layer_types) if kind == "linear_attention"]
    if not gdn:
        raise ValueError("HybridGDNCheckpointCache requires GDN layers")
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    if hv % tp or hk % tp:
        raise ValueError("linear_num_value_heads and linear_num_key_heads must be divisible by tp_degree")
    slots, dk, dv = int(config.max_gdn_checkpoint_slots), config.linear_key_head_dim, config.linear_value_head_dim
    conv_dim = 2 * (hk // tp) * dk + (hv // tp) * dv
    out = {}
    for idx in range(len(gdn)):
        out[f"hybrid_gdn_checkpoint_cache.recurrent_slots.{idx}"] = zeros((slots, hv // tp, dk, dv),
                                                                          config.hybrid_recurrent_cache_dtype)
        out[f"hybrid_gdn_checkpoint_cache.conv_slots.{idx}"] = zeros(
            (slots, conv_dim, config.linear_conv_kernel_dim - 1), config.hybrid_conv_cache_dtype)
    return out


def _dtype(config) -> str:
    return str(config.neuron_config.torch_dtype).split(".")[1]


def _stage_inputs(config) -> int:
    """The tensors one context-encoding or token-generation call of the Qwen3.6-27B port takes: 24, or 29 with the
    hybrid APC manager's five restore / commit vectors (PR 173 modeling_qwen35.py _qwen36_expected_arg_count
    L4546-4547 with _use_expanded_hybrid_args_for_tag L4491-4503 @ 03db3ef). The traced graphs take what
    input_generator built from the config at compile (L6811); a call builds its arguments from the config as it is
    at that call (_build_qwen36_stage_args L4636-4647, the padding L7115-7150), which vLLM's runtime config may have
    changed. QWEN36_TKG_LEGACY_ARGS=1 keeps 24 either way (L4479-4480); the double refuses that switch."""
    if os.environ.get("QWEN36_TKG_LEGACY_ARGS") == "1":
        raise NotImplementedError("QWEN36_TKG_LEGACY_ARGS=1: the legacy argument contract is not in the double")
    return 29 if getattr(config, "use_hybrid_apc_manager", False) else 24


class NeuronQwen35Model:
    """The traced model (NeuronQwen35Model in the port), reduced to what the double needs from it."""

    # The shard layout its module implies (docs/nxdi.md section 1), for the double's value check at load.
    LINEAGE = "main" if TENSOR_PARALLEL_DELTANET else "main-replicated"

    @staticmethod
    def rank_weights(config) -> dict[str, Weight]:
        """{shard key: per-rank Weight} of the compiled model: the module's state dict after the port's
        convert_hf_to_neuron_state_dict and NxD's preshard hooks (docs/nxdi.md section 4, main lineage)."""
        nc = config.neuron_config
        if nc.quantized and (config._is_moe or nc.quantization_type != "per_channel_symmetric"
                             or nc.quantization_dtype != "f8e4m3"):
            raise NotImplementedError("the contract double models the FP8 port's per-channel f8e4m3 dense MLPs only")
        tp, dt, h = nc.tp_degree, _dtype(config), config.hidden_size
        out = {"embed_tokens.weight": parallel_embedding(config.vocab_size, h, tp, dt),
               "lm_head.weight": column(config.vocab_size, h, tp, dt),
               "norm.weight": replicated((h,), dt),
               "rank_util.rank": tp_rank()}
        if config._is_moe and not TENSOR_PARALLEL_DELTANET:
            raise NotImplementedError("the Qwen3.5-27B port builds a dense MLP in every layer")
        mixed = getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1
        if config._is_moe and mixed:
            raise NotImplementedError("dense layers inside an MoE model are not in the facts the double is built from")
        _never_quantized(config, out)
        for i, kind in enumerate(config.layer_types):
            p = f"layers.{i}"
            out[f"{p}.input_layernorm.weight"] = replicated((h,), dt)
            out[f"{p}.post_attention_layernorm.weight"] = replicated((h,), dt)
            if kind == "full_attention":
                out.update(_never_quantized(config, _attention(f"{p}.self_attn", config, tp, dt)))
            elif kind == "linear_attention" and TENSOR_PARALLEL_DELTANET:
                out.update(_never_quantized(config, _deltanet(f"{p}.linear_attn", config, tp, dt)))
            elif kind == "linear_attention":
                out.update(replicated_deltanet(f"{p}.linear_attn", config, dt))
            else:
                raise ValueError(f"layer_types[{i}]: {kind!r}")
            out.update(_moe(f"{p}.mlp", config, tp, dt) if config._is_moe else _mlp(f"{p}.mlp", config, tp, dt))
        if config.use_hybrid_apc_manager:
            # PR 173 modeling_qwen35.py L5618-5626: only then does the model hold hybrid_gdn_checkpoint_cache weights.
            out.update(_checkpoint_banks(config, tp))
        return out

    @staticmethod
    def stage_inputs(config) -> int:
        return _stage_inputs(config)

    @staticmethod
    def trace(config, tag: str, bucket: int, tokens: int, seq_len: int) -> dict:
        """What tracing one bucket reads besides the config: the DeltaNet prefill switch (l.1126) and NxD's expert
        dispatch. Returned into the bucket's "HLO", so a changed switch changes the compile-cache key."""
        cte_impl = os.environ.get("QWEN36_DELTANET_CTE_IMPL", "current").lower()
        if cte_impl not in ("legacy", "legacy_direct", "direct", "current", "optimized"):
            raise ValueError(f"QWEN36_DELTANET_CTE_IMPL={cte_impl!r}")
        chunk = int(os.environ.get("QWEN36_DELTANET_CHUNK_SIZE", "128"))
        if chunk not in (64, 128) or (cte_impl in ("legacy", "legacy_direct", "direct") and chunk != 128):
            raise ValueError(f"QWEN36_DELTANET_CHUNK_SIZE={chunk} with QWEN36_DELTANET_CTE_IMPL={cte_impl}")
        cte = tag == CONTEXT_ENCODING_MODEL_TAG
        multihead = os.environ.get("QWEN36_DELTANET_MULTIHEAD_CTE", "1") != "0"   # l.1223
        vision = cte and not _text_only_cte(config)
        # The double is stricter than the port here: the port traces the fused multi-head DeltaNet prefill for image
        # features too, and the bundle then answers images with degenerate text (2B README "Vision": "numerically
        # unstable on real vision embeddings"; run_vl_smoke.py:37-42 sets both switches for that). The double cannot
        # compute, so it refuses the trace.
        # (The Qwen3.5-27B port has neither these switches nor the fused prefill: its vision inputs need none.)
        if vision and TEXT_ONLY_CTE_SWITCH and (cte_impl not in ("legacy", "legacy_direct", "direct") or multihead):
            multihead_env = os.environ.get("QWEN36_DELTANET_MULTIHEAD_CTE")
            raise ValueError(f"context encoding traced with vision inputs and QWEN36_DELTANET_CTE_IMPL={cte_impl}, "
                             f"QWEN36_DELTANET_MULTIHEAD_CTE={multihead_env}: the fused DeltaNet prefill degenerates "
                             "on vision embeddings (the VL scripts set legacy_direct, 0)")
        # l.7055: context encoding takes vision_embeddings / vision_mask of the bucket's length only when
        # use_text_only_cte_inputs is False; else empty ones, and get_model_output never scatters image features.
        traced = {"deltanet_cte_impl": cte_impl if cte else None, "deltanet_multihead_cte": multihead if cte else None,
                  "vision_inputs": vision, "inputs": _stage_inputs(config),
                  "env": {name: os.environ.get(name) for name in ("QWEN36_DELTANET_CTE_IMPL",
                                                                  "QWEN36_DELTANET_MULTIHEAD_CTE",
                                                                  "QWEN36_DELTANET_CHUNK_SIZE")}}
        if config._is_moe:
            traced["experts"] = expert_dispatch(config.neuron_config, tokens, config.num_experts_per_tok,
                                                config.num_experts, seq_len)
        return traced


def _attention(prefix: str, config, tp: int, dt: str) -> dict:
    """Gated GQA: q/k/v/o as NxDI's GQA shards them, the output gate as a plain ColumnParallelLinear (dim 0,
    unpadded), the q/k norms renamed to q_layernorm / k_layernorm, and the layer's own rank tensor."""
    heads, d, h = config.num_attention_heads, config.head_dim, config.hidden_size
    out = attention_weights(prefix, tp, heads, config.num_key_value_heads, d, h, dt, config.neuron_config.fused_qkv)
    out[f"{prefix}.output_gate_proj.weight"] = column(heads * d, h, tp, dt)
    out[f"{prefix}.q_layernorm.weight"] = replicated((d,), dt)
    out[f"{prefix}.k_layernorm.weight"] = replicated((d,), dt)
    out[f"{prefix}.rank_util.rank"] = tp_rank()
    return out


def _deltanet(prefix: str, config, tp: int, dt: str) -> dict:
    """Tensor-parallel DeltaNet: in_proj_qkv (conv_dim/tp, H) and conv1d_weight (conv_dim/tp, K) per rank,
    in_proj_z (Vd/tp, H), in_proj_a/b (Hv/tp, H), A_log / dt_bias (Hv/tp, 1), out_proj on dim 1, norm (head_v_dim,)."""
    h, hk, hv = config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv, k = config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim
    split(hk, tp, "DeltaNet key heads")
    hv_rank = split(hv, tp, "DeltaNet value heads")
    conv_dim = 2 * hk * dk + hv * dv
    return {f"{prefix}.in_proj_qkv.weight": column(conv_dim, h, tp, dt),
            f"{prefix}.in_proj_z.weight": column(hv * dv, h, tp, dt),
            f"{prefix}.in_proj_a.weight": column(hv, h, tp, dt),
            f"{prefix}.in_proj_b.weight": column(hv, h, tp, dt),
            f"{prefix}.conv1d_weight.weight": Weight((conv_dim // tp, k), dt),
            f"{prefix}.A_log_weight.weight": Weight((hv_rank, 1), dt),
            f"{prefix}.dt_bias_weight.weight": Weight((hv_rank, 1), dt),
            f"{prefix}.out_proj.weight": row(h, hv * dv, tp, dt),
            f"{prefix}.norm.weight": replicated((dv,), dt)}


def _quantized(config, module: str) -> bool:
    """NxD converts a parallel layer to its quantized twin unless one of modules_to_not_convert is a substring of its
    path (NxD quantization/quantize.py:122-123 @ fbac349)."""
    nc = config.neuron_config
    return nc.quantized and not any(skip in module for skip in (nc.modules_to_not_convert or []))


def _never_quantized(config, weights: dict) -> dict:
    """`weights`, which hold no MLP: every parallel layer among them must stay unquantized (the double models FP8 in
    the dense MLPs only). Norms and rank tensors are no parallel layers, so NxD never converts them."""
    for key in weights:
        module, _, kind = key.rpartition(".")
        if kind == "weight" and "norm" not in module.rpartition(".")[2] and _quantized(config, module):
            raise NotImplementedError(f"{module}: the contract double models FP8 in the dense MLPs only")
    return weights


def _mlp(prefix: str, config, tp: int, dt: str) -> dict:
    """Qwen35MLP. Quantized (per_channel_symmetric f8e4m3): each weight in float8_e4m3fn with a float32 per-channel
    `.scale` of (out, 1), split with the weight on a column-parallel layer and whole on a row-parallel one
    (quantization_layers.py _setup_for_scale: partitioned only when per_channel_axis is the partition dim)."""
    h, i = config.hidden_size, config.intermediate_size
    layers = {"gate_proj": column(i, h, tp, dt), "up_proj": column(i, h, tp, dt), "down_proj": row(h, i, tp, dt)}
    out = {}
    for name, weight in layers.items():
        module = f"{prefix}.{name}"
        if not _quantized(config, module):
            out[f"{module}.weight"] = weight
            continue
        out[f"{module}.weight"] = Weight(weight.shape, "float8_e4m3fn")
        out[f"{module}.scale"] = Weight((weight.shape[0], 1), "float32")
    return out


def _moe(prefix: str, config, tp: int, dt: str) -> dict:
    """Router replicated; experts under `mlp.moe.expert_mlps`; the shared expert split across the FULL tp group;
    shared_expert_gate (1, H) replicated (section 4, main lineage)."""
    h, e, shared = config.hidden_size, config.num_experts, config.shared_expert_intermediate_size
    out = {f"{prefix}.moe.router.linear_router.weight": replicated((e, h), dt)}
    out.update(experts(f"{prefix}.moe.expert_mlps", config.neuron_config, e, h, config.moe_intermediate_size, dt))
    out[f"{prefix}.shared_gate_proj.weight"] = column(shared, h, tp, dt)
    out[f"{prefix}.shared_up_proj.weight"] = column(shared, h, tp, dt)
    out[f"{prefix}.shared_down_proj.weight"] = row(h, shared, tp, dt)
    out[f"{prefix}.shared_expert_gate.weight"] = replicated((1, h), dt)
    return out


class NeuronQwen35ForCausalLM(NeuronBaseForCausalLM):   # l.7491
    _model_cls = NeuronQwen35Model

    def __init__(self, model_path, config=None, neuron_config=None):
        super().__init__(model_path, config=config, neuron_config=neuron_config)
        init_hybrid_apc_scheduler_bridge(self)

    @classmethod
    def get_config_cls(cls):
        return Qwen35InferenceConfig

    def init_kv_manager(self) -> str:
        """init_inference_optimization (L5618-5636 @ 03db3ef): the hybrid APC manager keeps the attention layers' KV in
        blocks (QwenHybridBlockKVCacheManager, a BlockKVCacheManager: L3925-3960); the static hybrid manager refuses
        a block layout, continuous batching and more (HybridDeltaNetCacheManager._validate_hybrid_config,
        L3690-3715); otherwise NxDI's."""
        config, nc = self.config, self.neuron_config
        if config.use_hybrid_apc_manager:
            base = super().init_kv_manager()
            return "QwenHybridBlockKVCacheManager" if nc.is_block_kv_layout else base
        if config.use_hybrid_cache_manager:
            unsupported = [what for flag, what in ((nc.is_block_kv_layout, "block KV layout"),
                                                   (nc.is_continuous_batching, "continuous batching")) if flag]
            if unsupported:
                raise ValueError("HybridDeltaNetCacheManager v1 does not support: " + ", ".join(unsupported))
            return "HybridDeltaNetCacheManager"
        return super().init_kv_manager()

    def context_inputs(self, input_ids, position_ids, llava_args, bucket) -> tuple[int, int]:
        """The image features of a context-encoding step, as the port hands them to its graph (2B modeling_qwen35.py
        @ 4bcdc54): _get_model_outputs takes llava_args of two or more tensors as [vision_embeddings, vision_mask,
        mrope_position_ids], building the sequential mRoPE positions of a prefill where the third is missing
        (L7653-7659, L7682-7690); without llava_args, where the graph was traced for image features, it builds zero
        embeddings and a mask whose every slot is seq_len - 1 of the UNPADDED prompt, its last real token (L7650,
        L7666-7675). Qwen35ModelWrapper.pad_inputs fits the embeddings and the mask to the bucket the prompt takes:
        the given slots kept, the padding slots after them at bucket - 1 (L7059-7101, L7173-7186), the mRoPE
        positions likewise (L7105-7150), and clamps the mask to the bucket (L7210-7213); the graph scatters each
        embedding row at the position its mask slot names (encode_vision_to_input, L5667-5690, index_put_ at L5688).
        A zero row written at a real prompt token replaces that token's embedding: recorded as `overwritten`, and
        that token then adds nothing to the step's sum. The port's own comment on its text-only dummy (L7192-7196,
        "always a padded/eos slot") describes the branch of pad_inputs that builds one, which does not run where
        _get_model_outputs already built a 3-D mask.
        The double is stricter: the tensors must be the shapes and dtypes the port builds, the mask's first slots
        positions of one token (rows that are not zeros) and the rest the padding slot, and a context encoding traced
        without image features takes none (use_text_only_cte_inputs: its graph's inputs are empty tensors there).
        Returns (what the scattered rows add to the step's sum, the first decode's position: the largest mRoPE
        position + 1)."""
        import torch

        from neuronx_distributed_inference._double import record

        n, ids = input_ids.shape[1], input_ids[0].tolist()
        if not llava_args and _text_only_cte(self.config):
            record("context_inputs", bucket=bucket, image_tokens=0, overwritten=[])
            return 0, int(position_ids.max()) + 1
        if not llava_args:
            # L7666-7675, then pad_inputs (L7173-7186, L7210-7213): n slots at n - 1, the rest at bucket - 1.
            overwritten = sorted({n - 1} | ({bucket - 1} if bucket - 1 < n else set()))
            record("context_inputs", bucket=bucket, image_tokens=0, overwritten=overwritten, dummy=True)
            return -sum(ids[p] for p in overwritten), int(position_ids.max()) + 1
        if _text_only_cte(self.config):
            raise RuntimeError("image features for a context encoding traced without them "
                               "(use_text_only_cte_inputs=True): its graph takes empty vision inputs")
        if len(llava_args) not in (2, 3):
            raise ValueError(f"llava_args: {len(llava_args)} tensors; the port takes [vision_embeddings, vision_mask] "
                             "or [vision_embeddings, vision_mask, mrope_position_ids]")
        emb, mask = llava_args[:2]
        length, hidden, dtype = emb.shape[1], self.config.hidden_size, self.neuron_config.torch_dtype
        if len(llava_args) == 3:
            mrope = llava_args[2]
        else:
            mrope = torch.arange(n, dtype=torch.int32).expand(3, 1, n)
        expected = {"vision_embeddings": (emb, (1, length, hidden), dtype),
                    "vision_mask": (mask, (1, length, 1), torch.int32)}
        if len(llava_args) == 3:
            expected["mrope_position_ids"] = (mrope, (3, 1, length), torch.int32)
        for name, (tensor, shape, want) in expected.items():
            if tuple(tensor.shape) != shape or tensor.dtype != want or length < n:
                raise ValueError(f"llava_args {name}: {list(tensor.shape)} {tensor.dtype}; the port passes {list(shape)} "
                                 f"{want} padded past the prompt's {n} tokens")
        fitted = {"vision_embeddings": _fit(emb, bucket, 0, 1),
                  "vision_mask": _fit(mask, bucket, bucket - 1, 1).clamp(max=bucket - 1),
                  # The VL generate pads its positions with zeros (modeling_qwen35_vl.py L495-505); the ones the
                  # port builds itself are padded with their last position (L7115-7124).
                  "mrope_position_ids": _fit(mrope, bucket, 0 if len(llava_args) == 3 else n - 1, 2)}
        slots = fitted["vision_mask"][0, :, 0].tolist()
        rows = fitted["vision_embeddings"][0]
        # The text model knows no image token id: the image's slots are the leading run of increasing prompt
        # positions that hold one token, written with rows that are not the padding's zeros; every slot after them
        # is padding, at bucket - 1.
        images = 0
        while images < len(slots) and slots[images] < n and ids[slots[images]] == ids[slots[0]] and \
                (images == 0 or slots[images] > slots[images - 1]) and bool(rows[images].any()):
            images += 1
        if any(p != bucket - 1 for p in slots[images:]):
            raise ValueError(f"vision_mask: after {images} image positions its slots are not all the padding slot "
                             f"{bucket - 1}")
        features = rows[:images].float()
        # The padding slots point at bucket - 1; a prompt that fills its bucket has its last token there, whose
        # embedding the padding rows' zeros then overwrite (the port does it).
        overwritten = sorted({p for p in slots[images:] if p < n})
        record("context_inputs", bucket=bucket, image_tokens=images, overwritten=overwritten,
               inputs={k: {"shape": list(v.shape), "dtype": str(v.dtype).split(".")[1]} for k, v in fitted.items()})
        return (int(round(float(features.abs().sum()) * 1000)) - sum(ids[p] for p in overwritten),
                int(mrope[:, 0, :n].max()) + 1)

    def enable_token_generation(self):   # l.7644
        disable_wlo = bool(getattr(self.config, "disable_token_generation_wlo", False)) or \
            os.environ.get("QWEN36_DISABLE_TOKEN_GENERATION_WLO") == "1"
        super().enable_token_generation(enable_wlt_optimization=not disable_wlo)

    def get_compiler_args(self):   # 35B l.8366 (the 2B and PR 173 copies are identical)
        if self.compile_tag == CONTEXT_ENCODING_MODEL_TAG:
            optimization_level = "-O1"
        else:
            optimization_level = "-O1"
        compiler_args = (
            "--enable-saturate-infinity "
            "--enable-mixed-precision-accumulation "
            f"--model-type transformer {optimization_level} "
            "--auto-cast=none "
        )
        return compiler_args


def _fit(tensor, length: int, fill, dim: int):
    """`tensor` cut or padded with `fill` to `length` on `dim` (pad_inputs' _fit_seq, L7077-7091)."""
    import torch

    size = tensor.shape[dim]
    if size >= length:
        return tensor.narrow(dim, 0, length).contiguous()
    shape = list(tensor.shape)
    shape[dim] = length - size
    return torch.cat([tensor, torch.full(shape, fill, dtype=tensor.dtype)], dim=dim)
