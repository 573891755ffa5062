"""vllm_neuron/platform.py @ 3afb0a9, what it does to vLLM's configuration. Importing it makes vLLM start its engine
core with `spawn` unless the environment says otherwise (L7), so the configuration is pickled into a new
interpreter."""

import os

os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


class NeuronPlatform:
    @classmethod
    def check_and_update_config(cls, config) -> None:
        """L290-387: max_prompt_length from additional_config (L314-316); one more block for vLLM's null block where
        num_gpu_blocks_override is set (L318-332). DISABLE_NEURON_CUSTOM_SCHEDULER=1 keeps vLLM's own scheduler, with
        chunked prefill as asked and a block size that must be given (L310-312, L342-349). Otherwise the custom
        scheduler, without chunked prefill, with a 128k token budget (L355-363), and block_size = max_model_len
        without prefix caching, else a block size must be given (L378-387)."""
        native = bool(int(os.getenv("DISABLE_NEURON_CUSTOM_SCHEDULER", "0")))
        config.max_prompt_length = config.additional_config.get("max_prompt_length", None)
        if config.num_gpu_blocks_override is not None:
            config.num_gpu_blocks_override += 1
        if native:
            assert config.block_size is not None, "When vLLM V1 native scheduler is enabled, block_size must be set."
            return
        config.enable_chunked_prefill = False
        config.max_num_batched_tokens = 131072
        if not config.enable_prefix_caching:
            config.block_size = config.max_model_len
        else:
            assert config.block_size is not None, "When prefix caching is enabled, block_size must be set."
