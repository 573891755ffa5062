"""The parts of vLLM 0.16.0's VllmConfig that vllm-neuron 0.5 reads (its model, cache, scheduler and parallel
configs, flattened here), one plain picklable object: vLLM hands the whole configuration, the HF config object in it,
to the engine-core process as a Process argument (vllm/v1/engine/utils.py L99-128).

Built, it checks what vLLM's SchedulerConfig checks of a given token budget (vllm/config/scheduler.py L244-263): below
max_model_len only with chunked prefill, and never below max_num_seqs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class VllmConfig:
    model: str
    hf_config: object
    dtype: str
    max_model_len: int
    tensor_parallel_size: int
    max_num_seqs: int
    num_gpu_blocks_override: int | None
    enable_prefix_caching: bool
    enable_chunked_prefill: bool
    additional_config: dict = field(default_factory=dict)
    block_size: int | None = None
    max_num_batched_tokens: int | None = None
    max_prompt_length: int | None = None     # set by the platform (vllm_neuron/platform.py L314-316)
    mamba_cache_mode: str = "none"           # vllm/config/cache.py MambaCacheMode, default "none"
    mamba_ssm_cache_dtype: str = "auto"
    # --generation-config: "auto" reads the model's generation_config.json for the sampling defaults, "vllm" keeps
    # vLLM's own (the Qwen3.6-27B port's vllm/README.md L106-109 @ 03db3ef says why its launcher passes "vllm").
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        tokens = self.max_num_batched_tokens
        if tokens is None:
            return
        if tokens < self.max_model_len and not self.enable_chunked_prefill:
            raise ValueError(f"max_num_batched_tokens ({tokens}) is smaller than max_model_len ({self.max_model_len}). "
                             "This effectively limits the maximum sequence length to max_num_batched_tokens and makes "
                             "vLLM reject longer sequences.")
        if tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({tokens}) must be greater than or equal to max_num_seqs "
                             f"({self.max_num_seqs}).")
