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
    """L1063-1123 without chunked prefill (the platform turned it off); then max_prompt_length, where set, becomes
    max_context_length (_validate_override_neuron_config L1248-1284)."""
    from neuronx_distributed_inference.models.config import OnDeviceSamplingConfig

    blocks = (config.max_model_len // config.block_size) * config.max_num_seqs
    if config.num_gpu_blocks_override is not None:
        blocks = config.num_gpu_blocks_override
    neuron_config = {
        "tp_degree": config.tensor_parallel_size, "ctx_batch_size": 1, "batch_size": config.max_num_seqs,
        "max_context_length": config.max_model_len, "seq_len": config.max_model_len, "enable_bucketing": True,
        "is_continuous_batching": config.max_num_seqs > 1, "quantized": False,
        "torch_dtype": {"auto": "float32", "half": "float16", "float": "float32"}.get(config.dtype, config.dtype),
        "padding_side": "right", "on_device_sampling_config": OnDeviceSamplingConfig(dynamic=True, deterministic=False),
        "lora_config": None, "pa_num_blocks": blocks, "pa_block_size": config.block_size,
        "is_block_kv_layout": config.enable_chunked_prefill or config.enable_prefix_caching,
        "is_prefix_caching": config.enable_prefix_caching,
    }
    if config.max_prompt_length is not None:
        neuron_config["max_context_length"] = config.max_prompt_length
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
    neuron_config = cls.get_neuron_config_cls()(**_default_neuron_config(config))
    nxdi_config = cls.get_config_cls()(neuron_config, load_config=load_pretrained_config(config.model))
    hashed = hashlib.md5(nxdi_config.to_json_string().encode() if hasattr(nxdi_config, "to_json_string")
                         else repr(sorted(vars(nxdi_config))).encode()).hexdigest()
    path = _compiled_model_path(config.model, hashed)
    try:
        model = cls(path)
        model.load(path)
        return model
    except (FileNotFoundError, ValueError) as e:
        print(f"Exception: {e}\nUnable to find precompiled artifacts from {path}. Recompiling...", flush=True)
    model = cls(config.model, nxdi_config)
    if nxdi_config.neuron_config.quantized:
        cls.save_quantized_state_dict(config.model, nxdi_config)
    model.compile(path)
    model.load(path)
    return model


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
