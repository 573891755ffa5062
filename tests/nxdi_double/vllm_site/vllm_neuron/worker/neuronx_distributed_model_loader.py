"""vllm_neuron/worker/neuronx_distributed_model_loader.py @ 3afb0a9 (and the model runner's check after it), the path a
decoder-only model takes: read the HF config, find the NxDI class, build the default NeuronConfig, then load the
compiled directory, or compile into it where that load raises FileNotFoundError or ValueError."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

NEURON_MULTI_MODAL_MODELS = ["MllamaForConditionalGeneration", "LlavaForConditionalGeneration",
                             "Llama4ForConditionalGeneration", "Qwen2VLForConditionalGeneration",
                             "Qwen3VLForConditionalGeneration"]     # worker/constants.py L4-10


def _get_model_configs(config) -> tuple[str, int, int]:
    """L895-917: the architecture, and num_key_value_heads / head_dim from the top level (text_config only for the
    multimodal list)."""
    archs = getattr(config, "architectures", [])
    if not archs:
        raise ValueError("No architectures specified in the pretrained config.")
    architecture = archs[0]
    if architecture in NEURON_MULTI_MODAL_MODELS:
        config = getattr(config, "text_config", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    head_dim = getattr(config, "head_dim", None)
    if not head_dim and getattr(config, "num_attention_heads", None) and getattr(config, "hidden_size", None):
        head_dim = config.hidden_size // config.num_attention_heads
    if not kv_heads:
        raise ValueError("Missing required num_key_value_heads in the pretrained config.")
    if not head_dim:
        raise ValueError("Missing required head dimension in the pretrained config.")
    return architecture, int(kv_heads), int(head_dim)


def _get_neuron_model_cls(architecture: str):
    """L920-982: MODEL_TYPES[model][task], the part before "For" lower-cased and the rest in kebab case,
    ConditionalGeneration read as CausalLM (the renames of L961-974 concern none of the Qwen3.5 / Next names)."""
    from neuronx_distributed_inference.utils.constants import MODEL_TYPES

    if architecture.startswith("Neuron") and "For" in architecture:
        architecture = architecture[6:]
    try:
        model, task = architecture.split("For", 1)
        task = "CausalLM" if task == "ConditionalGeneration" else task
        task = re.sub("([a-z0-9])([A-Z])", r"\1-\2", re.sub("(.)([A-Z][a-z]+)", r"\1-\2", task)).lower()
        return MODEL_TYPES[model.lower()][task]
    except (KeyError, ValueError):
        raise ValueError(f"Model {architecture} is not supported on Neuron for now. "
                         f"Supported models: {list(MODEL_TYPES.keys())}") from None


def _default_neuron_config(config) -> dict:
    """_get_default_neuron_config L1063-1123: with chunked prefill one CTE row of max_num_batched_tokens, else a batch
    of max_num_seqs over max_model_len; ceil(max_model_len // block_size) * max_num_seqs blocks unless
    --num-gpu-blocks-override (already one more: the platform's null block); a block layout for chunked prefill or
    prefix caching."""
    from neuronx_distributed_inference.models.config import OnDeviceSamplingConfig

    chunked = config.enable_chunked_prefill
    batch = 1 if chunked else config.max_num_seqs
    blocks = (config.max_model_len // config.block_size) * config.max_num_seqs
    if config.num_gpu_blocks_override is not None:
        blocks = config.num_gpu_blocks_override
    return {
        "tp_degree": config.tensor_parallel_size, "ctx_batch_size": 1, "batch_size": batch,
        "max_context_length": config.max_num_batched_tokens if chunked else config.max_model_len,
        "seq_len": config.max_model_len, "enable_bucketing": True, "is_continuous_batching": batch > 1,
        "quantized": False,
        "torch_dtype": {"auto": "float32", "half": "float16", "float": "float32"}.get(config.dtype, config.dtype),
        "padding_side": "right", "on_device_sampling_config": OnDeviceSamplingConfig(dynamic=True, deterministic=False),
        "lora_config": None, "pa_num_blocks": blocks, "pa_block_size": config.block_size,
        "is_block_kv_layout": chunked or config.enable_prefix_caching,
        "is_prefix_caching": config.enable_prefix_caching,
    }


def _override(config) -> dict:
    """additional_config.override_neuron_config (L1018-1029), its max_context_length held to max_prompt_length
    (_validate_override_neuron_config L1248-1284: a different one is a ValueError, an absent one is set)."""
    override = dict(config.additional_config.get("override_neuron_config") or {})
    if config.max_prompt_length is not None:
        given = override.pop("max_context_length", None)
        if given is not None and given != config.max_prompt_length:
            raise ValueError(f"Conflicting max_prompt_length settings: override_neuron_config specifies "
                             f"max_context_length {given} but the max_prompt_length is {config.max_prompt_length}.")
        override["max_context_length"] = config.max_prompt_length
    return override


def _handle_pa_num_blocks(config, neuron_config: dict, override: dict) -> dict:
    """L1126-1171: a pa_num_blocks in the override must be the --num-gpu-blocks-override the user gave (the count
    before the platform's +1), and then becomes the counted one; without that flag it may not be set at all."""
    if "pa_num_blocks" not in override:
        return neuron_config
    if config.num_gpu_blocks_override is None:
        raise ValueError(f"When setting pa_num_blocks ({override['pa_num_blocks']}) in override_neuron_config, you "
                         "must also set --num-gpu-blocks-override to the same value")
    intent = config.num_gpu_blocks_override - 1
    if override["pa_num_blocks"] != intent:
        raise ValueError(f"pa_num_blocks ({override['pa_num_blocks']}) must match your --num-gpu-blocks-override "
                         f"intent({intent}) to ensure vLLM and NxDI have consistent block counts.")
    return {**neuron_config, "pa_num_blocks": config.num_gpu_blocks_override}


def validated_neuron_config(config) -> dict:
    """get_neuron_model L1009-1045: the default NeuronConfig, the override over it (its chunked_prefill_config as
    NxDI's ChunkedPrefillConfig, L1217-1221), the blocks reconciled, then _validate_neuron_config (L1174-1214): prefix
    caching and chunked prefill each need the block layout (and chunked prefill a chunked_prefill_config), and the
    blocks must hold max_model_len for every sequence."""
    from neuronx_distributed_inference.models.config import ChunkedPrefillConfig

    override = _override(config)
    neuron_config = {**_default_neuron_config(config), **override}
    if isinstance(neuron_config.get("chunked_prefill_config"), dict):
        neuron_config["chunked_prefill_config"] = ChunkedPrefillConfig(**neuron_config["chunked_prefill_config"])
    if neuron_config.get("is_block_kv_layout"):
        neuron_config = _handle_pa_num_blocks(config, neuron_config, override)
    if config.enable_prefix_caching:
        assert neuron_config.get("is_prefix_caching", False) and neuron_config.get("is_block_kv_layout", False)
    if config.enable_chunked_prefill:
        assert neuron_config.get("chunked_prefill_config") and neuron_config.get("is_block_kv_layout", False)
    if neuron_config.get("is_block_kv_layout"):
        needed = -(-config.max_model_len // config.block_size) * config.max_num_seqs
        have = config.num_gpu_blocks_override - 1 if config.num_gpu_blocks_override is not None \
            else neuron_config["pa_num_blocks"]
        assert have >= needed, (f"At least {needed} blocks are required for max_model_len {config.max_model_len}, but "
                                f"only {have} blocks are available (user-intended blocks, excluding the +1 for null "
                                "block)")
    return neuron_config


def _compiled_model_path(model: str, hashed_config: str) -> str:
    """L221-240: NEURON_COMPILED_ARTIFACTS, else <model>/neuron-compiled-artifacts/<md5 of the config>."""
    if os.getenv("NEURON_COMPILED_ARTIFACTS"):
        return os.getenv("NEURON_COMPILED_ARTIFACTS")
    path = Path(model) / "neuron-compiled-artifacts" / hashed_config
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def get_neuron_model(config):
    """get_neuron_model L985-1059 with NeuronCausalLM.load_weights L560-572 and _load_weights_common L179-219: the
    NeuronConfig and the port's config are built first (they must construct even for a precompiled directory), the
    compiled path is hashed from that config, and a load that raises FileNotFoundError or ValueError is followed by
    a compile into that same path (_compile_and_load_model L263-271)."""
    from neuronx_distributed_inference.utils.hf_adapter import load_pretrained_config

    architecture, _, _ = _get_model_configs(config.hf_config)
    cls = _get_neuron_model_cls(architecture)
    neuron_config = cls.get_neuron_config_cls()(**validated_neuron_config(config))
    nxdi_config = cls.get_config_cls()(neuron_config, load_config=load_pretrained_config(config.model))
    hashed = hashlib.md5(nxdi_config.to_json_string().encode() if hasattr(nxdi_config, "to_json_string")
                         else repr(sorted(vars(nxdi_config))).encode()).hexdigest()
    path = _compiled_model_path(config.model, hashed)
    try:
        model = cls(path)
        model.load(path)
        check_cache_layout(model, config)     # after the load: a RuntimeError, never the fallback compile's cue
        return model
    except (FileNotFoundError, ValueError) as e:
        print(f"Exception: {e}\nUnable to find precompiled artifacts from {path}. Recompiling...", flush=True)
    model = cls(config.model, nxdi_config)
    if nxdi_config.neuron_config.quantized:
        cls.save_quantized_state_dict(config.model, nxdi_config)
    model.compile(path)
    model.load(path)
    return model


def check_cache_layout(model, config) -> None:
    """Stricter than vllm-neuron, which never compares them: the runner computes every KV slot as block * block_size
    + offset (runner L1352-1363, L1401-1413, L1597-1660), so a loaded model compiled with another block size, or
    without the block layout the scheduler's chunked prefill or prefix caching feeds (is_block_kv_layout = chunked
    prefill or prefix caching: runner L167-169), would be addressed wrongly; and a chunk must fit a compiled
    context-encoding bucket (models/model_wrapper.py L1232-1254 @ 03db3ef raise where none does). Which blocks vLLM
    and the compiled cache each write is the runner's block table (runner double, BlockTable)."""
    nc = model.neuron_config
    if not (config.enable_chunked_prefill or config.enable_prefix_caching):
        return
    if not nc.is_block_kv_layout:
        raise RuntimeError("vLLM feeds a block KV layout (chunked prefill or prefix caching) to a model compiled "
                           "with a contiguous KV cache")
    if nc.pa_block_size != config.block_size:
        raise RuntimeError(f"vLLM addresses blocks of {config.block_size} tokens; the compiled KV cache has blocks of "
                           f"{nc.pa_block_size}")
    if config.enable_prefix_caching and not nc.is_prefix_caching:
        raise RuntimeError("prefix caching is on in vLLM and off in the compiled model")
    buckets = [b[0] if isinstance(b, list) else b for b in (nc.context_encoding_buckets or [])]
    if config.enable_chunked_prefill and config.max_num_batched_tokens > max(buckets, default=0):
        raise RuntimeError(f"a chunk of max_num_batched_tokens {config.max_num_batched_tokens} fits no compiled "
                           f"context-encoding bucket (largest {max(buckets, default=0)})")


def validate_max_prompt_length(model, config) -> int:
    """neuronx_distributed_model_runner.py L604-694: the compiled max_context_length is the model's prompt limit; a
    max_prompt_length in additional_config must equal it (RuntimeError), and without one a differing max_model_len
    is only warned about (then a longer prompt stops the engine: L1317-1327)."""
    compiled = getattr(model.neuron_config, "max_context_length", None)
    if config.max_prompt_length is None:
        if compiled != config.max_model_len:
            print(f"WARNING: Your Neuron model was compiled with max prompt length {compiled}, but max_model_len is "
                  f"set to {config.max_model_len}.", flush=True)
    elif config.max_prompt_length != compiled:
        raise RuntimeError(f"Configuration mismatch: max_prompt_length in --additional-config "
                           f"({config.max_prompt_length}) does not match the Neuron model's compiled max prompt "
                           f"length ({compiled}).")
    return compiled
