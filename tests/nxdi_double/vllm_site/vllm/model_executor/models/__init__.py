"""vLLM 0.16.0's ModelRegistry as the bundle plugin uses it (vllm/model_executor/models/registry.py): the
architectures vLLM has a class for include Qwen3NextForCausalLM (L112) and Qwen3ForCausalLM, and no Qwen3_5 one."""

from __future__ import annotations


# Two of vLLM 0.16's multimodal classes (model_executor/models/registry.py:290 _MULTIMODAL_MODELS; Qwen3-VL at L464).
_MULTIMODAL = {"Qwen2VLForConditionalGeneration", "Qwen3VLForConditionalGeneration"}


class _Registry:
    def __init__(self) -> None:
        self.models = {"Qwen3ForCausalLM": "vllm.model_executor.models.qwen3:Qwen3ForCausalLM",
                       "Qwen3NextForCausalLM": "vllm.model_executor.models.qwen3_next:Qwen3NextForCausalLM",
                       "Qwen3MoeForCausalLM": "vllm.model_executor.models.qwen3_moe:Qwen3MoeForCausalLM"}

    def get_supported_archs(self):
        return self.models.keys()

    def is_multimodal(self, architecture: str | None) -> bool:
        """Whether the class registered for `architecture` is one of vLLM's multimodal models (SupportsMultiModal):
        of those the bundle plugin may register, none is; vLLM's Qwen2-VL and Qwen3-VL classes are."""
        return self.models.get(architecture, "").rsplit(":", 1)[-1] in _MULTIMODAL

    def register_model(self, architecture: str, model_cls: str) -> None:
        if ":" not in model_cls:
            raise ValueError(f"{model_cls!r}: a lazy model class is 'module:Class'")
        self.models[architecture] = model_cls


ModelRegistry = _Registry()
