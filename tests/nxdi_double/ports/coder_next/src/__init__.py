"""Fake moe-lineage NxDI contrib port (contract double): the layout of contrib/models/Qwen3-Coder-Next/src/ (PR 170 @
753c7f5). Like the real one it re-exports the app through a relative import, which still needs src/ itself on
sys.path for the module's flat sibling imports (docs/nxdi.md section 15)."""

from .modeling_qwen35_moe import NeuronQwen35MoeForCausalLM, Qwen35MoeInferenceConfig  # noqa: F401
