"""The config.json schema: one pydantic model per config family, the one place that says which fields qbuild reads,
their types, ranges and the relations between them.

- the text model of each family: Qwen35Text (qwen3_5_text), Qwen35MoeText (qwen3_5_moe_text), Qwen3NextConfig
  (qwen3_next); each is also the whole config of its text-only model_type;
- the VL wrappers (qwen3_5, qwen3_5_moe): the text model under `text_config`, the vision encoder (VisionConfig)
  under `vision_config`, and the token ids the host uses.

Every field that shapes a graph or the weights is checked here, before anything is recorded: a config that passes
builds a model that the converter, the reference model and the NxDI config accept. The relations follow the model
code (qbuild.model.modeling, .kernels, .convert) and transformers' config classes. Fields qbuild does not read are
ignored, and a field set to null counts as absent (HF writes null for unset optional fields).

`validated` turns a pydantic error into a ConfigError of one line naming the file and the field as the user finds
it in config.json (`text_config.num_key_value_heads`, `vision_config.spatial_merge_size`, `layer_types[5]`).
qbuild.model.arch builds the Arch from the models returned here.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import (BaseModel, ConfigDict, Field, FiniteFloat, StrictBool, StrictInt, StrictStr, ValidationError,
                      model_validator)

from qbuild.core.errors import ConfigError
from qbuild.model.families import FAMILIES, MODEL_TYPES, FamilyName

VISION_HIDDEN_ACT = "gelu_pytorch_tanh"   # the encoder activation qbuild's vision model implements

ROPE_TYPES = ("default", "mrope")  # "mrope" is the older name of default RoPE with an mrope_section
# transformers' Qwen3.5 text rotary takes mrope_section from rope_parameters with this default.
DEFAULT_MROPE_SECTION = (11, 11, 10)
# Config fields holding token ids (eos_token_id may list several). Each indexes the embedding.
TOKEN_ID_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                   "eos_token_id", "bos_token_id", "pad_token_id")

# Strict: JSON true or "64" must not pass as a number (pydantic's lax mode would take them).
PositiveInt = Annotated[StrictInt, Field(gt=0)]
NonNegativeInt = Annotated[StrictInt, Field(ge=0)]
PositiveFloat = Annotated[FiniteFloat, Field(gt=0, strict=True)]
RotaryFraction = Annotated[FiniteFloat, Field(gt=0, le=1, strict=True)]
TokenIds = StrictInt | list[StrictInt]
LayerType = Literal["full_attention", "linear_attention"]


class _Invalid(ValueError):
    """A broken relation between fields; `field` is the key, relative to the model that raises it, to blame."""

    def __init__(self, field: str, what: str):
        super().__init__(f"{field} {what}")
        self.field, self.what = field, what


class _Section(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data):
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class _TokenIds(_Section):
    image_token_id: TokenIds | None = None
    video_token_id: TokenIds | None = None
    vision_start_token_id: TokenIds | None = None
    vision_end_token_id: TokenIds | None = None
    eos_token_id: TokenIds | None = None
    bos_token_id: TokenIds | None = None
    pad_token_id: TokenIds | None = None

    def check_token_ids(self, vocab_size: int) -> None:
        """Every token id must index the vocabulary (an id past it fails deep in a build)."""
        for key in TOKEN_ID_FIELDS:
            value = getattr(self, key)
            ids = value if isinstance(value, list) else [] if value is None else [value]
            if not all(0 <= token < vocab_size for token in ids):
                raise _Invalid(key, f"is {value!r}; token ids must be integers below vocab_size {vocab_size}")

    def single_id(self, key: str) -> int | None:
        """A token id the host uses as one id (a list, as eos_token_id may be, gives None)."""
        value = getattr(self, key)
        return value if isinstance(value, int) else None


# --- rope ---------------------------------------------------------------------------------------------------------

class _Rope(_Section):
    """rope_parameters (transformers 5) or the older rope_scaling."""

    rope_type: StrictStr | None = None
    type: StrictStr | None = None   # the older rope_scaling's name for rope_type
    rope_theta: PositiveFloat | None = None
    partial_rotary_factor: RotaryFraction | None = None


class _MRope(_Rope):
    mrope_section: Annotated[list[NonNegativeInt], Field(min_length=3, max_length=3)] | None = None
    mrope_interleaved: StrictBool | None = None


# --- the text models ----------------------------------------------------------------------------------------------

class _Text(_TokenIds):
    """The fields every family's text model has. Defaults are qbuild's reading of an absent field."""

    family: ClassVar[FamilyName]

    vocab_size: PositiveInt
    hidden_size: PositiveInt
    num_hidden_layers: PositiveInt
    layer_types: list[LayerType] | None = None
    full_attention_interval: PositiveInt = 4   # the older form of layer_types
    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt
    head_dim: PositiveInt | None = None
    intermediate_size: PositiveInt | None = None
    linear_num_key_heads: PositiveInt
    linear_num_value_heads: PositiveInt
    linear_key_head_dim: PositiveInt
    linear_value_head_dim: PositiveInt
    linear_conv_kernel_dim: PositiveInt = 4
    # The model, the converter's NxDI config and transformers' port all use SiLU; another value would build a
    # model that silently differs from the checkpoint's.
    hidden_act: Literal["silu"] = "silu"
    rms_norm_eps: PositiveFloat = 1e-6
    rope_parameters: _Rope | None = None
    rope_scaling: _Rope | None = None
    rope_theta: PositiveFloat | None = None
    partial_rotary_factor: RotaryFraction | None = None
    max_position_embeddings: PositiveInt | None = None
    tie_word_embeddings: StrictBool | None = None

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """layer_types, or the older form's (and HF's default): every full_attention_interval-th layer is full."""
        if self.layer_types is not None:
            return tuple(self.layer_types)
        interval = self.full_attention_interval
        return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                     for i in range(self.num_hidden_layers))

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    def _rope_value(self, key: str, default):
        """(value, its path in the section) of a rope key: rope_parameters wins over rope_scaling, and both over a
        top-level rope_theta / partial_rotary_factor. The path is None where the default applies."""
        for name in ("rope_parameters", "rope_scaling"):
            value = getattr(getattr(self, name), key, None)
            if value is not None:
                return value, f"{name}.{key}"
        value = getattr(self, key, None) if key in ("rope_theta", "partial_rotary_factor") else None
        return (default, None) if value is None else (value, key)

    def _rope_type(self) -> tuple[str, str | None]:
        rope_type, path = self._rope_value("rope_type", None)
        return (rope_type, path) if rope_type is not None else self._rope_value("type", "default")

    def rope(self) -> dict:
        """The normalised rope: rope_type, rope_theta, partial_rotary_factor, and for the mRoPE families
        mrope_section and mrope_interleaved (transformers: always interleaved, with a default section)."""
        rope = {"rope_type": "default", "rope_theta": self._rope_value("rope_theta", 10000.0)[0],
                "partial_rotary_factor": self._rope_value("partial_rotary_factor", 1.0)[0]}
        if FAMILIES[self.family].mrope:
            section = self._rope_value("mrope_section", DEFAULT_MROPE_SECTION)[0]
            rope.update(mrope_section=tuple(section), mrope_interleaved=True)
        return rope

    @model_validator(mode="after")
    def _relations(self):
        n = self.num_hidden_layers
        if self.layer_types is not None and len(self.layer_types) != n:
            raise _Invalid("layer_types", f"must list full_attention / linear_attention for each of the {n} layers "
                                          f"(num_hidden_layers), got {len(self.layer_types)} entries")
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads % kv:
            raise _Invalid("num_key_value_heads", f"must divide num_attention_heads {heads} (each KV head serves a "
                                                  f"group of query heads), got {kv}")
        if self.head_dim is None and self.hidden_size % heads:
            raise _Invalid("head_dim", f"is missing and hidden_size {self.hidden_size} does not split into "
                                       f"num_attention_heads {heads} heads")
        k, v = self.linear_num_key_heads, self.linear_num_value_heads
        if v % k:
            raise _Invalid("linear_num_value_heads", f"is {v}: DeltaNet value heads must be a multiple of the {k} "
                                                     "key heads (linear_num_key_heads)")
        rope_type, path = self._rope_type()
        if rope_type not in ROPE_TYPES:
            raise _Invalid(path, f"{rope_type!r} is not supported (only {' / '.join(ROPE_TYPES)})")
        partial, path = self._rope_value("partial_rotary_factor", 1.0)
        rotary = int(self.attention_head_dim * partial)
        if rotary < 2 or rotary % 2:
            raise _Invalid(path or "head_dim", f"gives {rotary} rotary dims (head_dim {self.attention_head_dim} x "
                                               f"partial_rotary_factor {partial}); RoPE rotates pairs, so they "
                                               "must be even and at least 2")
        if FAMILIES[self.family].mrope:
            interleaved, path = self._rope_value("mrope_interleaved", True)
            if interleaved is not True:
                raise _Invalid(path, f"is {interleaved!r}, but transformers' {self.family} always interleaves "
                                     "mRoPE; set it to true or remove it")
        self.check_token_ids(self.vocab_size)
        return self


class _Experts(_Text):
    """Routed experts and a shared expert in place of the dense MLP."""

    num_experts: PositiveInt
    num_experts_per_tok: PositiveInt
    moe_intermediate_size: PositiveInt
    shared_expert_intermediate_size: PositiveInt

    @model_validator(mode="after")
    def _top_k(self):
        if self.num_experts_per_tok > self.num_experts:
            raise _Invalid("num_experts_per_tok", f"is {self.num_experts_per_tok}, but the router picks among "
                                                  f"num_experts {self.num_experts}")
        return self


class Qwen35Text(_Text):
    family: ClassVar[FamilyName] = "qwen3_5"
    intermediate_size: PositiveInt
    rope_parameters: _MRope | None = None
    rope_scaling: _MRope | None = None


class Qwen35MoeText(_Experts):
    """transformers' Qwen3.5-MoE reads no dense-layer fields: every layer is MoE, top-k renormalised."""

    family: ClassVar[FamilyName] = "qwen3_5_moe"
    rope_parameters: _MRope | None = None
    rope_scaling: _MRope | None = None


class Qwen3NextConfig(_Experts):
    """Qwen3-Next places dense layers (decoder_sparse_step, mlp_only_layers) and may skip top-k renormalisation."""

    family: ClassVar[FamilyName] = "qwen3_next"
    norm_topk_prob: StrictBool = True
    decoder_sparse_step: PositiveInt = 1
    mlp_only_layers: list[NonNegativeInt] = []

    def moe_layer(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @model_validator(mode="after")
    def _layout(self):
        n = self.num_hidden_layers
        outside = [layer for layer in self.mlp_only_layers if layer >= n]
        if outside:
            raise _Invalid("mlp_only_layers", f"names layer {outside[0]}, but num_hidden_layers is {n} "
                                              f"(layers 0 to {n - 1})")
        dense = [layer for layer in range(n) if not self.moe_layer(layer)]
        if dense and self.intermediate_size is None:
            raise _Invalid("intermediate_size", f"is missing; layers {dense[:4]}{'...' if len(dense) > 4 else ''} "
                                                "have a dense MLP (mlp_only_layers, decoder_sparse_step)")
        return self


# --- the vision encoder and the VL wrappers -----------------------------------------------------------------------

class _VisionRope(_Section):
    rope_theta: PositiveFloat = 10000.0


class VisionConfig(_Section):
    depth: PositiveInt
    hidden_size: PositiveInt
    num_heads: PositiveInt
    intermediate_size: PositiveInt
    out_hidden_size: PositiveInt
    patch_size: PositiveInt = 16
    temporal_patch_size: PositiveInt = 2
    spatial_merge_size: PositiveInt = 2
    num_position_embeddings: PositiveInt = 2304
    in_channels: PositiveInt = 3
    hidden_act: Literal[VISION_HIDDEN_ACT] = VISION_HIDDEN_ACT
    rope_parameters: _VisionRope = _VisionRope()

    @model_validator(mode="after")
    def _heads(self):
        if self.hidden_size % self.num_heads:
            raise _Invalid("num_heads", f"must divide hidden_size {self.hidden_size}, got {self.num_heads}")
        # The 2-D rotary gives each of the row and the column a quarter of the head's dims as rotated pairs.
        head_dim = self.hidden_size // self.num_heads
        if head_dim % 4:
            raise _Invalid("num_heads", f"is {self.num_heads}: hidden_size {self.hidden_size} / num_heads gives "
                                        f"head dim {head_dim}; the 2-D rotary needs a multiple of 4")
        return self


class _Wrapper(_TokenIds):
    text_config: _Text
    vision_config: VisionConfig | None = None
    tie_word_embeddings: StrictBool | None = None

    @model_validator(mode="after")
    def _joins(self):
        vision, hidden = self.vision_config, self.text_config.hidden_size
        if vision is not None and vision.out_hidden_size != hidden:
            raise _Invalid("vision_config.out_hidden_size", f"must equal text_config.hidden_size {hidden} (merged "
                                                            f"image features replace token embeddings), got "
                                                            f"{vision.out_hidden_size}")
        self.check_token_ids(self.text_config.vocab_size)
        return self


class Qwen35Config(_Wrapper):
    text_config: Qwen35Text


class Qwen35MoeConfig(_Wrapper):
    text_config: Qwen35MoeText


TEXT_MODELS: dict[FamilyName, type[_Text]] = {m.family: m for m in (Qwen35Text, Qwen35MoeText, Qwen3NextConfig)}
WRAPPERS: dict[FamilyName, type[_Wrapper]] = {"qwen3_5": Qwen35Config, "qwen3_5_moe": Qwen35MoeConfig}
# Every key of the schema: pydantic's error locations also hold union members ('int', 'list[int]'), which are not.
_KEYS = frozenset(name for model in (*TEXT_MODELS.values(), *WRAPPERS.values(), VisionConfig, _MRope, _VisionRope)
                  for name in model.model_fields)


# --- pydantic's errors as one line --------------------------------------------------------------------------------

def _path(loc: tuple) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in _KEYS:
            path += f".{part}" if path else part
    return path


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _what(error: dict, model_type: str) -> str:
    kind, value, ctx = error["type"], error.get("input"), error.get("ctx") or {}
    if kind == "missing":
        return f"is missing (model_type {model_type} needs it)"
    if kind in ("model_type", "dict_type"):
        return f"must be an object, got {_shown(value)}"
    if kind == "too_short":
        return f"must have {ctx['min_length']} items, got {_shown(value)}"
    if kind == "too_long":
        return f"must have at most {ctx['max_length']} items, got {_shown(value)}"
    message = error["msg"]
    if message.startswith("Input should "):
        message = "must " + message.removeprefix("Input should ")
    return f"{message}, got {_shown(value)}"


def _config_error(errors: list[dict], origin: str, model_type: str, where: str) -> ConfigError:
    """The first failing field's error (of a union's alternatives, the one that got furthest into the value)."""
    first = tuple(p for p in errors[0]["loc"] if not isinstance(p, str) or p in _KEYS)
    error = max((e for e in errors
                 if tuple(p for p in e["loc"] if not isinstance(p, str) or p in _KEYS)[:len(first)] == first),
                key=lambda e: len(e["loc"]))
    path = ".".join(p for p in (where, _path(error["loc"])) if p)
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, _Invalid):
        field = ".".join(p for p in (path, cause.field) if p)
        return ConfigError(origin, field, f"{field} {cause.what}")
    return ConfigError(origin, path, f"{path} {_what(error, model_type)}")


def _validate(schema: type[BaseModel], section: dict, origin: str, model_type: str, where: str = ""):
    try:
        return schema.model_validate(section)
    except ValidationError as e:
        raise _config_error(e.errors(include_url=False), origin, model_type, where) from None


def validated(config: dict, origin: str) -> _Text | _Wrapper:
    """The config checked against the schema of its model_type (which the caller has checked is supported):
    the text model of a text-only config, or a VL wrapper holding the text model and vision encoder."""
    entry = MODEL_TYPES[config["model_type"]]
    schema = WRAPPERS[entry.family.name] if entry.wrapped else TEXT_MODELS[entry.family.name]
    return _validate(schema, config, origin, entry.name)


def validated_vision(section: dict, origin: str, model_type: str) -> VisionConfig:
    """A VL wrapper's vision_config alone (a vision graph's config needs no text_config)."""
    return _validate(VisionConfig, section, origin, model_type, "vision_config")
