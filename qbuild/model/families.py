"""The supported model families, as data: the one table that the config reader, the recipe checks, the converter,
and the tiny checkpoints read their family facts from (the FP8 policies themselves are qbuild.model.fp8's).

- `FAMILIES`: per family, its config model types, whether it is MoE, the FP8 policies and default MoE backend it
  takes, whether its rotary is mRoPE and the converter's family rules.
- `MODEL_TYPES`: per config.json `model_type` (a checkpoint's family is decided by it alone, docs/nxd-layout.md
  section 0), its family, whether it is a VL wrapper, and where it keeps its text and vision weights.

Plain data only: the planner imports it, so it must stay free of torch, transformers and pydantic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from qbuild.model.fp8 import FP8PolicyName

FamilyName = Literal["qwen3_5", "qwen3_5_moe", "qwen3_next"]
MoEBackend = Literal["shard_on_intermediate", "torch_blockwise", "shard_hidden", "shard_on_block"]

# --- families ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Family:
    name: FamilyName
    vl_model_type: str | None       # model_type of the VL wrapper (None: the family has no vision encoder)
    text_model_type: str            # model_type of the text model (a text-only export, or a wrapper's text_config)
    moe: bool                       # routed experts (+ shared expert) instead of a dense MLP
    # fp8 "full" quantizes attention and DeltaNet projections too; only the dense family has been validated so.
    fp8_policies: tuple[FP8PolicyName, ...]
    default_moe_backend: MoEBackend | None
    # transformers' Qwen3.5 text rotary (both VL families) interleaves the (t, h, w) frequencies of an
    # mrope_section; Qwen3-Next's is plain RoPE and ignores mrope keys.
    mrope: bool
    transformers_config: str        # the transformers config class of the family's published checkpoints
    # Qwen3-Next's config places dense layers (mlp_only_layers, decoder_sparse_step) and may skip top-k
    # renormalisation (norm_topk_prob); transformers' Qwen3.5-MoE reads none of them: all MoE, renormalised.
    moe_layout_fields: bool = False
    grouped_deltanet: bool = False   # Qwen3-Next's per-key-head grouped in_proj_qkvz / in_proj_ba
    zero_pad_embedding: bool = False  # zero embed_tokens[pad_token_id] (Coder-Next lineage)
    # The conversion rule modules its checkpoints run (under qbuild.model.convert): what its convert and shard steps'
    # keys hold of the converters, so that editing one family's rules rebuilds that family's models alone.
    rules: tuple[str, ...] = ("embeddings", "norms", "attention", "deltanet", "mlp")

    def rule_modules(self) -> tuple[str, ...]:
        return tuple(f"qbuild.model.convert.{name}" for name in self.rules)


FAMILIES: dict[FamilyName, Family] = {
    "qwen3_5": Family("qwen3_5", "qwen3_5", "qwen3_5_text", moe=False, fp8_policies=("none", "mlp_only", "full"),
                      default_moe_backend=None, mrope=True,
                      transformers_config="Qwen3_5Config",
                      rules=("embeddings", "norms", "attention", "deltanet", "mlp", "vision")),
    "qwen3_5_moe": Family("qwen3_5_moe", "qwen3_5_moe", "qwen3_5_moe_text", moe=True,
                          fp8_policies=("none", "mlp_only"), default_moe_backend="shard_on_intermediate", mrope=True,
                          transformers_config="Qwen3_5MoeConfig",
                          rules=("embeddings", "norms", "attention", "deltanet", "moe", "vision")),
    "qwen3_next": Family("qwen3_next", None, "qwen3_next", moe=True, fp8_policies=("none", "mlp_only"),
                         default_moe_backend="shard_on_block", mrope=False,
                         transformers_config="Qwen3NextConfig", moe_layout_fields=True, grouped_deltanet=True,
                         zero_pad_embedding=True, rules=("embeddings", "norms", "attention", "deltanet", "mlp", "moe")),
}


# --- config.json model types ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelType:
    name: str                       # config.json's model_type
    family: Family
    wrapped: bool                   # a VL wrapper: text under text_config, vision under vision_config
    text_prefix: str                # HF key prefix of the text model, stripped to give NxDI names
    vision_prefix: str | None       # HF key prefix of the vision encoder (None: no vision encoder)
    transformers_model: str         # the transformers class that loads such a checkpoint
    dropped_prefixes: tuple[str, ...] = ("mtp.",)  # known tensors the converter deliberately leaves out


def _vl(family: Family, model: str) -> ModelType:
    return ModelType(family.vl_model_type, family, True, "model.language_model.", "model.visual.", model)


def _vl_text_export(family: Family, model: str) -> ModelType:
    # Text-only exports of the VL families keep `model.` and may still carry the encoder.
    return ModelType(family.text_model_type, family, False, "model.", None, model, ("mtp.", "model.visual."))


_Q35, _Q35_MOE, _NEXT = FAMILIES["qwen3_5"], FAMILIES["qwen3_5_moe"], FAMILIES["qwen3_next"]
MODEL_TYPES: dict[str, ModelType] = {mt.name: mt for mt in (
    _vl(_Q35, "Qwen3_5ForConditionalGeneration"),
    _vl(_Q35_MOE, "Qwen3_5MoeForConditionalGeneration"),
    _vl_text_export(_Q35, "Qwen3_5ForCausalLM"),
    _vl_text_export(_Q35_MOE, "Qwen3_5MoeForCausalLM"),
    ModelType("qwen3_next", _NEXT, False, "model.", None, "Qwen3NextForCausalLM"),
)}
