"""Model dimensions of an HF config.json: everything the layout rules need, and nothing else.

A view of qbuild.arch.Arch (the one reader of config.json); its errors become the converter's CheckpointError.

Legend (as in nxdi-layout.md): H hidden, D head_dim, nH / nKV attention / kv heads, Hk / Hv DeltaNet key / value
heads, dk / dv their head dims, E experts, I expert intermediate, Is shared-expert intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass

from qbuild.arch import Arch, ConfigError, VisionArch, arch_from_config
from qbuild.convert.errors import CheckpointError
from qbuild.families import ModelType


@dataclass(frozen=True)
class TextDims:
    hidden: int
    num_layers: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_k_heads: int          # DeltaNet Hk
    num_v_heads: int          # DeltaNet Hv
    k_head_dim: int           # dk
    v_head_dim: int           # dv
    conv_kernel: int
    vocab: int
    intermediate: int | None  # dense MLP (None when every layer is MoE)
    num_experts: int
    moe_intermediate: int
    shared_intermediate: int
    moe_layers: frozenset[int]
    tie_word_embeddings: bool
    pad_token_id: int | None

    @classmethod
    def from_arch(cls, a: Arch) -> "TextDims":
        return cls(
            hidden=a.hidden_size, num_layers=a.num_layers, layer_types=a.layer_types, num_heads=a.num_heads,
            num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, num_k_heads=a.num_k_heads, num_v_heads=a.num_v_heads,
            k_head_dim=a.k_head_dim, v_head_dim=a.v_head_dim, conv_kernel=a.conv_kernel, vocab=a.vocab_size,
            intermediate=a.intermediate_size, num_experts=a.num_experts or 0,
            moe_intermediate=a.moe_intermediate_size or 0, shared_intermediate=a.shared_intermediate_size or 0,
            moe_layers=a.moe_layers, tie_word_embeddings=a.tie_word_embeddings, pad_token_id=a.pad_token_id)

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def moe(self) -> bool:
        return bool(self.moe_layers)

    def is_full_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == "full_attention"

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers


@dataclass(frozen=True)
class VisionDims:
    depth: int
    hidden: int
    intermediate: int
    out_hidden: int
    num_positions: int
    in_channels: int
    temporal_patch: int
    patch: int
    merge: int

    @classmethod
    def from_arch(cls, v: VisionArch) -> "VisionDims":
        return cls(depth=v.depth, hidden=v.hidden_size, intermediate=v.intermediate_size, out_hidden=v.out_hidden_size,
                   num_positions=v.num_position_embeddings, in_channels=v.in_channels,
                   temporal_patch=v.temporal_patch_size, patch=v.patch_size, merge=v.spatial_merge_size)

    @property
    def merged_hidden(self) -> int:
        return self.hidden * self.merge ** 2


def arch_of(config: dict, label: str = "config.json") -> Arch:
    """arch_from_config, failing with the converter's CheckpointError naming `label` and the field."""
    try:
        return arch_from_config(config, label)
    except ConfigError as e:
        raise CheckpointError(label, e.message) from None


def dims_from_arch(arch: Arch, family: ModelType, label: str = "config.json") -> tuple[TextDims, VisionDims | None]:
    """The text dims, and the vision dims where the family keeps a vision encoder."""
    if family.vision_prefix and arch.vision is None:
        raise CheckpointError(label, "vision_config is missing or not an object")
    return TextDims.from_arch(arch), VisionDims.from_arch(arch.vision) if family.vision_prefix else None


def text_dims(config: dict, family: ModelType, label: str = "config.json") -> TextDims:
    """The text dims of a config (`family` is implied by its model_type; kept for callers)."""
    return TextDims.from_arch(arch_of(config, label))


def vision_dims(config: dict, label: str = "config.json") -> VisionDims:
    arch = arch_of(config, label)
    if arch.vision is None:
        raise CheckpointError(label, "vision_config is missing or not an object")
    return VisionDims.from_arch(arch.vision)
