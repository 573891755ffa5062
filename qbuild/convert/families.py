"""The supported model families, as data: where each keeps its text and vision weights and which rules apply.

A checkpoint's family is decided by config.json's `model_type` alone (nxdi-layout.md section 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from qbuild.convert.errors import CheckpointError


@dataclass(frozen=True)
class Family:
    name: str                       # the family qbuild knows the model by ("qwen3_5", "qwen3_5_moe", "qwen3_next")
    text_prefix: str                # HF key prefix of the text model, stripped to give NxDI names
    vision_prefix: str | None       # HF key prefix of the vision encoder (None: no vision encoder)
    text_config_key: str | None     # where the text dimensions live in config.json (None: at top level)
    moe: bool                       # routed experts (+ shared expert) instead of a dense MLP
    grouped_deltanet: bool          # Qwen3-Next's per-key-head grouped in_proj_qkvz / in_proj_ba
    zero_pad_embedding: bool        # zero embed_tokens[pad_token_id] (Coder-Next lineage)
    sparse_step_fields: bool = False  # config's mlp_only_layers / decoder_sparse_step pick dense layers (Qwen3-Next;
                                      # transformers' Qwen3.5-MoE has no such fields: every layer is MoE)
    dropped_prefixes: tuple[str, ...] = ("mtp.",)  # known tensors the converter deliberately leaves out


_VL = dict(text_prefix="model.language_model.", vision_prefix="model.visual.", text_config_key="text_config",
           grouped_deltanet=False, zero_pad_embedding=False)
# Text-only exports of the VL families (Qwen3_5ForCausalLM) keep `model.` and may still carry the encoder.
_VL_TEXT = dict(text_prefix="model.", vision_prefix=None, text_config_key=None, grouped_deltanet=False,
                zero_pad_embedding=False, dropped_prefixes=("mtp.", "model.visual."))

FAMILIES: dict[str, Family] = {
    "qwen3_5": Family("qwen3_5", moe=False, **_VL),
    "qwen3_5_moe": Family("qwen3_5_moe", moe=True, **_VL),
    "qwen3_5_text": Family("qwen3_5", moe=False, **_VL_TEXT),
    "qwen3_5_moe_text": Family("qwen3_5_moe", moe=True, **_VL_TEXT),
    "qwen3_next": Family("qwen3_next", text_prefix="model.", vision_prefix=None, text_config_key=None, moe=True,
                         grouped_deltanet=True, zero_pad_embedding=True, sparse_step_fields=True),
}


def family_of(config: dict, label: str = "config.json") -> Family:
    """The Family of an HF config dict; CheckpointError naming `label` for an unknown model_type."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise CheckpointError(label, f"unknown model_type {model_type!r}; supported: {', '.join(FAMILIES)}")
    return FAMILIES[model_type]
