"""The NxDI port lineages a neuron build targets, and where a recipe's port source lives on this machine.

A neuron build runs a public NxDI contrib port (aws-neuron/neuronx-distributed-inference, contrib/models/). The ports
come in two lineages whose module names, class names, compiler arguments and sharded-checkpoint formats differ
(shared/reference/nxdi-api.md section 1):

- main: Qwen3.5-35B-A3B and Qwen3.5-2B on NxDI main @ 4bcdc54 (contrib/models/<Port>/src/modeling_qwen35.py),
  the Qwen3.5-27B / Qwen3.6-27B PRs. The port imports `src.nki_kernels...`, so the PORT DIRECTORY goes on sys.path.
- moe: Qwen3-Coder-Next (PR 170 @ 753c7f5, contrib/models/Qwen3-Coder-Next/src/modeling_qwen35_moe.py), flat
  imports, so the port's src/ goes on sys.path.

No aws-neuron ref has a `modeling_qwen3_next` module; Coder-Next (model_type qwen3_next) is served by the moe lineage.
This module is pure data plus file lookups: it never imports a port.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

LineageName = Literal["main", "moe"]

# Compiler arguments each lineage's `get_compiler_args()` returns for CTE and TKG (nxdi-api.md section 1, read from
# contrib/models/Qwen3.5-35B-A3B/src/modeling_qwen35.py @ 4bcdc54 and Qwen3-Coder-Next/src/modeling_qwen35_moe.py
# @ 753c7f5). Recipe flags are appended after them.
_MAIN_ARGS = ("--enable-saturate-infinity", "--enable-mixed-precision-accumulation", "--model-type", "transformer",
              "-O1", "--auto-cast=none")
_MOE_ARGS = _MAIN_ARGS + ("--internal-enable-dge-levels", "vector_dynamic_offsets")
# The vision encoder's torch_neuronx.trace arguments (nxdi-api.md section 5).
_VISION_ARGS = ("--model-type=transformer", "--auto-cast=none", "-O1", "--enable-mixed-precision-accumulation")


@dataclass(frozen=True)
class Lineage:
    name: LineageName
    text_module: str                 # imported with `import_root` on sys.path
    app_class: str                   # the NxDI application (NeuronBaseForCausalLM subclass)
    config_class: str                # its InferenceConfig subclass
    vision_module: str | None        # the port's vision module (CPUVisionModel), None where the lineage has none
    import_root: str                 # "." (the port directory) or "src" (the port's src/ directory)
    compiler_args: tuple[str, ...]
    shard_layout: str                # qbuild.convert.shard_checkpoint(layout=...) that writes NxD's format

    def module_dir(self, port_dir: Path) -> Path:
        """The directory that goes on sys.path so that `text_module` imports as the port expects."""
        return port_dir if self.import_root == "." else port_dir / self.import_root


LINEAGES: dict[str, Lineage] = {
    "main": Lineage("main", "src.modeling_qwen35", "NeuronQwen35ForCausalLM", "Qwen35InferenceConfig",
                    "src.modeling_qwen35_vision", ".", _MAIN_ARGS, "nxd-main"),
    "moe": Lineage("moe", "modeling_qwen35_moe", "NeuronQwen35MoeForCausalLM", "Qwen35MoeInferenceConfig",
                   None, "src", _MOE_ARGS, "nxd-moe"),
}
VISION_COMPILER_ARGS = _VISION_ARGS

# The lineage of the public port of each family (models.md): the Qwen3.5 / 3.6 dense and MoE ports are main,
# Coder-Next is moe.
DEFAULT_LINEAGE = {"qwen3_5": "main", "qwen3_5_moe": "main", "qwen3_next": "moe"}

# A port's source: its Python files, minus tests (editing a port's tests must not rebuild anything).
_SKIP_DIRS = {"test", "tests", "__pycache__", ".git"}


def lineage_for(family: str, requested: str | None) -> Lineage:
    return LINEAGES[requested or DEFAULT_LINEAGE[family]]


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


def source_files(port_dir: Path) -> list[Path]:
    """The files whose digests identify a port: every .py under it, tests excluded, sorted."""
    out = []
    for path in port_dir.rglob("*.py"):
        rel = path.relative_to(port_dir)
        if not _SKIP_DIRS.intersection(rel.parts[:-1]) and path.is_file():
            out.append(path)
    return sorted(out)
