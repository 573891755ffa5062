"""The architecture the reference model needs, read from an HF config.json (dict).

Handles the VL wrappers (qwen3_5, qwen3_5_moe: the text model under `text_config`, the vision encoder under
`vision_config`) and text-only qwen3_next, in both the transformers-5 form (`rope_parameters`) and the older
form (top-level `rope_theta` / `partial_rotary_factor`, `rope_scaling`, `full_attention_interval`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

LayerType = Literal["linear_attention", "full_attention"]
TEXT_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
VL_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")


def _text_section(config: dict[str, Any]) -> dict[str, Any]:
    if config.get("model_type") in VL_MODEL_TYPES:
        if "text_config" not in config:
            raise ValueError(f"config of model_type {config['model_type']!r} has no text_config")
        return config["text_config"]
    return config


def _rope(text: dict[str, Any]) -> tuple[float, float, tuple[int, ...] | None, bool]:
    """(theta, partial rotary factor, mrope section or None, interleaved) from either config form."""
    params = dict(text.get("rope_scaling") or {})
    params.update(text.get("rope_parameters") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ValueError(f"rope_type {rope_type!r} is not supported (only default / mrope)")
    theta = float(params.get("rope_theta", text.get("rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)))
    section = params.get("mrope_section")
    return theta, partial, tuple(section) if section else None, bool(params.get("mrope_interleaved", False))


def _layer_types(text: dict[str, Any]) -> tuple[LayerType, ...]:
    num_layers = text["num_hidden_layers"]
    if text.get("layer_types"):
        types = tuple(text["layer_types"])
    else:  # older Qwen3-Next configs: every `full_attention_interval`-th layer is full attention
        interval = text.get("full_attention_interval", 4)
        types = tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers))
    if len(types) != num_layers or set(types) - {"linear_attention", "full_attention"}:
        raise ValueError(f"layer_types {types!r} do not describe {num_layers} linear/full attention layers")
    return types  # type: ignore[return-value]


@dataclass(frozen=True)
class TextConfig:
    """The text decoder's architecture. Counts start with `num_`; MoE fields are 0 for dense models."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[LayerType, ...]
    rms_norm_eps: float
    # gated GQA (full-attention layers)
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, ...] | None  # frequencies per (t, h, w) axis; None: plain 1-D RoPE
    mrope_interleaved: bool
    # Gated DeltaNet (linear-attention layers)
    num_linear_key_heads: int
    num_linear_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # MLP: dense SwiGLU, or MoE (routed experts + a gated shared expert)
    intermediate_size: int
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "TextConfig":
        """From an HF config.json dict: a VL wrapper (its text_config is used) or a text config."""
        text = _text_section(config)
        model_type = text.get("model_type", "")
        if model_type not in TEXT_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported (expected one of {TEXT_MODEL_TYPES})")
        theta, partial, section, interleaved = _rope(text)
        moe = text.get("num_experts", 0) if model_type != "qwen3_5_text" else 0
        return cls(
            model_type=model_type, vocab_size=text["vocab_size"], hidden_size=text["hidden_size"],
            num_layers=text["num_hidden_layers"], layer_types=_layer_types(text), rms_norm_eps=text["rms_norm_eps"],
            num_attention_heads=text["num_attention_heads"], num_kv_heads=text["num_key_value_heads"],
            head_dim=text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"],
            rope_theta=theta, partial_rotary_factor=partial, mrope_section=section, mrope_interleaved=interleaved,
            num_linear_key_heads=text["linear_num_key_heads"], num_linear_value_heads=text["linear_num_value_heads"],
            linear_key_head_dim=text["linear_key_head_dim"], linear_value_head_dim=text["linear_value_head_dim"],
            linear_conv_kernel_dim=text["linear_conv_kernel_dim"],
            intermediate_size=text.get("intermediate_size", 0),
            num_experts=moe, num_experts_per_tok=text.get("num_experts_per_tok", 0) if moe else 0,
            moe_intermediate_size=text.get("moe_intermediate_size", 0) if moe else 0,
            shared_expert_intermediate_size=text.get("shared_expert_intermediate_size", 0) if moe else 0,
            # qwen3_5_moe always renormalises the top-k weights; qwen3_next only if norm_topk_prob.
            norm_topk_prob=bool(text.get("norm_topk_prob", True)) if model_type == "qwen3_next" else True,
            decoder_sparse_step=text.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(text.get("mlp_only_layers") or ()),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        )

    def is_full_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == "full_attention"

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer` has a sparse MoE block (else a dense MLP), by HF's rule for each family."""
        if not self.num_experts or layer in self.mlp_only_layers:
            return False
        return (layer + 1) % self.decoder_sparse_step == 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.num_linear_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.num_linear_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim


@dataclass(frozen=True)
class VisionConfig:
    """The vision encoder of the VL families, plus the wrapper's image token ids."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    num_position_embeddings: int
    rope_theta: float
    image_token_id: int
    vision_start_token_id: int

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "VisionConfig":
        if config.get("model_type") not in VL_MODEL_TYPES or "vision_config" not in config:
            raise ValueError(f"model_type {config.get('model_type')!r} has no vision encoder")
        v = config["vision_config"]
        act = v.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"vision hidden_act {act!r} is not supported (expected gelu_pytorch_tanh)")
        return cls(
            depth=v["depth"], hidden_size=v["hidden_size"], num_heads=v["num_heads"],
            intermediate_size=v["intermediate_size"], out_hidden_size=v["out_hidden_size"],
            in_channels=v.get("in_channels", 3), patch_size=v["patch_size"],
            temporal_patch_size=v["temporal_patch_size"], spatial_merge_size=v["spatial_merge_size"],
            num_position_embeddings=v["num_position_embeddings"],
            rope_theta=float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            image_token_id=config["image_token_id"], vision_start_token_id=config["vision_start_token_id"],
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merged_hidden_size(self) -> int:
        return self.hidden_size * self.spatial_merge_size**2
