"""vLLM 0.16.0's ModelRegistry as the bundle plugin uses it (vllm/model_executor/models/registry.py): the
architectures vLLM has a class for include Qwen3NextForCausalLM (L112) and Qwen3ForCausalLM, and no Qwen3_5 one."""

from __future__ import annotations


class _Registry:
    def __init__(self) -> None:
        self.models = {"Qwen3ForCausalLM": "vllm.model_executor.models.qwen3:Qwen3ForCausalLM",
                       "Qwen3NextForCausalLM": "vllm.model_executor.models.qwen3_next:Qwen3NextForCausalLM",
                       "Qwen3MoeForCausalLM": "vllm.model_executor.models.qwen3_moe:Qwen3MoeForCausalLM"}

    def get_supported_archs(self):
        return self.models.keys()

    def register_model(self, architecture: str, model_cls: str) -> None:
        if ":" not in model_cls:
            raise ValueError(f"{model_cls!r}: a lazy model class is 'module:Class'")
        self.models[architecture] = model_cls


ModelRegistry = _Registry()
