"""The plan's memory estimates follow the buckets: a compile or a verify whose buckets grow needs more memory, and the
estimate of a vision compile stays within a small factor of what compiling it really takes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import qbuild

GIB = 1 << 30

# A tiny VL recipe whose text context holds a 4096-patch image (1024 image tokens + 2); only planned, never built.
RECIPE = """\
model: {{path: {model}}}
backend: export
dtype: float32
text: {{seq_len: 4096, cte_buckets: [32, 1040], tkg_buckets: [{tkg}]}}
vision: {{buckets: [64, {vision}]}}
verify: {{prompts: [Hello], new_tokens: 2}}
"""

# Compiles one vision graph the way the compile step does (the export backend's compile), in a fresh interpreter,
# and prints its peak resident memory in bytes.
CHILD = """
import resource, sys
from pathlib import Path
from types import SimpleNamespace

from qbuild import backends
from qbuild.backends.cpu.backend import compile_params
from qbuild.recipe.schema import load_recipe
from qbuild.hub.source import load_arch

loaded = load_recipe(sys.argv[1])
out = Path(sys.argv[2])
out.mkdir()
params = compile_params(loaded, load_arch(loaded), "vision", int(sys.argv[3]))
backends.get("export").compile(SimpleNamespace(params=params, inputs={}, out=out, scratch=out, store=None,
                                               log=lambda line: None))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def _plan(tmp: Path, model: Path, name: str, vision: int, tkg: int) -> tuple[Path, dict[str, int]]:
    recipe = tmp / f"{name}.yaml"
    recipe.write_text(RECIPE.format(model=model, vision=vision, tkg=tkg))
    proc = qbuild("plan", str(recipe), "--json", "--store", str(tmp / "store"), cwd=tmp, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return recipe, {n["name"].split(" (")[0]: n["est_peak_bytes"] for n in json.loads(proc.stdout)["nodes"]}


@pytest.mark.slow   # a peak-memory measurement of a real compile
def test_peak_estimates_grow_with_the_buckets_and_match_a_measured_compile(tiny_checkpoints, tmp_path):
    model = tiny_checkpoints["qwen3_5"]
    recipe, small = _plan(tmp_path, model, "small", vision=1024, tkg=1040)
    _, large = _plan(tmp_path, model, "large", vision=4096, tkg=4096)
    assert large["compile vision-4096"] > small["compile vision-1024"] + 192 * (1 << 20)   # the float32 mask grew
    assert large["compile tkg-4096"] > small["compile tkg-1040"]                          # the KV cache grew
    assert large["verify large"] > small["verify small"]
    assert small["compile vision-64"] == large["compile vision-64"]

    bucket = 8192   # a 256 MiB float32 mask: the bucket's own memory outweighs the interpreter's
    recipe.write_text(RECIPE.format(model=model, vision=bucket, tkg=4096).replace("[32, 1040]", "[32, 2064]"))
    proc = qbuild("plan", str(recipe), "--json", "--store", str(tmp_path / "store"), cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (estimate,) = [n["est_peak_bytes"] for n in json.loads(proc.stdout)["nodes"]
                   if n["name"].startswith(f"compile vision-{bucket} ")]
    child = subprocess.run([sys.executable, "-c", CHILD, str(recipe), str(tmp_path / "out"), str(bucket)],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    measured = int(child.stdout.strip().splitlines()[-1])
    assert measured <= estimate <= 3 * measured, f"estimated {estimate / GIB:.2f} GiB, measured {measured / GIB:.2f}"
