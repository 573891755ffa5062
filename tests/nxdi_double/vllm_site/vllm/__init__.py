"""Contract double of vLLM 0.16.0's serving surface (tests/nxdi_double/vllm_site): the OpenAI server's command line,
plugin loading, the engine core started in a process of its own, and the platform hooks vllm-neuron 0.5 uses. Built
from the facts in docs/vllm.md, each with its source; stricter than vLLM where those are silent. It does not generate:
its server answers /v1/models and refuses what vLLM would refuse, and says so for everything else.

vLLM 0.16.0 runs on transformers 4.x (its METADATA: transformers >= 4.56.0, < 5), and the SDK's NxDI on 4.57
(aws-neuron-sdk release-notes/prev/content.rst L67-78 @ a3247f5). transformers 4.57.6 has no Qwen3.5 model types
(models/auto/configuration_auto.py), and its AutoTokenizer cannot resolve transformers 5's TokenizersBackend
(tokenization_auto.py L1144-1156). The tests run transformers 5, so importing this double makes the process look like
4.x in those two respects: the Qwen3.5 config types are taken out of transformers' registry here, and
TRANSFORMERS_4_UNKNOWN_TOKENIZERS is what the server refuses to read.
"""

from transformers.models.auto.configuration_auto import CONFIG_MAPPING

TRANSFORMERS_4_MISSING_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
TRANSFORMERS_4_UNKNOWN_TOKENIZERS = ("TokenizersBackend",)

for _model_type in TRANSFORMERS_4_MISSING_MODEL_TYPES:
    if _model_type not in CONFIG_MAPPING._extra_content:    # a type registered since (by a plugin) stays
        CONFIG_MAPPING._mapping.pop(_model_type, None)
