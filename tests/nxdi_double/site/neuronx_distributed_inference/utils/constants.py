"""Contract double of NxDI utils/constants.py: MODEL_TYPES, the registry vllm-neuron looks a model class up in
(docs/nxdi.md section 17). The ports register themselves into it; NxDI main has no qwen3_5 / qwen3next entry."""

MODEL_TYPES: dict[str, dict] = {}
