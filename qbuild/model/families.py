"""The supported model families, as data: the one table that the config reader, the recipe checks, the converter,
the tiny checkpoints and the Neuron backend read their family facts from.

- `FAMILIES`: per family, its config model types, whether it is MoE, the FP8 policies and default MoE backend it
  takes, whether its rotary is mRoPE, the converter's family rules, and the NxDI port lineages that serve it.
- `MODEL_TYPES`: per config.json `model_type` (a checkpoint's family is decided by it alone, nxdi-layout.md
  section 0), its family, whether it is a VL wrapper, and where it keeps its text and vision weights.
- `LINEAGES`: the NxDI contrib port lineages, with their module and class names (nxdi-api.md section 1).
- The FP8 policies, and which layers' MLPs each one quantises.

Plain data only: the planner imports it, so it must stay free of torch, transformers and pydantic.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

FamilyName = Literal["qwen3_5", "qwen3_5_moe", "qwen3_next"]
LineageName = Literal["main", "main-replicated", "moe"]
MoEBackend = Literal["shard_on_intermediate", "torch_blockwise", "shard_hidden", "shard_on_block"]

# --- FP8 policies (convert/fp8.py: what each stores as FP8) ----------------------------------------------------

FP8Policy = Literal["none", "mlp_only", "full"]
FP8_POLICIES: tuple[FP8Policy, ...] = get_args(FP8Policy)


def fp8_mlp_layers(policy: FP8Policy, num_layers: int) -> range:
    """The layers whose MLP weights `policy` stores as FP8. mlp_only, the validated 128K serving recipe (PR 173),
    keeps the first and the last layer's MLP in the model dtype; full quantises the MLP of every layer."""
    if policy == "none":
        return range(0)
    return range(1, num_layers - 1) if policy == "mlp_only" else range(num_layers)


def fp8_quantises_attention(policy: FP8Policy) -> bool:
    """Whether `policy` also stores the attention and DeltaNet projections as FP8 (in every layer)."""
    return policy == "full"


# --- NxDI port lineages -----------------------------------------------------------------------------------------

# Compiler arguments each lineage's `get_compiler_args()` returns for CTE and TKG (nxdi-api.md section 1, read from
# contrib/models/Qwen3.5-35B-A3B/src/modeling_qwen35.py @ 4bcdc54 and Qwen3-Coder-Next/src/modeling_qwen35_moe.py
# @ 753c7f5). Recipe flags are appended after them.
_MAIN_ARGS = ("--enable-saturate-infinity", "--enable-mixed-precision-accumulation", "--model-type", "transformer",
              "-O1", "--auto-cast=none")
_MOE_ARGS = _MAIN_ARGS + ("--internal-enable-dge-levels", "vector_dynamic_offsets")
# The vision encoder's torch_neuronx.trace arguments (nxdi-api.md section 5).
VISION_COMPILER_ARGS = ("--model-type=transformer", "--auto-cast=none", "-O1", "--enable-mixed-precision-accumulation")


@dataclass(frozen=True)
class Lineage:
    """One lineage of NxDI contrib ports: module names, class names, compiler arguments and sharded-checkpoint
    format differ between lineages (qbuild.recipe.ports finds a port's files)."""

    name: LineageName
    text_module: str                 # imported with `import_root` on sys.path
    app_class: str                   # the NxDI application (NeuronBaseForCausalLM subclass)
    config_class: str                # its InferenceConfig subclass
    vision_module: str | None        # the port's vision module (CPUVisionModel), None where the lineage has none
    import_root: str                 # "." (the port directory) or "src" (the port's src/ directory)
    compiler_args: tuple[str, ...]
    shard_layout: str                # qbuild.model.convert.shard_checkpoint(layout=...) that writes NxD's format

    def module_dir(self, port_dir: Path) -> Path:
        """The directory that goes on sys.path so that `text_module` imports as the port expects."""
        return port_dir if self.import_root == "." else port_dir / self.import_root


# main: Qwen3.5-35B-A3B and Qwen3.5-2B on NxDI main @ 4bcdc54 (contrib/models/<Port>/src/modeling_qwen35.py) and the
# Qwen3.6-27B PR (173 @ 03db3ef); the port imports `src.nki_kernels...`, so the PORT DIRECTORY goes on sys.path.
# main-replicated: the Qwen3.5-27B PR (128 @ 550e2ab, contrib/models/Qwen3.5-27B/src/modeling_qwen35.py): main's
# module, classes, imports and get_compiler_args (L2504), but a DeltaNet replicated on every rank (L258-281) and a
# dense MLP in every layer (L1427), so its shards differ.
# moe: Qwen3-Coder-Next (PR 170 @ 753c7f5, contrib/models/Qwen3-Coder-Next/src/modeling_qwen35_moe.py), flat
# imports, so the port's src/ goes on sys.path. No aws-neuron ref has a `modeling_qwen3_next` module.
LINEAGES: dict[LineageName, Lineage] = {
    "main": Lineage("main", "src.modeling_qwen35", "NeuronQwen35ForCausalLM", "Qwen35InferenceConfig",
                    "src.modeling_qwen35_vision", ".", _MAIN_ARGS, "nxd-main"),
    "main-replicated": Lineage("main-replicated", "src.modeling_qwen35", "NeuronQwen35ForCausalLM",
                               "Qwen35InferenceConfig", "src.modeling_qwen35_vision", ".", _MAIN_ARGS,
                               "nxd-main-replicated"),
    "moe": Lineage("moe", "modeling_qwen35_moe", "NeuronQwen35MoeForCausalLM", "Qwen35MoeInferenceConfig",
                   None, "src", _MOE_ARGS, "nxd-moe"),
}


# --- families ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Family:
    name: FamilyName
    vl_model_type: str | None       # model_type of the VL wrapper (None: the family has no vision encoder)
    text_model_type: str            # model_type of the text model (a text-only export, or a wrapper's text_config)
    moe: bool                       # routed experts (+ shared expert) instead of a dense MLP
    # fp8 "full" quantises attention and DeltaNet projections too; only the dense family has been validated so.
    fp8_policies: tuple[FP8Policy, ...]
    default_moe_backend: MoEBackend | None
    # transformers' Qwen3.5 text rotary (both VL families) interleaves the (t, h, w) frequencies of an
    # mrope_section; Qwen3-Next's is plain RoPE and ignores mrope keys.
    mrope: bool
    # The lineages whose public port serves the family (models.md), the default first: the moe lineage's module is
    # written for the MoE text model only, and the main lineage's for the Qwen3.5 model types.
    port_lineages: tuple[LineageName, ...]
    transformers_config: str        # the transformers config class of the family's published checkpoints
    # Qwen3-Next's config places dense layers (mlp_only_layers, decoder_sparse_step) and may skip top-k
    # renormalisation (norm_topk_prob); transformers' Qwen3.5-MoE reads none of them: all MoE, renormalised.
    moe_layout_fields: bool = False
    grouped_deltanet: bool = False   # Qwen3-Next's per-key-head grouped in_proj_qkvz / in_proj_ba
    zero_pad_embedding: bool = False  # zero embed_tokens[pad_token_id] (Coder-Next lineage)


FAMILIES: dict[FamilyName, Family] = {
    "qwen3_5": Family("qwen3_5", "qwen3_5", "qwen3_5_text", moe=False, fp8_policies=("none", "mlp_only", "full"),
                      default_moe_backend=None, mrope=True, port_lineages=("main", "main-replicated"),
                      transformers_config="Qwen3_5Config"),
    "qwen3_5_moe": Family("qwen3_5_moe", "qwen3_5_moe", "qwen3_5_moe_text", moe=True,
                          fp8_policies=("none", "mlp_only"), default_moe_backend="shard_on_intermediate", mrope=True,
                          port_lineages=("main", "moe"), transformers_config="Qwen3_5MoeConfig"),
    "qwen3_next": Family("qwen3_next", None, "qwen3_next", moe=True, fp8_policies=("none", "mlp_only"),
                         default_moe_backend="shard_on_block", mrope=False, port_lineages=("moe",),
                         transformers_config="Qwen3NextConfig", moe_layout_fields=True, grouped_deltanet=True,
                         zero_pad_embedding=True),
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
