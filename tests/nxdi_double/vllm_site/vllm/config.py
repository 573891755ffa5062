"""The parts of vLLM 0.16.0's VllmConfig that vllm-neuron 0.5 reads (its model, cache, scheduler and parallel
configs, flattened here), one plain picklable object: vLLM hands the whole configuration, the HF config object in it,
to the engine-core process as a Process argument (vllm/v1/engine/utils.py L99-128)."""

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
