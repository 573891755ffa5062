"""Architecture facts read from a checkpoint's config.json.

This is the one reader of a HF config.json, and Arch the one architecture type: the planner (its fingerprint in
compile keys), the converter, the reference model and the backends all take the Arch built here. It reads

- the VL wrappers (qwen3_5, qwen3_5_moe: the text model under `text_config`, the vision encoder under
  `vision_config`), their text-only exports (qwen3_5_text, qwen3_5_moe_text) and text-only qwen3_next;
- both the transformers-5 form (`rope_parameters`, `layer_types`) and the older published form (top-level
  `rope_theta` / `partial_rotary_factor`, `rope_scaling`, `full_attention_interval`).

Planning must work offline and without torch, so this module reads JSON only; the family facts it applies come
from qbuild.model.families, and the schema every field is checked against (types, ranges, relations) from
qbuild.model.config. Finding a recipe's config.json is qbuild.hub.source's job, checking a recipe against the
architecture qbuild.recipe.checks'.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from qbuild.core.errors import ConfigError
from qbuild.model.families import FAMILIES, MODEL_TYPES

MAX_CONFIG_BYTES = 4 << 20   # a config.json is a few KiB


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
        from qbuild.model.config import VISION_HIDDEN_ACT

        return {**asdict(self), "hidden_act": VISION_HIDDEN_ACT}

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merged_hidden_size(self) -> int:
        """The width of one merged token: the spatial_merge_size**2 patch tokens it merges, side by side."""
        return self.hidden_size * self.spatial_merge_size ** 2

    def tp_problem(self, tp: int) -> str | None:
        """Why the encoder's linear layers do not split over `tp` ranks (NxD's parallel layers divide the hidden size,
        3 x it for qkv, and the MLP's intermediate size evenly), or None where they do."""
        for size, what in ((self.hidden_size, "hidden size"), (self.intermediate_size, "MLP intermediate size")):
            if size % tp:
                return f"tp={tp} does not divide the vision encoder's {what} {size}"
        return None


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
        return FAMILIES[self.family].moe

    @property
    def text_model_type(self) -> str:
        return FAMILIES[self.family].text_model_type

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

    def text_model(self) -> "Arch":
        """The text model alone, as compile params hold it: no vision encoder, host-side fields at their defaults
        (what from_fingerprint reads back from the params' JSON)."""
        fp = self.fingerprint()
        del fp["vision"]
        return Arch.from_fingerprint(fp)

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
        wrapper = FAMILIES[self.family].vl_model_type
        if wrapper is None:
            return text
        config = {"model_type": wrapper, "text_config": text, "tie_word_embeddings": self.tie_word_embeddings}
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

def _model_type(config: dict, origin: str) -> tuple[str, str, bool]:
    """(model_type, family, whether it is a VL wrapper) of a config."""
    if not isinstance(config, dict):
        raise ConfigError(origin, "", "is not a JSON object")
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(origin, "model_type", f"model_type {model_type!r} is not supported; qbuild builds "
                                                f"{', '.join(MODEL_TYPES)}")
    entry = MODEL_TYPES[model_type]
    return model_type, entry.family.name, entry.wrapped


def _vision_arch(v) -> VisionArch:
    """The VisionArch of a validated qbuild.model.config.VisionConfig."""
    return VisionArch(depth=v.depth, hidden_size=v.hidden_size, num_heads=v.num_heads,
                      intermediate_size=v.intermediate_size, out_hidden_size=v.out_hidden_size,
                      patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
                      spatial_merge_size=v.spatial_merge_size, num_position_embeddings=v.num_position_embeddings,
                      in_channels=v.in_channels)


def _single_id(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text_id(text, top, key: str) -> int | None:
    """A token id of the text model; a wrapper's text_config without it takes the wrapper's."""
    return text.single_id(key) if getattr(text, key) is not None else top.single_id(key)


def vision_from_config(config: dict, origin: str = "config.json") -> tuple[VisionArch, dict] | None:
    """The vision encoder of a VL wrapper (None where the config has no vision_config), and its host-side facts
    {"vision_rope_theta", "image_token_id", "vision_start_token_id"} (ids None where absent).

    Reads model_type and vision_config only, so that a vision graph's config needs no text_config.
    """
    # qbuild.model.config imports pydantic: only reading a config.json needs it, not a worker that rebuilds an Arch
    # from its fingerprint.
    from qbuild.model.config import validated_vision

    model_type, _, wrapped = _model_type(config, origin)
    section = config.get("vision_config") if wrapped else None
    if section is None:
        return None
    vision = validated_vision(section, origin, model_type)
    return _vision_arch(vision), {"vision_rope_theta": vision.rope_parameters.rope_theta,
                                  "image_token_id": _single_id(config.get("image_token_id")),
                                  "vision_start_token_id": _single_id(config.get("vision_start_token_id"))}


def arch_from_config(config: dict, origin: str = "config.json") -> Arch:
    """Normalise a HF config (a VL wrapper or a text-only one, either config form) into an Arch.

    `origin` names the file in errors: a ConfigError (a UserError) of one line naming it and the field, raised by
    qbuild.model.config's schema before anything is built from the config.
    """
    from qbuild.model.config import validated  # pydantic: see vision_from_config

    _, family, wrapped = _model_type(config, origin)
    parsed = validated(config, origin)
    text = parsed.text_config if wrapped else parsed
    vision = parsed.vision_config if wrapped else None
    moe, layout_fields = FAMILIES[family].moe, FAMILIES[family].moe_layout_fields
    n = text.num_hidden_layers
    step = text.decoder_sparse_step if layout_fields else 1
    mlp_only = tuple(text.mlp_only_layers) if layout_fields else ()
    has_dense = not all(_is_moe_layer(i, moe, step, mlp_only) for i in range(n))
    host = {}
    if vision is not None:
        host = {"vision_rope_theta": vision.rope_parameters.rope_theta,
                "image_token_id": parsed.single_id("image_token_id"),
                "vision_start_token_id": parsed.single_id("vision_start_token_id")}
    tie = parsed.tie_word_embeddings if parsed.tie_word_embeddings is not None else text.tie_word_embeddings
    return Arch(
        family=family, vocab_size=text.vocab_size, hidden_size=text.hidden_size, num_layers=n,
        layer_types=text.layer_kinds, num_heads=text.num_attention_heads, num_kv_heads=text.num_key_value_heads,
        head_dim=text.attention_head_dim,
        # An MoE model's dense MLP size matters only where it has dense layers.
        intermediate_size=text.intermediate_size if has_dense else None,
        num_k_heads=text.linear_num_key_heads, num_v_heads=text.linear_num_value_heads,
        k_head_dim=text.linear_key_head_dim, v_head_dim=text.linear_value_head_dim,
        conv_kernel=text.linear_conv_kernel_dim,
        num_experts=text.num_experts if moe else None,
        num_experts_per_tok=text.num_experts_per_tok if moe else None,
        moe_intermediate_size=text.moe_intermediate_size if moe else None,
        shared_intermediate_size=text.shared_expert_intermediate_size if moe else None,
        rope=tuple(sorted(text.rope().items())), rms_norm_eps=text.rms_norm_eps, tie_word_embeddings=bool(tie),
        vision=None if vision is None else _vision_arch(vision),
        norm_topk_prob=text.norm_topk_prob if layout_fields else True,
        decoder_sparse_step=step, mlp_only_layers=mlp_only,
        max_position_embeddings=text.max_position_embeddings,
        pad_token_id=_text_id(text, parsed, "pad_token_id"), eos_token_id=_text_id(text, parsed, "eos_token_id"),
        **host)
