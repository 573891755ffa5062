"""The architecture the reference model needs: views of qbuild.arch.Arch, the one reader of config.json.

`TextConfig.from_hf` / `VisionConfig.from_hf` take an HF config.json dict in any form qbuild.arch reads (the VL
wrappers, the text-only configs, transformers-5 or older rope fields); the compile path builds them from the
fingerprint in compile params with `from_arch` (`Arch.from_fingerprint`), without an HF config in between.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from qbuild.arch import Arch, ConfigError, VisionArch, arch_from_config, vision_from_config

LayerType = Literal["linear_attention", "full_attention"]


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
    def from_hf(cls, config: dict[str, Any], origin: str = "config.json") -> "TextConfig":
        """From an HF config.json dict: a VL wrapper (its text_config is used) or a text config."""
        return cls.from_arch(arch_from_config(config, origin))

    @classmethod
    def from_arch(cls, a: Arch) -> "TextConfig":
        rope = a.rope_params
        moe = a.is_moe
        return cls(
            model_type=a.text_model_type, vocab_size=a.vocab_size, hidden_size=a.hidden_size, num_layers=a.num_layers,
            layer_types=a.layer_types, rms_norm_eps=a.rms_norm_eps, num_attention_heads=a.num_heads,
            num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, rope_theta=rope["rope_theta"],
            partial_rotary_factor=rope["partial_rotary_factor"], mrope_section=rope.get("mrope_section"),
            mrope_interleaved=bool(rope.get("mrope_interleaved", False)), num_linear_key_heads=a.num_k_heads,
            num_linear_value_heads=a.num_v_heads, linear_key_head_dim=a.k_head_dim, linear_value_head_dim=a.v_head_dim,
            linear_conv_kernel_dim=a.conv_kernel, intermediate_size=a.intermediate_size or 0,
            num_experts=a.num_experts if moe else 0, num_experts_per_tok=a.num_experts_per_tok if moe else 0,
            moe_intermediate_size=a.moe_intermediate_size if moe else 0,
            shared_expert_intermediate_size=a.shared_intermediate_size if moe else 0,
            norm_topk_prob=a.norm_topk_prob, decoder_sparse_step=a.decoder_sparse_step,
            mlp_only_layers=a.mlp_only_layers, tie_word_embeddings=a.tie_word_embeddings,
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
    def from_hf(cls, config: dict[str, Any], origin: str = "config.json") -> "VisionConfig":
        """From an HF config.json dict of a VL wrapper (its vision_config and image token ids)."""
        read = vision_from_config(config, origin)
        if read is None:
            raise ConfigError(origin, "vision_config", f"model_type {config.get('model_type')!r} has no vision "
                                                       "encoder (no vision_config)")
        vision, host = read
        for key in ("image_token_id", "vision_start_token_id"):
            if host[key] is None:
                raise ConfigError(origin, key, f"{key} is missing (the vision encoder needs it)")
        return cls.from_vision(vision, rope_theta=host["vision_rope_theta"], image_token_id=host["image_token_id"],
                               vision_start_token_id=host["vision_start_token_id"])

    @classmethod
    def from_arch(cls, arch: Arch) -> "VisionConfig":
        """From an Arch with a vision encoder (image token ids -1 where the Arch has none)."""
        if arch.vision is None:
            raise ValueError(f"{arch.family} architecture has no vision encoder")
        return cls.from_vision(arch.vision, rope_theta=arch.vision_rope_theta,
                               image_token_id=-1 if arch.image_token_id is None else arch.image_token_id,
                               vision_start_token_id=-1 if arch.vision_start_token_id is None
                               else arch.vision_start_token_id)

    @classmethod
    def from_vision(cls, v: VisionArch, rope_theta: float = 10000.0, image_token_id: int = -1,
                    vision_start_token_id: int = -1) -> "VisionConfig":
        """From the vision graph's fingerprint alone: the host-side facts (token ids, rotary base) are defaults."""
        return cls(
            depth=v.depth, hidden_size=v.hidden_size, num_heads=v.num_heads, intermediate_size=v.intermediate_size,
            out_hidden_size=v.out_hidden_size, in_channels=v.in_channels, patch_size=v.patch_size,
            temporal_patch_size=v.temporal_patch_size, spatial_merge_size=v.spatial_merge_size,
            num_position_embeddings=v.num_position_embeddings, rope_theta=rope_theta,
            image_token_id=image_token_id, vision_start_token_id=vision_start_token_id,
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merged_hidden_size(self) -> int:
        return self.hidden_size * self.spatial_merge_size**2
