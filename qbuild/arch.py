"""Architecture facts read from a checkpoint's config.json, and the recipe checks that depend on them.

This is the one reader of a HF config.json, and Arch the one architecture type: the planner (its fingerprint in
compile keys), the converter, the reference model and the backends all take the Arch built here. It reads

- the VL wrappers (qwen3_5, qwen3_5_moe: the text model under `text_config`, the vision encoder under
  `vision_config`), their text-only exports (qwen3_5_text, qwen3_5_moe_text) and text-only qwen3_next;
- both the transformers-5 form (`rope_parameters`, `layer_types`) and the older published form (top-level
  `rope_theta` / `partial_rotary_factor`, `rope_scaling`, `full_attention_interval`).

Planning must work offline and without torch, so this module reads JSON only. The published configs of the
shipped models are kept in qbuild/configs (named org--name.json) for recipes whose weights are not downloaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from .dtypes import DTYPE_BYTES
from .errors import RecipeError, UserError
from .recipe import LoadedRecipe, recipe_field_location
from .userfile import read_small_file

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
MOE_FAMILIES = ("qwen3_5_moe", "qwen3_next")
# config.json's model_type -> (family, whether it is a VL wrapper: text under text_config, vision under vision_config)
MODEL_TYPES = {"qwen3_5": ("qwen3_5", True), "qwen3_5_moe": ("qwen3_5_moe", True),
               "qwen3_5_text": ("qwen3_5", False), "qwen3_5_moe_text": ("qwen3_5_moe", False),
               "qwen3_next": ("qwen3_next", False)}
# The model_type of each family's text model (what a VL wrapper's text_config says).
TEXT_MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "qwen3_next": "qwen3_next"}
DEFAULT_MOE_BACKEND = {"qwen3_5_moe": "shard_on_intermediate", "qwen3_next": "shard_on_block"}
# fp8 "full" quantises attention and DeltaNet projections too; only the dense family has been validated so.
FP8_POLICIES = {"qwen3_5": ("none", "mlp_only", "full"), "qwen3_5_moe": ("none", "mlp_only"),
                "qwen3_next": ("none", "mlp_only")}
ROPE_TYPES = ("default", "mrope")  # "mrope" is the older name of default RoPE with an mrope_section
# transformers' Qwen3.5 text rotary (both VL families) always interleaves the (t, h, w) frequencies and takes
# mrope_section from rope_parameters with this default; Qwen3-Next's is plain RoPE and ignores mrope keys.
MROPE_FAMILIES = ("qwen3_5", "qwen3_5_moe")
DEFAULT_MROPE_SECTION = (11, 11, 10)
# Config fields holding token ids (eos_token_id may list several). Each indexes the embedding.
TOKEN_ID_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                   "eos_token_id", "bos_token_id", "pad_token_id")
MAX_CONFIG_BYTES = 4 << 20   # a config.json is a few KiB
VISION_HIDDEN_ACT = "gelu_pytorch_tanh"

_SHIPPED = Path(__file__).parent / "configs"
# Device memory one rank (one logical NeuronCore) can use, by target and LNC.
_HBM_PER_RANK_GIB = {("trn2", 2): 24, ("trn2", 1): 12, ("trn1", 1): 16, ("trn1", 2): 32, ("inf2", 1): 16,
                     ("inf2", 2): 32}


class ConfigError(UserError, ValueError):
    """A config.json that qbuild cannot read: one line naming the file (`origin`) and the field.

    `message` is the line without the file, so that the converter can re-raise it as its own CheckpointError.
    """

    def __init__(self, origin: str, field: str, message: str):
        self.origin, self.field, self.message = origin, field, message
        super().__init__(f"{origin}: {message}")


def _is_moe_layer(layer: int, moe: bool, decoder_sparse_step: int, mlp_only_layers: tuple[int, ...]) -> bool:
    """HF's rule for each family: every decoder_sparse_step-th layer of an MoE model, but mlp_only_layers."""
    return moe and layer not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0


def _tuple(value):
    return tuple(_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


@dataclass(frozen=True)
class VisionArch:
    """The vision encoder's graph-shaping fields. All of them enter the vision graphs' compile keys."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    num_position_embeddings: int
    in_channels: int = 3

    @classmethod
    def from_fingerprint(cls, fp: dict) -> "VisionArch":
        """The VisionArch whose asdict() is `fp` (compile params' "vision", possibly read back from JSON)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in fp.items() if k in names})

    def to_hf_config(self) -> dict:
        """This encoder as a transformers-5 vision_config."""
        return {**asdict(self), "hidden_act": VISION_HIDDEN_ACT}

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merged_hidden_size(self) -> int:
        """The width of one merged token: the spatial_merge_size**2 patch tokens it merges, side by side."""
        return self.hidden_size * self.spatial_merge_size ** 2


@dataclass(frozen=True)
class Arch:
    """The allow-listed fields of a model's config that shape its graphs and weights (never weight values).

    The fields after `max_position_embeddings` (HOST_FIELDS) are host-side facts (which token pads, where image features
    go, the vision rotary base the host computes cos/sin with): they are kept for the converter and the runtime
    but never enter the fingerprint, so they do not change compile keys.
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int | None
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    num_experts: int | None
    num_experts_per_tok: int | None
    moe_intermediate_size: int | None
    shared_intermediate_size: int | None
    # Normalised: rope_type, rope_theta, partial_rotary_factor (+ mrope_section, mrope_interleaved), sorted.
    rope: tuple[tuple[str, object], ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    vision: VisionArch | None
    # MoE layout fields that change the graph: qwen3_next may skip top-k renormalisation and place dense layers.
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # The positions the model was trained for; NxDI's configs require it (get_required_attributes of both ports).
    max_position_embeddings: int | None = None
    # host-side (HOST_FIELDS): not in the fingerprint
    pad_token_id: int | None = None
    image_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_rope_theta: float = 10000.0
    eos_token_id: int | None = None

    HOST_FIELDS = ("pad_token_id", "image_token_id", "vision_start_token_id", "vision_rope_theta", "eos_token_id")

    @property
    def is_moe(self) -> bool:
        return self.family in MOE_FAMILIES

    @property
    def text_model_type(self) -> str:
        return TEXT_MODEL_TYPES[self.family]

    @property
    def num_attn_layers(self) -> int:
        return sum(t == "full_attention" for t in self.layer_types)

    def is_full_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == "full_attention"

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def key_dim(self) -> int:
        """DeltaNet: all key heads side by side."""
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        """DeltaNet: all value heads side by side."""
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """DeltaNet conv channels: [Q all heads | K all heads | V all heads]."""
        return 2 * self.key_dim + self.value_dim

    def per_rank(self, tp: int) -> "Arch":
        """One of `tp` tensor-parallel ranks' share: every head count divided by tp, kv heads at least one (they
        are replicated where tp exceeds them), so that key_dim, conv_dim, ... are the rank's. The caller has
        checked that tp splits the heads."""
        return replace(self, num_heads=self.num_heads // tp, num_kv_heads=max(1, self.num_kv_heads // tp),
                       num_k_heads=self.num_k_heads // tp, num_v_heads=self.num_v_heads // tp)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether `layer` has a sparse MoE block (else a dense MLP)."""
        return _is_moe_layer(layer, self.is_moe, self.decoder_sparse_step, self.mlp_only_layers)

    @property
    def moe_layers(self) -> frozenset[int]:
        return frozenset(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def rope_params(self) -> dict:
        return dict(self.rope)

    @property
    def rope_theta(self) -> float:
        return self.rope_params["rope_theta"]

    @property
    def rotary_dim(self) -> int:
        """The dims of each attention head that RoPE rotates (the first ones; the rest pass through)."""
        return int(self.head_dim * self.rope_params["partial_rotary_factor"])

    @property
    def mrope_section(self) -> tuple[int, ...] | None:
        """Rotary frequencies per (t, h, w) position axis; None: plain 1-D RoPE."""
        return self.rope_params.get("mrope_section")

    @property
    def mrope_interleaved(self) -> bool:
        return bool(self.rope_params.get("mrope_interleaved", False))

    def fingerprint(self) -> dict:
        """The JSON-able allow-list that enters compile keys (every field but the host-side ones)."""
        # Field by field, not asdict(self): the values are immutable (numbers, strings, tuples), so only the vision
        # encoder needs converting, and the planner asks once per compiled graph (asdict was most of its time).
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in self.HOST_FIELDS}
        d["vision"] = None if self.vision is None else asdict(self.vision)
        d["rope"] = dict(self.rope)
        return d

    @classmethod
    def from_fingerprint(cls, fp: dict) -> "Arch":
        """The Arch whose fingerprint() is `fp` (also after a JSON round trip; "vision" may be absent, as in
        the text graphs' compile params). Host-side fields take their defaults."""
        names = {f.name for f in fields(cls)} - set(cls.HOST_FIELDS)
        d = {k: _tuple(v) for k, v in fp.items() if k in names and k not in ("rope", "vision")}
        vision = fp.get("vision")
        return cls(**d, rope=tuple(sorted((k, _tuple(v)) for k, v in fp["rope"].items())),
                   vision=VisionArch.from_fingerprint(vision) if vision else None)

    def to_hf_config(self) -> dict:
        """A transformers-5 config.json of this architecture (what NxDI's config loader reads).

        arch_from_config(arch.to_hf_config()) == arch for every fingerprint field.
        """
        text = {"model_type": self.text_model_type, "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
                "num_hidden_layers": self.num_layers, "layer_types": list(self.layer_types),
                "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "linear_num_key_heads": self.num_k_heads,
                "linear_num_value_heads": self.num_v_heads, "linear_key_head_dim": self.k_head_dim,
                "linear_value_head_dim": self.v_head_dim, "linear_conv_kernel_dim": self.conv_kernel,
                "rms_norm_eps": self.rms_norm_eps,
                "rope_parameters": {k: list(v) if isinstance(v, tuple) else v for k, v in self.rope},
                "tie_word_embeddings": self.tie_word_embeddings, "hidden_act": "silu"}
        if self.intermediate_size is not None:
            text["intermediate_size"] = self.intermediate_size
        if self.is_moe:
            text.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                        moe_intermediate_size=self.moe_intermediate_size,
                        shared_expert_intermediate_size=self.shared_intermediate_size,
                        norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=self.decoder_sparse_step,
                        mlp_only_layers=list(self.mlp_only_layers))
        if self.max_position_embeddings is not None:
            text["max_position_embeddings"] = self.max_position_embeddings
        if self.pad_token_id is not None:
            text["pad_token_id"] = self.pad_token_id
        if self.family == "qwen3_next":
            return text
        config = {"model_type": self.family, "text_config": text, "tie_word_embeddings": self.tie_word_embeddings}
        if self.vision is not None:
            config["vision_config"] = {**self.vision.to_hf_config(),
                                       "rope_parameters": {"rope_type": "axial", "rope_theta": self.vision_rope_theta}}
        for key in ("image_token_id", "vision_start_token_id"):
            if getattr(self, key) is not None:
                config[key] = getattr(self, key)
        return config

    def param_counts(self) -> tuple[int, int]:
        """(parameters outside routed experts, parameters of routed experts) of the text model."""
        h = self.hidden_size
        attn = h * self.num_heads * self.head_dim * 2 + 2 * h * self.num_kv_heads * self.head_dim
        attn += self.num_heads * self.head_dim * h
        kd, vd = self.key_dim, self.value_dim
        delta = h * (2 * kd + vd) + h * vd + 2 * h * self.num_v_heads + vd * h
        if self.is_moe:
            mlp = 3 * h * self.shared_intermediate_size + h * self.num_experts + h
            experts = 3 * h * self.moe_intermediate_size * self.num_experts
        else:
            mlp, experts = 3 * h * self.intermediate_size, 0
        dense = self.num_attn_layers * attn + (self.num_layers - self.num_attn_layers) * delta
        dense += self.num_layers * mlp + self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return dense, experts * self.num_layers


# --- reading config.json -------------------------------------------------------------------------------------

_REQUIRED = object()


class _Section:
    """Typed reads of one config section; errors name the file, the field (with its section) and the model_type.

    A field set to null counts as absent (HF writes null for unset optional fields)."""

    def __init__(self, section: dict, origin: str, where: str, model_type: str):
        self.section, self.origin, self.where, self.model_type = section, origin, where, model_type

    def fail(self, key: str, what: str) -> ConfigError:
        return ConfigError(self.origin, self.where + key, f"{self.where}{key} {what}")

    def raw(self, key: str, default=_REQUIRED):
        value = self.section.get(key)
        if value is None:
            if default is _REQUIRED:
                raise self.fail(key, f"is missing (model_type {self.model_type} needs it)")
            return default
        return value

    def int(self, key: str, default=_REQUIRED) -> int:
        value = self.raw(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise self.fail(key, f"must be a non-negative integer, got {value!r}")
        return value

    def float(self, key: str, default=_REQUIRED, value=None) -> float:
        value = self.raw(key, default) if value is None else value
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise self.fail(key, f"must be a number, got {value!r}")
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, f"must be true or false, got {value!r}")
        return value

    def ints(self, key: str) -> tuple[int, ...]:
        value = self.raw(key, [])
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise self.fail(key, f"must be a list of integers, got {value!r}")
        return tuple(value)

    def object(self, key: str) -> dict | None:
        value = self.section.get(key)
        if value is not None and not isinstance(value, dict):
            raise self.fail(key, f"must be an object, got {value!r}")
        return value

    def optional_id(self, key: str, fallback: dict | None = None) -> int | None:
        value = self.section[key] if key in self.section else (fallback or {}).get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None


def _layer_types(f: _Section, num_layers: int) -> tuple[str, ...]:
    types = f.raw("layer_types", None)
    if types is None:  # the older form (and HF's default): every `full_attention_interval`-th layer is full
        interval = f.int("full_attention_interval", 4)
        if interval == 0:
            raise f.fail("full_attention_interval", "must be a positive integer, got 0")
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if (not isinstance(types, list) or len(types) != num_layers
            or not all(t in ("full_attention", "linear_attention") for t in types)):
        raise f.fail("layer_types", f"must list full_attention / linear_attention for each of the {num_layers} "
                                    "layers")
    return tuple(types)


def _rope(f: _Section, family: str) -> tuple[tuple[str, object], ...]:
    """The normalised rope of either form: rope_parameters (transformers 5), else rope_scaling plus top-level
    rope_theta / partial_rotary_factor; a key in rope_parameters wins over the same key elsewhere. mRoPE follows
    transformers: interleaved with a default section for MROPE_FAMILIES, absent for the others."""
    params: dict = {}
    for key in ("rope_scaling", "rope_parameters"):
        params.update(f.object(key) or {})
    source = "rope_parameters" if f.section.get("rope_parameters") else "rope_scaling"
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f.origin, f"{f.where}{source}.rope_type", f"{f.where}{source}: rope_type {rope_type!r} "
                                                                    f"is not supported (only {' / '.join(ROPE_TYPES)})")
    def number(key: str, default: float) -> float:  # from the rope dict where it has the key, else top level
        return f.float(f"{source}.{key}" if key in params else key, default, value=params.get(key))

    theta, partial = number("rope_theta", 10000.0), number("partial_rotary_factor", 1.0)
    rope: dict = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": partial}
    if family not in MROPE_FAMILIES:
        return tuple(sorted(rope.items()))
    section = params.get("mrope_section") or list(DEFAULT_MROPE_SECTION)
    if (not isinstance(section, list) or len(section) != 3
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in section)):
        raise f.fail(f"{source}.mrope_section", f"must be a list of 3 non-negative integers, got {section!r}")
    if params.get("mrope_interleaved", True) is not True:
        raise f.fail(f"{source}.mrope_interleaved", f"is {params['mrope_interleaved']!r}, but transformers' "
                                                    f"{family} always interleaves mRoPE; set it to true or remove it")
    rope.update(mrope_section=tuple(section), mrope_interleaved=True)
    return tuple(sorted(rope.items()))


def _check_token_ids(sections: list[_Section], vocab_size: int) -> None:
    """Every token id a config names must index the vocabulary (an id past it fails deep in a build)."""
    for f in sections:
        for key in TOKEN_ID_FIELDS:
            value = f.section.get(key)
            for token in value if isinstance(value, list) else [] if value is None else [value]:
                if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
                    raise f.fail(key, f"is {value!r}; token ids must be integers below vocab_size {vocab_size}")


def _model_type(config: dict, origin: str) -> tuple[str, str, bool]:
    """(model_type, family, whether it is a VL wrapper) of a config."""
    if not isinstance(config, dict):
        raise ConfigError(origin, "", "is not a JSON object")
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(origin, "model_type", f"model_type {model_type!r} is not supported; qbuild builds "
                                                f"{', '.join(MODEL_TYPES)}")
    return (model_type, *MODEL_TYPES[model_type])


def vision_from_config(config: dict, origin: str = "config.json") -> tuple[VisionArch, dict] | None:
    """The vision encoder of a VL wrapper (None where the config has no vision_config), and its host-side facts
    {"vision_rope_theta", "image_token_id", "vision_start_token_id"} (ids None where absent).

    Reads model_type and vision_config only, so that a vision graph's config needs no text_config.
    """
    model_type, _, wrapped = _model_type(config, origin)
    top = _Section(config, origin, "", model_type)
    section = top.object("vision_config") if wrapped else None
    if section is None:
        return None
    f = _Section(section, origin, "vision_config.", model_type)
    act = f.raw("hidden_act", VISION_HIDDEN_ACT)
    if act != VISION_HIDDEN_ACT:
        raise f.fail("hidden_act", f"{act!r} is not supported (expected {VISION_HIDDEN_ACT})")
    vision = VisionArch(
        depth=f.int("depth"), hidden_size=f.int("hidden_size"), num_heads=f.int("num_heads"),
        intermediate_size=f.int("intermediate_size"), out_hidden_size=f.int("out_hidden_size"),
        patch_size=f.int("patch_size", 16), temporal_patch_size=f.int("temporal_patch_size", 2),
        spatial_merge_size=f.int("spatial_merge_size", 2),
        num_position_embeddings=f.int("num_position_embeddings", 2304), in_channels=f.int("in_channels", 3))
    rope = f.object("rope_parameters") or {}
    return vision, {"vision_rope_theta": f.float("rope_parameters.rope_theta", 10000.0, value=rope.get("rope_theta")),
                    "image_token_id": top.optional_id("image_token_id"),
                    "vision_start_token_id": top.optional_id("vision_start_token_id")}


def arch_from_config(config: dict, origin: str = "config.json") -> Arch:
    """Normalise a HF config (a VL wrapper or a text-only one, either config form) into an Arch.

    `origin` names the file in errors: a ConfigError (a UserError) of one line naming it and the field.
    """
    model_type, family, wrapped = _model_type(config, origin)
    top = _Section(config, origin, "", model_type)
    if wrapped:
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise top.fail("text_config", "is missing or not an object")
        f = _Section(text, origin, "text_config.", model_type)
    else:
        text, f = config, top
    moe = family in MOE_FAMILIES
    n = f.int("num_hidden_layers")
    layer_types = _layer_types(f, n)
    heads, hidden = f.int("num_attention_heads"), f.int("hidden_size")
    # Only Qwen3-Next's config places dense layers; transformers' Qwen3.5-MoE has no such fields (all MoE).
    sparse_fields = family == "qwen3_next"
    step = (f.int("decoder_sparse_step", 1) or 1) if sparse_fields else 1
    mlp_only = f.ints("mlp_only_layers") if sparse_fields else ()
    has_dense = not all(_is_moe_layer(i, moe, step, mlp_only) for i in range(n))
    vision, host = vision_from_config(config, origin) or (None, {})
    tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    vocab_size = f.int("vocab_size")
    _check_token_ids([top, f] if wrapped else [f], vocab_size)
    max_positions = f.raw("max_position_embeddings", None)
    if max_positions is not None:
        max_positions = f.int("max_position_embeddings")
    return Arch(
        family=family, vocab_size=vocab_size, hidden_size=hidden, num_layers=n, layer_types=layer_types,
        num_heads=heads, num_kv_heads=f.int("num_key_value_heads"),
        head_dim=f.int("head_dim", hidden // heads if heads else 0),
        # An MoE model's dense MLP size matters only where it has dense layers.
        intermediate_size=f.int("intermediate_size") if has_dense else None,
        num_k_heads=f.int("linear_num_key_heads"), num_v_heads=f.int("linear_num_value_heads"),
        k_head_dim=f.int("linear_key_head_dim"), v_head_dim=f.int("linear_value_head_dim"),
        conv_kernel=f.int("linear_conv_kernel_dim", 4),
        num_experts=f.int("num_experts") if moe else None,
        num_experts_per_tok=f.int("num_experts_per_tok") if moe else None,
        moe_intermediate_size=f.int("moe_intermediate_size") if moe else None,
        shared_intermediate_size=f.int("shared_expert_intermediate_size") if moe else None,
        rope=_rope(f, family), rms_norm_eps=f.float("rms_norm_eps", 1e-6), tie_word_embeddings=bool(tie),
        vision=vision,
        # qwen3_5_moe always renormalises the top-k weights; qwen3_next only if norm_topk_prob.
        norm_topk_prob=f.bool("norm_topk_prob", True) if family == "qwen3_next" else True,
        decoder_sparse_step=step, mlp_only_layers=mlp_only,
        max_position_embeddings=max_positions,
        pad_token_id=f.optional_id("pad_token_id", config), eos_token_id=f.optional_id("eos_token_id", config), **host)


def shipped_config_path(repo: str) -> Path:
    return _SHIPPED / (repo.replace("/", "--") + ".json")


def hf_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hub"


def hf_cached_snapshot(repo: str, revision: str) -> tuple[str, Path] | None:
    """(commit, snapshot dir) of `repo` at `revision` in the local HF cache, without importing huggingface_hub."""
    repo_dir = hf_cache_dir() / ("models--" + repo.replace("/", "--"))
    commit = revision
    if not (len(revision) == 40 and all(c in "0123456789abcdef" for c in revision)):
        ref = repo_dir / "refs" / revision
        if not ref.is_file():
            return None
        commit = ref.read_text().strip()
    snap = repo_dir / "snapshots" / commit
    return (commit, snap) if snap.is_dir() else None


def config_for(loaded: LoadedRecipe) -> tuple[dict, str]:
    """The config.json a recipe's model has, and where it was read: the local dir, the HF cache, or the shipped copy."""
    src = loaded.recipe.model
    if src.path is not None:
        cfg = loaded.source_dir / "config.json"
        where = f"{loaded.path}: model.path"
        if not loaded.source_dir.is_dir():
            raise RecipeError(f"{recipe_field_location(loaded, 'model.path')}: model.path: "
                              f"{loaded.source_dir} is not a directory")
    else:
        cached = hf_cached_snapshot(src.hf, src.revision)
        cfg = cached[1] / "config.json" if cached and (cached[1] / "config.json").exists() else \
            shipped_config_path(src.hf)
        where = f"{loaded.path}: model.hf"
        if not cfg.exists():
            raise RecipeError(f"{recipe_field_location(loaded, 'model.hf')}: model.hf: {src.hf} is neither in the "
                              f"HF cache nor a shipped config; download it first or use `path:`")
    raw = read_small_file(cfg, MAX_CONFIG_BYTES, "config.json")
    try:
        return json.loads(raw), str(cfg)
    except ValueError as e:   # invalid JSON or not UTF-8
        raise UserError(f"{cfg}: cannot read config.json ({where}): {e}") from None


def load_arch(loaded: LoadedRecipe) -> Arch:
    config, origin = config_for(loaded)
    return arch_from_config(config, origin)


# --- recipe checks that need the architecture ---------------------------------------------------------------

def _fail(loaded: LoadedRecipe, field: str, msg: str) -> None:
    raise RecipeError(f"{recipe_field_location(loaded, field)}: {field}: {msg}")


def validate(loaded: LoadedRecipe, arch: Arch) -> None:
    """Raise RecipeError for the first recipe field the architecture cannot support."""
    r = loaded.recipe
    tp, ep = r.parallel.tp, r.parallel.ep
    if arch.num_heads % tp:
        _fail(loaded, "parallel.tp", f"tp={tp} does not divide the {arch.num_heads} attention heads")
    if tp > arch.num_kv_heads and tp % arch.num_kv_heads:
        _fail(loaded, "parallel.tp", f"tp={tp} is not a multiple of the {arch.num_kv_heads} KV heads "
                                     "(they are replicated when tp exceeds them)")
    if tp < arch.num_kv_heads and arch.num_kv_heads % tp:
        _fail(loaded, "parallel.tp", f"tp={tp} does not divide the {arch.num_kv_heads} KV heads")
    for heads, what in ((arch.num_k_heads, "DeltaNet key heads"), (arch.num_v_heads, "DeltaNet value heads")):
        if heads % tp:
            _fail(loaded, "parallel.tp", f"tp={tp} does not divide the {heads} {what}")
    if arch.is_moe:
        if arch.num_experts % ep:
            _fail(loaded, "parallel.ep", f"ep={ep} does not divide the {arch.num_experts} experts")
        moe_tp = r.parallel.effective_moe_tp
        if arch.moe_intermediate_size % moe_tp:
            _fail(loaded, "parallel.moe_tp", f"moe_tp={moe_tp} does not divide the expert intermediate size "
                                             f"{arch.moe_intermediate_size}")
    else:
        if ep != 1:
            _fail(loaded, "parallel.ep", f"ep={ep} needs an MoE model; {arch.family} is dense")
        if r.moe_backend is not None:
            _fail(loaded, "moe_backend", f"{arch.family} is dense and has no MoE backend")
        if arch.intermediate_size % tp:
            _fail(loaded, "parallel.tp", f"tp={tp} does not divide the MLP intermediate size {arch.intermediate_size}")
    if r.fp8 not in FP8_POLICIES[arch.family]:
        _fail(loaded, "fp8", f"{r.fp8!r} is not supported for {arch.family}; use one of "
                             f"{', '.join(FP8_POLICIES[arch.family])}")
    if r.vision is not None:
        if arch.vision is None:
            _fail(loaded, "vision", f"{arch.family} checkpoint has no vision encoder")
        merge = arch.vision.spatial_merge_size ** 2
        for i, b in enumerate(r.vision.buckets):
            if b % merge:
                _fail(loaded, f"vision.buckets.{i}", f"{b} patch tokens is not a multiple of {merge} "
                                                     "(the 2x2 spatial merge)")
    if arch.max_position_embeddings is not None and r.text.seq_len > arch.max_position_embeddings:
        _fail(loaded, "text.seq_len", f"{r.text.seq_len} exceeds the model's max_position_embeddings "
                                      f"{arch.max_position_embeddings}")
    est = rank_memory_bytes(loaded, arch)
    limit = _HBM_PER_RANK_GIB.get((r.compiler.target, r.compiler.effective_lnc))
    if limit is not None and est > limit << 30:
        _fail(loaded, "parallel.tp", f"needs ~{est / 2**30:.1f} GiB per rank (weights + KV cache + DeltaNet "
                                     f"state), over the {limit} GiB of a {r.compiler.target} LNC"
                                     f"{r.compiler.effective_lnc} rank; raise tp")
    if r.backend == "neuron":
        _validate_neuron(loaded, arch)


# The lineages whose public port serves each family (qbuild.ports; nxdi-api.md section 1): the moe lineage's module
# is written for the MoE text model only, and the main lineage's for the Qwen3.5 model types.
_PORT_LINEAGES = {"qwen3_5": ("main",), "qwen3_5_moe": ("main", "moe"), "qwen3_next": ("moe",)}


def _validate_neuron(loaded: LoadedRecipe, arch: Arch) -> None:
    """The checks that only a neuron build needs: a port that can serve the recipe, and a pinned toolchain."""
    from .ports import LINEAGES, lineage_for

    r = loaded.recipe
    lineage = lineage_for(arch.family, r.port.lineage)
    if lineage.name not in _PORT_LINEAGES[arch.family]:
        _fail(loaded, "port.lineage", f"the {lineage.name} lineage has no port for {arch.family}; use "
                                      f"{' or '.join(_PORT_LINEAGES[arch.family])}")
    if r.port.path is None and r.port.module is None:
        _fail(loaded, "port", "a neuron build runs an NxDI contrib port: set port.path (the port directory, e.g. a "
                              "checkout of contrib/models/<Port>) or port.module")
    if r.fp8 == "full":
        _fail(loaded, "fp8", "a neuron build makes the FP8 port's mlp_only configuration (PR 173); full is for the "
                             "CPU backends")
    if r.fp8 != "none" and arch.is_moe:
        # The FP8 port is dense; NxD reads per-expert scales only as expert_wise_per_channel_symmetric, which no
        # public port configures.
        _fail(loaded, "fp8", f"no public NxDI port builds FP8 experts; {arch.family} builds with fp8: none on neuron")
    if r.vision is not None and LINEAGES[lineage.name].vision_module is None:
        _fail(loaded, "vision", f"the {lineage.name}-lineage port has no vision encoder; drop vision or use main")
    if r.parallel.ep > 1:
        # NxD's ExpertMLPsV2 refuses EP in selective-loading decode (it raises) (expert_mlps_v2.py @
        # fbac349; Qwen3.5-35B-A3B README). Coder-Next's README works around it with a patch of
        # ExpertMLPsV2.forward that is in no public commit of the port (PR 170 @ 753c7f5).
        _fail(loaded, "parallel.ep", f"no public {lineage.name}-lineage port runs expert parallelism in decode "
                                     "(NxD refuses it without an unpublished patch); use ep: 1")
    for dist, version in r.toolchain.pins().items():
        if version is None:
            _fail(loaded, "toolchain", f"a neuron build pins the Neuron SDK: set toolchain.{dist.replace('-', '_')} "
                                       "(see recipes/bases/trn2.yaml)")


def moe_backend(loaded: LoadedRecipe, arch: Arch) -> str | None:
    if not arch.is_moe:
        return None
    return loaded.recipe.moe_backend or DEFAULT_MOE_BACKEND[arch.family]


def weight_bytes(arch: Arch, dtype: str, fp8: str) -> int:
    dense, experts = arch.param_counts()
    b = DTYPE_BYTES[dtype]
    # FP8 stores one byte per quantised weight; experts are the MLP weights of the MoE families.
    mlp_bytes = 1 if fp8 != "none" else b
    if arch.is_moe:
        return dense * b + experts * mlp_bytes
    mlp = 3 * arch.hidden_size * arch.intermediate_size * arch.num_layers
    return (dense - mlp) * b + mlp * mlp_bytes


def rank_memory_bytes(loaded: LoadedRecipe, arch: Arch) -> int:
    """Estimated device memory of one rank: its weight shard, its KV cache and its DeltaNet state."""
    r = loaded.recipe
    tp, b = r.parallel.tp, DTYPE_BYTES[r.dtype]
    weights = weight_bytes(arch, r.dtype, r.fp8) // tp
    kv_heads = max(1, arch.num_kv_heads // tp)
    kv = 2 * r.text.batch_size * r.text.seq_len * kv_heads * arch.head_dim * b * arch.num_attn_layers
    n_delta = arch.num_layers - arch.num_attn_layers
    state = r.text.batch_size * n_delta * ((arch.num_v_heads // tp) * arch.k_head_dim * arch.v_head_dim * 4
                                            + (arch.conv_dim // tp) * (arch.conv_kernel - 1) * b)
    return weights + kv + state
