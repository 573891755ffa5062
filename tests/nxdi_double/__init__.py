"""The NxDI contract double: fakes of the Neuron SDK's public surface (site/) and of the port lineages (ports/).

The Neuron SDK cannot be installed on a CPU host, so the neuron backend is tested against these. They are built only
from the facts in docs/nxdi.md and docs/nxd-layout.md, and
docs/nxdi.md, each with its source in a comment, and are stricter than the real SDK wherever the facts
are silent. Nothing under qbuild/ imports them: a test puts site/ on the CLI's PYTHONPATH.

site/ also holds a *.dist-info/METADATA per SDK distribution, so importlib.metadata reports the versions of a real
install: the ones recipes/bases/trn2.yaml pins, with the local `+hash` suffix real wheels carry (docs/nxdi.md
section 12: neuronx-cc 2.26.6360.0+6f180f47, neuronx-distributed 0.19.28492+435aae2b, neuronx-distributed-inference
0.10.18399+ed62453e, torch-neuronx 2.9.0.2.15.32035+de43f57c). `metadata_overlay` writes other versions into a
directory that goes before site/ on the path (importlib.metadata takes the first match on sys.path).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent
SITE = ROOT / "site"
MAIN_PORT = ROOT / "ports" / "qwen35"      # main lineage: this directory on sys.path, `import src.modeling_qwen35`
MOE_PORT = ROOT / "ports" / "coder_next"   # moe lineage: its src/ on sys.path, `import modeling_qwen35_moe`


def replicated_deltanet_port(dest: Path) -> Path:
    """A fake of the Qwen3.5-27B port (PR 128 @ 550e2ab) at `dest`: the main port with its DeltaNet replicated."""
    shutil.copytree(MAIN_PORT, dest, ignore=shutil.ignore_patterns("__pycache__"))
    module = dest / "src" / "modeling_qwen35.py"
    source = module.read_text()
    assert "TENSOR_PARALLEL_DELTANET = True" in source
    module.write_text(source.replace("TENSOR_PARALLEL_DELTANET = True", "TENSOR_PARALLEL_DELTANET = False"))
    return dest


def metadata_overlay(directory: Path, versions: dict[str, str]) -> Path:
    """A directory of *.dist-info folders reporting `versions` ({distribution name: version}); put it before SITE."""
    directory.mkdir(parents=True, exist_ok=True)
    for dist, version in versions.items():
        info = directory / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    return directory


def read_log(path: Path) -> list[dict]:
    """The calls the double recorded (one JSON object per line of $NXDI_DOUBLE_LOG)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
