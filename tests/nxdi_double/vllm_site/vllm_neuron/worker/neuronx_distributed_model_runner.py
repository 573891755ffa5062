"""vllm_neuron/worker/neuronx_distributed_model_runner.py @ 3afb0a9: what the engine core's runner does with the
model before it serves: load it (load_model L525-548), hold vLLM's prompt limit to the compiled one (L604-694), and
tell vLLM's KV cache manager which layers have KV blocks (get_kv_cache_spec L892-917: every layer of the HF config,
as full attention)."""

from __future__ import annotations


class NeuronxDistributedModelRunner:
    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        self.hf_config = vllm_config.hf_config
        self.model = None
        self.max_prompt_length = None
        self.neuron_config = None

    def load_model(self) -> None:
        from vllm_neuron.worker import neuronx_distributed_model_loader as loader

        self.model = loader.get_neuron_model(self.vllm_config)
        self.max_prompt_length = loader.validate_max_prompt_length(self.model, self.vllm_config)
        nc = self.model.neuron_config
        self.neuron_config = {k: getattr(nc, k) for k in ("max_context_length", "is_block_kv_layout",
                                                          "is_prefix_caching", "pa_block_size", "pa_num_blocks")}

    def get_kv_cache_spec(self) -> dict[str, dict]:
        """L892-917: `layers.<i>.self_attn` for every layer of the HF config (get_num_layers_from_hf_config)."""
        layers = self.hf_config.num_hidden_layers
        return {f"layers.{i}.self_attn": {"block_size": self.vllm_config.block_size} for i in range(layers)}

    def check_kv_cache_spec(self) -> dict[str, dict]:
        """The spec vLLM's prefix cache would be built on. Stricter than vLLM: with prefix caching, a hybrid model
        whose DeltaNet layers the spec names as attention would have blocks cached for layers that hold no KV and no
        DeltaNet state at all; the Qwen3.6-27B port patches the spec to its attention layers for that reason
        (vllm/patches/vllm_neuron_qwen36_kv_cache_spec.patch, vllm/qwen36_hybrid_apc_scheduler_patch.py L2352-2411
        @ 03db3ef), so the double refuses the unpatched one."""
        spec = self.get_kv_cache_spec()
        layer_types = getattr(self.hf_config, "layer_types", None) or []
        kinds = {f"layers.{i}.self_attn": kind for i, kind in enumerate(layer_types)}
        deltanet = [name for name in spec if kinds.get(name) == "linear_attention"]
        if self.vllm_config.enable_prefix_caching and deltanet:
            raise RuntimeError(f"prefix caching with a KV cache spec that names the DeltaNet layers {deltanet} as "
                               "attention: vllm-neuron 0.5's spec, unpatched")
        return spec
