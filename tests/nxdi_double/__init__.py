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
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
SITE = ROOT / "site"
# vLLM 0.16.0 and vllm-neuron 0.5.0 as qbuild's serving uses them (vllm_site/vllm/__init__.py); on the path only where
# a test serves a bundle, so that elsewhere vLLM is absent as on a build host.
VLLM_SITE = ROOT / "vllm_site"
MAIN_PORT = ROOT / "ports" / "qwen35"      # main lineage: this directory on sys.path, `import src.modeling_qwen35`
MOE_PORT = ROOT / "ports" / "coder_next"   # moe lineage: its src/ on sys.path, `import modeling_qwen35_moe`
SETTINGS_FILE = "nxdi_double_settings.json"   # read by site/neuronx_distributed_inference/_double.py
# Where the fake ports sit in the fake NxDI repository (port_repository), as in
# aws-neuron/neuronx-distributed-inference.
MAIN_SUBDIR = "contrib/models/Qwen3.5-35B-A3B"
# What NxDI PR 173's own tree (@ 03db3ef) has beyond the double's NxDI: modules/async_execution.py (nxdi_tree).
PR173_TREE = ROOT / "pr173_tree"
MOE_SUBDIR = "contrib/models/Qwen3-Coder-Next"


def settings_dir(directory: Path, log: Path | None = None, barrier: str | None = None,
                 checkpoint: Path | None = None, load_error: str | None = None) -> Path:
    """A directory holding the double's settings (its call log, a barrier "<dir>:<n>", the HF checkpoint a bundle
    was built from, against which load() checks every shard's values, and a message load() raises as a ValueError,
    a fault injected), to put first on PYTHONPATH: the SDK worker's environment is hermetic, its PYTHONPATH is how it
    finds the SDK."""
    directory.mkdir(parents=True, exist_ok=True)
    doc = {k: str(v) for k, v in (("log", log), ("barrier", barrier), ("checkpoint", checkpoint),
                                  ("load_error", load_error)) if v is not None}
    (directory / SETTINGS_FILE).write_text(json.dumps(doc))
    return directory


@dataclass(frozen=True)
class PortRepository:
    """A git repository laid out like NxDI's, holding the fake ports; `url` is its file:// URL."""

    path: Path
    url: str
    first: str          # both ports as shipped, plus a test file and a README that no build may copy
    second: str         # the main port changed (a module edited, one added); reachable only from refs/pull/1/head


def _git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "double", "GIT_AUTHOR_EMAIL": "double@example.invalid",
           "GIT_COMMITTER_NAME": "double", "GIT_COMMITTER_EMAIL": "double@example.invalid",
           "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


def port_repository(dest: Path) -> PortRepository:
    """Two commits of a fake NxDI repository at `dest`: `first` on main, `second` only on a pull-request ref, as
    the Qwen ports' PR commits are upstream (the build fetches a commit by its id, whatever ref reaches it)."""
    _git(dest.parent if dest.parent.exists() else Path.cwd(), "init", "--quiet", "--initial-branch=main", str(dest))
    for src, subdir in ((MAIN_PORT, MAIN_SUBDIR), (MOE_PORT, MOE_SUBDIR)):
        shutil.copytree(src, dest / subdir, ignore=shutil.ignore_patterns("__pycache__"))
        (dest / subdir / "test").mkdir()
        (dest / subdir / "test" / "test_port.py").write_text("raise AssertionError('tests are not port source')\n")
        (dest / subdir / "README.md").write_text("not Python\n")
    _git(dest, "add", "-A")
    _git(dest, "commit", "--quiet", "-m", "ports")
    first = _git(dest, "rev-parse", "HEAD")
    module = dest / MAIN_SUBDIR / "src" / "modeling_qwen35.py"
    module.write_text(module.read_text() + "\n# the second commit's edit\n")
    (dest / MAIN_SUBDIR / "src" / "added_in_second.py").write_text("ADDED = True\n")
    _git(dest, "add", "-A")
    _git(dest, "commit", "--quiet", "-m", "change the main port")
    second = _git(dest, "rev-parse", "HEAD")
    _git(dest, "update-ref", "refs/pull/1/head", second)
    _git(dest, "reset", "--quiet", "--hard", first)
    return PortRepository(dest, dest.resolve().as_uri(), first, second)


def replicated_deltanet_port(dest: Path) -> Path:
    """A fake of the Qwen3.5-27B port (PR 128 @ 550e2ab) at `dest`: the main port with its DeltaNet replicated and
    no use_text_only_cte_inputs (its context encoding always takes vision inputs)."""
    return _main_port_with(dest, "modeling_qwen35.py", TENSOR_PARALLEL_DELTANET=False, TEXT_ONLY_CTE_SWITCH=False)


def pr173_port(dest: Path) -> Path:
    """A fake of the Qwen3.6-27B port (PR 173 @ 03db3ef) at `dest`: the main port importing the functions of NxDI's
    modules/async_execution.py that only that PR's tree has (modeling_qwen35.py L47-52)."""
    return _main_port_with(dest, "modeling_qwen35.py", IMPORTS_PR173_NXDI=True)


def nxdi_tree(dest: Path) -> Path:
    """A checkout of NxDI PR 173's tree at `dest`, as far as the double goes: src/neuronx_distributed_inference is the
    double's NxDI with that tree's modules/async_execution.py and _version.py ("0.9.0": _version.py @ 03db3ef)."""
    package = dest / "src" / "neuronx_distributed_inference"
    shutil.copytree(SITE / "neuronx_distributed_inference", package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(PR173_TREE, package, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "_version.py").write_text('__version__ = "0.9.0"\n')
    return dest


def vision_tp_port(dest: Path) -> Path:
    """A fake of the Qwen3.5-2B port (NxDI main @ 4bcdc54) at `dest`: the main port whose vision wrapper also loads
    TP-sharded encoders (modeling_qwen35_vision.py:75-92, 455-485), which the 35B-A3B port's does not."""
    return _main_port_with(dest, "modeling_qwen35_vision.py", TP_VISION_BUCKETS=True)


def _main_port_with(dest: Path, module_file: str, **flags: bool) -> Path:
    """A copy of the fake main port at `dest` with each module-level flag of src/`module_file` set to its value."""
    shutil.copytree(MAIN_PORT, dest, ignore=shutil.ignore_patterns("__pycache__"))
    module = dest / "src" / module_file
    source = module.read_text()
    for flag, value in flags.items():
        assert f"\n{flag} = {not value}\n" in source
        source = source.replace(f"\n{flag} = {not value}\n", f"\n{flag} = {value}\n")
    module.write_text(source)
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
    """The calls the double recorded (one JSON object per line of the log its settings name)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
