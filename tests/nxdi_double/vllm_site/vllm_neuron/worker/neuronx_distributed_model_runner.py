"""vllm_neuron/worker/neuronx_distributed_model_runner.py @ 3afb0a9: what the engine core's runner does with the
model before and while it serves: load it (load_model L525-548), pick its sampling path from the loaded model's own
config (sampling_path), hold vLLM's prompt limit to the compiled one (L604-694), tell vLLM's KV cache manager which
layers have KV blocks (get_kv_cache_spec L892-917: every layer of the HF config, as full attention), and run a
scheduled step through the model (execute_model)."""

from __future__ import annotations


class BlockTable:
    """Who writes each block of the compiled KV cache. Stricter than vLLM and NxDI, which never compare them: a block
    with two owners is refused here, where the real stack would let one overwrite the other.

    - vLLM: num_gpu_blocks blocks (the override plus the platform's null block: platform.py L318-332); block 0 is
      its null block, popped first from the free queue and never in a block table (vllm/v1/core/block_pool.py
      BlockPool.__init__; the runner assumes "block 0 will never be used": L115-120), so requests get 1..N.
    - The runner pads every slot mapping with -1 (_SLOT_MAPPING_PAD L119, L1527-1529), which NxDI's prefix-caching
      cache writes into its last block (block_kv_cache_manager.padding_block).
    - A block vLLM may hand out that the compiled cache does not have is refused as well."""

    def __init__(self, blocks: int):
        self.blocks = blocks
        self.owner: dict[int, str] = {}

    def claim(self, block: int, who: str) -> None:
        if not 0 <= block < self.blocks:
            raise RuntimeError(f"{who} addresses block {block}; the compiled KV cache has blocks 0..{self.blocks - 1}")
        if block in self.owner:
            raise RuntimeError(f"block {block} of the compiled KV cache has two owners: {self.owner[block]} and {who}")
        self.owner[block] = who


class NeuronxDistributedModelRunner:
    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        self.hf_config = vllm_config.hf_config
        self.model = None
        self.max_prompt_length = None
        self.neuron_config = None
        self.block_table = None

    def load_model(self) -> None:
        from vllm_neuron.worker import neuronx_distributed_model_loader as loader

        self.model = loader.get_neuron_model(self.vllm_config)
        self.sampling = self.sampling_path()
        self.max_prompt_length = loader.validate_max_prompt_length(self.model, self.vllm_config)
        nc = self.model.neuron_config
        self.neuron_config = {k: getattr(nc, k) for k in ("max_context_length", "is_block_kv_layout",
                                                          "is_prefix_caching", "pa_block_size", "pa_num_blocks")}

    def sampling_path(self) -> dict:
        """How tokens are picked, decided by the loaded model's config: the loader sets model.neuron_config to the
        loaded app's (loader L1054), which for a precompiled directory is the compiled neuron_config.json, not the
        loader's default OnDeviceSamplingConfig(dynamic=True, deterministic=False) (L1070-1073). With an
        on_device_sampling_config the runner takes the model's token (sample_tokens L230-246, _sample_on_device
        L285-338): the forward's output is NxDI's `hidden_states`, which holds the sampled tokens (loader L508-509;
        NxDI model_base.py L3846 @ ef2731e), wrapped as sampled_token_ids (loader L542-552), and each request's
        top_k, top_p and temperature reach the compiled sampler as its sampling params (runner L1715-1750). Without
        one, vLLM's own sampler on the host takes the logits (L247-270)."""
        from neuronx_distributed_inference._double import record
        from neuronx_distributed_inference.models.config import to_dict

        config = getattr(self.model.neuron_config, "on_device_sampling_config", None)
        path = {"path": "on_device" if config is not None else "cpu", "config": to_dict(config)}
        record("vllm_sampling", **path)
        return path

    def initialize_kv_cache(self) -> BlockTable | None:
        """The block table of a block KV layout once vLLM's pool exists (num_gpu_blocks, null block included)."""
        from neuronx_distributed_inference.modules.kvcache.block_kv_cache_manager import cache_blocks, padding_block

        nc = self.model.neuron_config
        if not nc.is_block_kv_layout or self.vllm_config.num_gpu_blocks_override is None:
            return None
        table = BlockTable(cache_blocks(nc))
        table.claim(0, "vLLM's null block")
        for block in range(1, self.vllm_config.num_gpu_blocks_override):
            table.claim(block, f"vLLM's block {block}")
        sink = padding_block(nc)
        if sink is not None:
            table.claim(sink, "NxDI's padding sink")
        self.block_table = table
        return table

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

    def execute_model(self, prompt_tokens: int) -> None:
        """One scheduled prefill step of a `prompt_tokens`-token request: a text model's step goes through
        _execute_model_for_text (execute_model L697-761), which the Qwen3.6-27B port's patch wraps."""
        self._execute_model_for_text(prompt_tokens)

    def _execute_model_for_text(self, prompt_tokens: int) -> None:
        """L1046-1068: the model's forward. The double does not compute: the port's model builds the call's
        arguments and its traced graph takes them or raises (the port fake's `execute`)."""
        self.model.execute("context_encoding_model", prompt_tokens)
