"""Architecture facts read from a checkpoint's config.json, and the recipe checks that depend on them.

Planning must work offline and without torch, so this module reads JSON only. The published configs of the
shipped models are kept in qbuild/configs (named org--name.json) for recipes whose weights are not downloaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import RecipeError, UserError
from .recipe import LoadedRecipe, recipe_field_location

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
MOE_FAMILIES = ("qwen3_5_moe", "qwen3_next")
DEFAULT_MOE_BACKEND = {"qwen3_5_moe": "shard_on_intermediate", "qwen3_next": "shard_on_block"}
# fp8 "full" quantises attention and DeltaNet projections too; only the dense family has been validated so.
FP8_POLICIES = {"qwen3_5": ("none", "mlp_only", "full"), "qwen3_5_moe": ("none", "mlp_only"),
                "qwen3_next": ("none", "mlp_only")}

_SHIPPED = Path(__file__).parent / "configs"
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# Device memory one rank (one logical NeuronCore) can use, by target and LNC.
_HBM_PER_RANK_GIB = {("trn2", 2): 24, ("trn2", 1): 12, ("trn1", 1): 16, ("trn1", 2): 32, ("inf2", 1): 16,
                     ("inf2", 2): 32}


@dataclass(frozen=True)
class VisionArch:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    num_position_embeddings: int


@dataclass(frozen=True)
class Arch:
    """The allow-listed fields of a model's config that shape its graphs and weights (never weight values)."""

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
    rope: tuple[tuple[str, object], ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    vision: VisionArch | None
    # MoE layout fields that change the graph: qwen3_next may skip top-k renormalisation and place dense layers.
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.family in MOE_FAMILIES

    @property
    def num_attn_layers(self) -> int:
        return sum(t == "full_attention" for t in self.layer_types)

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim

    def fingerprint(self) -> dict:
        """The JSON-able allow-list that enters compile keys."""
        d = asdict(self)
        d["rope"] = dict(self.rope)
        return d

    def param_counts(self) -> tuple[int, int]:
        """(parameters outside routed experts, parameters of routed experts) of the text model."""
        h = self.hidden_size
        attn = h * self.num_heads * self.head_dim * 2 + 2 * h * self.num_kv_heads * self.head_dim
        attn += self.num_heads * self.head_dim * h
        kd, vd = self.num_k_heads * self.k_head_dim, self.num_v_heads * self.v_head_dim
        delta = h * (2 * kd + vd) + h * vd + 2 * h * self.num_v_heads + vd * h
        if self.is_moe:
            mlp = 3 * h * self.shared_intermediate_size + h * self.num_experts + h
            experts = 3 * h * self.moe_intermediate_size * self.num_experts
        else:
            mlp, experts = 3 * h * self.intermediate_size, 0
        dense = self.num_attn_layers * attn + (self.num_layers - self.num_attn_layers) * delta
        dense += self.num_layers * mlp + self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return dense, experts * self.num_layers


def _family(config: dict, origin: str) -> str:
    mt = config.get("model_type")
    if mt not in FAMILIES:
        raise UserError(f"{origin}: model_type: unsupported {mt!r}; qbuild builds {', '.join(FAMILIES)}")
    return mt


def arch_from_config(config: dict, origin: str = "config.json") -> Arch:
    """Normalise a HF config (the VL wrapper or a text-only one) into an Arch. `origin` names it in errors."""
    family = _family(config, origin)
    text = config.get("text_config", config) if family != "qwen3_next" else config
    try:
        n = text["num_hidden_layers"]
        layer_types = tuple(text.get("layer_types") or
                            ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)])
        rope = text.get("rope_parameters") or {"rope_theta": text.get("rope_theta", 10000.0),
                                               "partial_rotary_factor": text.get("partial_rotary_factor", 1.0)}
        vc = config.get("vision_config") if family != "qwen3_next" else None
        vision = None if not vc else VisionArch(
            depth=vc["depth"], hidden_size=vc["hidden_size"], num_heads=vc["num_heads"],
            intermediate_size=vc["intermediate_size"], out_hidden_size=vc["out_hidden_size"],
            patch_size=vc.get("patch_size", 16), temporal_patch_size=vc.get("temporal_patch_size", 2),
            spatial_merge_size=vc.get("spatial_merge_size", 2),
            num_position_embeddings=vc.get("num_position_embeddings", 2304))
        moe = family in MOE_FAMILIES
        return Arch(
            family=family, vocab_size=text["vocab_size"], hidden_size=text["hidden_size"], num_layers=n,
            layer_types=layer_types, num_heads=text["num_attention_heads"],
            num_kv_heads=text["num_key_value_heads"], head_dim=text["head_dim"],
            # An MoE model's dense MLP size matters only where it has dense layers.
            intermediate_size=text["intermediate_size"] if not moe or text.get("mlp_only_layers")
            or (text.get("decoder_sparse_step") or 1) > 1 else None,
            num_k_heads=text["linear_num_key_heads"], num_v_heads=text["linear_num_value_heads"],
            k_head_dim=text["linear_key_head_dim"], v_head_dim=text["linear_value_head_dim"],
            conv_kernel=text.get("linear_conv_kernel_dim", 4),
            num_experts=text["num_experts"] if moe else None,
            num_experts_per_tok=text["num_experts_per_tok"] if moe else None,
            moe_intermediate_size=text["moe_intermediate_size"] if moe else None,
            shared_intermediate_size=text["shared_expert_intermediate_size"] if moe else None,
            rope=tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in rope.items())),
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            vision=vision,
            norm_topk_prob=bool(text.get("norm_topk_prob", True)) if family == "qwen3_next" else True,
            decoder_sparse_step=(text.get("decoder_sparse_step") or 1) if moe else 1,
            mlp_only_layers=tuple(text.get("mlp_only_layers") or ()) if moe else ())
    except KeyError as e:
        raise UserError(f"{origin}: missing field {e.args[0]!r} for model_type {family}") from None


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
    try:
        return json.loads(cfg.read_text()), str(cfg)
    except (OSError, json.JSONDecodeError) as e:
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
    est = rank_memory_bytes(loaded, arch)
    limit = _HBM_PER_RANK_GIB.get((r.compiler.target, r.compiler.effective_lnc))
    if limit is not None and est > limit << 30:
        _fail(loaded, "parallel.tp", f"needs ~{est / 2**30:.1f} GiB per rank (weights + KV cache + DeltaNet "
                                     f"state), over the {limit} GiB of a {r.compiler.target} LNC"
                                     f"{r.compiler.effective_lnc} rank; raise tp")


def moe_backend(loaded: LoadedRecipe, arch: Arch) -> str | None:
    if not arch.is_moe:
        return None
    return loaded.recipe.moe_backend or DEFAULT_MOE_BACKEND[arch.family]


def weight_bytes(arch: Arch, dtype: str, fp8: str) -> int:
    dense, experts = arch.param_counts()
    b = _DTYPE_BYTES[dtype]
    # FP8 stores one byte per quantised weight; experts are the MLP weights of the MoE families.
    mlp_bytes = 1 if fp8 != "none" else b
    if arch.is_moe:
        return dense * b + experts * mlp_bytes
    mlp = 3 * arch.hidden_size * arch.intermediate_size * arch.num_layers
    return (dense - mlp) * b + mlp * mlp_bytes


def rank_memory_bytes(loaded: LoadedRecipe, arch: Arch) -> int:
    """Estimated device memory of one rank: its weight shard, its KV cache and its DeltaNet state."""
    r = loaded.recipe
    tp, b = r.parallel.tp, _DTYPE_BYTES[r.dtype]
    weights = weight_bytes(arch, r.dtype, r.fp8) // tp
    kv_heads = max(1, arch.num_kv_heads // tp)
    kv = 2 * r.text.batch_size * r.text.seq_len * kv_heads * arch.head_dim * b * arch.num_attn_layers
    n_delta = arch.num_layers - arch.num_attn_layers
    state = r.text.batch_size * n_delta * ((arch.num_v_heads // tp) * arch.k_head_dim * arch.v_head_dim * 4
                                            + (arch.conv_dim // tp) * (arch.conv_kernel - 1) * b)
    return weights + kv + state
