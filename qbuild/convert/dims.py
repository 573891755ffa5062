"""Model dimensions read from an HF config.json: everything the layout rules need, and nothing else.

Legend (as in nxdi-layout.md): H hidden, D head_dim, nH / nKV attention / kv heads, Hk / Hv DeltaNet key / value
heads, dk / dv their head dims, E experts, I expert intermediate, Is shared-expert intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass

from qbuild.convert.errors import CheckpointError
from qbuild.convert.families import Family


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

    @property
    def merged_hidden(self) -> int:
        return self.hidden * self.merge ** 2


class _Fields:
    """Typed reads of one config section, failing with the file and field named."""

    def __init__(self, section: dict, where: str, label: str):
        self.section, self.where, self.label = section, where, label

    def int(self, key: str, default: int | None = None) -> int:
        value = self.section.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CheckpointError(self.label, f"{self.where}{key} must be a non-negative integer, got {value!r}")
        return value

    def get(self, key: str, default=None):
        return self.section.get(key, default)


def text_section(config: dict, family: Family, label: str = "config.json") -> dict:
    if family.text_config_key is None:
        return config
    section = config.get(family.text_config_key)
    if not isinstance(section, dict):
        raise CheckpointError(label, f"{family.text_config_key} is missing or not an object")
    return section


def text_dims(config: dict, family: Family, label: str = "config.json") -> TextDims:
    section = text_section(config, family, label)
    where = f"{family.text_config_key}." if family.text_config_key else ""
    f = _Fields(section, where, label)
    num_layers = f.int("num_hidden_layers")
    layer_types = f.get("layer_types")
    if layer_types is None:  # HF's default pattern: every 4th layer is full attention
        interval = f.int("full_attention_interval", 4)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if (not isinstance(layer_types, list) or len(layer_types) != num_layers
            or not set(layer_types) <= {"full_attention", "linear_attention"}):
        raise CheckpointError(label, f"{where}layer_types must list full_attention / linear_attention "
                                     f"for each of the {num_layers} layers")
    num_heads = f.int("num_attention_heads")
    hidden = f.int("hidden_size")
    moe_layers: frozenset[int] = frozenset()
    if family.moe and family.sparse_step_fields:
        step = f.int("decoder_sparse_step", 1) or 1
        dense = set(f.get("mlp_only_layers") or [])
        moe_layers = frozenset(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    elif family.moe:
        moe_layers = frozenset(range(num_layers))
    needs_dense = len(moe_layers) < num_layers
    tie = config.get("tie_word_embeddings", section.get("tie_word_embeddings", False))
    pad = section.get("pad_token_id", config.get("pad_token_id"))
    return TextDims(
        hidden=hidden, num_layers=num_layers, layer_types=tuple(layer_types),
        num_heads=num_heads, num_kv_heads=f.int("num_key_value_heads"),
        head_dim=f.int("head_dim", hidden // max(num_heads, 1)),
        num_k_heads=f.int("linear_num_key_heads"), num_v_heads=f.int("linear_num_value_heads"),
        k_head_dim=f.int("linear_key_head_dim"), v_head_dim=f.int("linear_value_head_dim"),
        conv_kernel=f.int("linear_conv_kernel_dim"), vocab=f.int("vocab_size"),
        intermediate=f.int("intermediate_size") if needs_dense else None,
        num_experts=f.int("num_experts") if family.moe else 0,
        moe_intermediate=f.int("moe_intermediate_size") if family.moe else 0,
        shared_intermediate=f.int("shared_expert_intermediate_size") if family.moe else 0,
        moe_layers=moe_layers, tie_word_embeddings=bool(tie),
        pad_token_id=pad if isinstance(pad, int) and not isinstance(pad, bool) else None,
    )


def vision_dims(config: dict, label: str = "config.json") -> VisionDims:
    section = config.get("vision_config")
    if not isinstance(section, dict):
        raise CheckpointError(label, "vision_config is missing or not an object")
    f = _Fields(section, "vision_config.", label)
    return VisionDims(
        depth=f.int("depth"), hidden=f.int("hidden_size"), intermediate=f.int("intermediate_size"),
        out_hidden=f.int("out_hidden_size"), num_positions=f.int("num_position_embeddings"),
        in_channels=f.int("in_channels", 3), temporal_patch=f.int("temporal_patch_size", 2),
        patch=f.int("patch_size", 16), merge=f.int("spatial_merge_size", 2),
    )
