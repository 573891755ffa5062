"""The NxDI contrib port lineages, which lineage a build targets, and where a recipe's port source lives.

A neuron build runs a public NxDI contrib port (aws-neuron/neuronx-distributed-inference, contrib/models/). The ports
come in three lineages (module names, class names, compiler arguments, sharded-checkpoint formats; docs/nxdi.md
section 1); each family names the lineages that serve it. Pure data plus file lookups: this module never imports a port.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from qbuild.recipe.schema import LineageName, LoadedRecipe

# Compiler arguments each lineage's `get_compiler_args()` returns for CTE and TKG (docs/nxdi.md section 1, read from
# contrib/models/Qwen3.5-35B-A3B/src/modeling_qwen35.py @ 4bcdc54 and Qwen3-Coder-Next/src/modeling_qwen35_moe.py
# @ 753c7f5). Recipe flags are appended after them.
_MAIN_ARGS = ("--enable-saturate-infinity", "--enable-mixed-precision-accumulation", "--model-type", "transformer",
              "-O1", "--auto-cast=none")
_MOE_ARGS = _MAIN_ARGS + ("--internal-enable-dge-levels", "vector_dynamic_offsets")
# The vision encoder's torch_neuronx.trace arguments (docs/nxdi.md section 5); compile_vision_encoder_tp.py passes the
# same to parallel_model_trace (contrib/models/Qwen3.5-2B/test/integration/compile_vision_encoder_tp.py:176-181).
VISION_COMPILER_ARGS = ("--model-type=transformer", "--auto-cast=none", "-O1", "--enable-mixed-precision-accumulation")
# The port switches a lineage's VL scripts set before the text model is traced to take image features (docs/vision.md
# section 4): the main ports' run_vl_smoke.py:41-42 and run_vl_benchmark.py:29-30 @ 4bcdc54 (2B and 35B-A3B alike)
# select the legacy direct DeltaNet prefill, because the default fused multi-head kernel degenerates on real vision
# embeddings (contrib/models/Qwen3.5-2B/README.md "Known limitations"). A neuron recipe with vision must set them.
VL_PORT_ENV: dict[LineageName, dict[str, str]] = {
    "main": {"QWEN36_DELTANET_CTE_IMPL": "legacy_direct", "QWEN36_DELTANET_MULTIHEAD_CTE": "0"},
}


@dataclass(frozen=True)
class Lineage:
    """One lineage of NxDI contrib ports: module names, class names, compiler arguments and sharded-checkpoint
    format differ between lineages."""

    name: LineageName
    text_module: str                 # imported with `import_root` on sys.path
    app_class: str                   # the NxDI application (NeuronBaseForCausalLM subclass)
    config_class: str                # its InferenceConfig subclass
    vision_module: str | None        # the port's vision module (CPUVisionModel), None where the lineage has none
    import_root: str                 # "." (the port directory) or "src" (the port's src/ directory)
    compiler_args: tuple[str, ...]
    shard_layout: str                # the shard layout (qbuild.backends.shard_layout) of the files NxD writes for it
    # When the port's text model, handed no llava_args for a prompt's context encoding, writes a zero row at the
    # unpadded prompt's last token (docs/vision.md section 8): "switch" where use_text_only_cte_inputs is False (the
    # 4bcdc54 ports: 2B modeling_qwen35.py L7650, L7666-7675, the graph traced with vision inputs only then, 2B L6825,
    # 35B-A3B L7055; the Qwen3.6-27B port of this lineage scatters them only where their length differs from the
    # prompt's, L5724-5739 @ 03db3ef, and so never zeroes the token: the padding inputs, cut to the bucket, change
    # nothing there), "always" (the Qwen3.5-27B port has no such switch: input_generator L2040-2085 traces them, and
    # _get_model_outputs L2317-2328 builds the dummy, which pad_inputs keeps, L2162-2182 @ 550e2ab), "never" (the
    # Coder-Next port's pad_inputs moves a zero dummy's every slot to the bucket's last, L3019-3075 @ 753c7f5).
    text_prompt_dummy: str

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
                    "src.modeling_qwen35_vision", ".", _MAIN_ARGS, "nxd-main", "switch"),
    "main-replicated": Lineage("main-replicated", "src.modeling_qwen35", "NeuronQwen35ForCausalLM",
                               "Qwen35InferenceConfig", "src.modeling_qwen35_vision", ".", _MAIN_ARGS,
                               "nxd-main-replicated", "always"),
    "moe": Lineage("moe", "modeling_qwen35_moe", "NeuronQwen35MoeForCausalLM", "Qwen35MoeInferenceConfig",
                   None, "src", _MOE_ARGS, "nxd-moe", "never"),
}

# The lineages whose public port serves each family (models.md), the default first: the moe lineage's module is
# written for the MoE text model only, and the main lineage's for the Qwen3.5 model types.
FAMILY_LINEAGES: dict[str, tuple[LineageName, ...]] = {
    "qwen3_5": ("main", "main-replicated"),
    "qwen3_5_moe": ("main", "moe"),
    "qwen3_next": ("moe",),
}


def lineage_for(family: str, requested: str | None) -> Lineage:
    """The lineage a recipe asked for, else the family's default (the first that serves it)."""
    return LINEAGES[requested or FAMILY_LINEAGES[family][0]]


def module_dir(module: str) -> Path | None:
    """The directory of an importable package (without importing it), or None where it is not importable."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin).parent if spec.origin else None


def port_dir(loaded: LoadedRecipe) -> Path | None:
    """The port directory named by `port.path` or `port.module` (None where neither is given or importable)."""
    port = loaded.recipe.port
    if port.path is not None:
        return (loaded.path.parent / port.path).resolve()
    if port.module is not None:
        return module_dir(port.module)
    return None
