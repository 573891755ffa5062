"""The bad-input corpus: every broken recipe exits 2 with one line naming the file and field, writing nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qbuild.core.errors import RecipeError
from qbuild.recipe.schema import HFSource, PathSource, load_recipe
from qbuild.recipe.source import shipped_config_path
from tests.conftest import qbuild

BASE = """\
text:
  seq_len: 128
  cte_buckets: [32, 64]
dtype: float32
backend: export
"""


def _checkpoint(root: Path, repo: str, **overrides) -> Path:
    """A checkpoint directory holding just a config.json (planning reads nothing else)."""
    cfg = json.loads(shipped_config_path(repo).read_text())
    text = cfg.get("text_config", cfg)
    text.update(overrides)
    d = root / repo.replace("/", "--")
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


NEURON_BASE = """\
text:
  seq_len: 512
  cte_buckets: [128, 512]
backend: neuron
toolchain: {neuronx_cc: 2.26.6360.0, neuronx_distributed: 0.19.28492, neuronx_distributed_inference: 0.10.18399,
            torch_neuronx: 2.9.0.2}
"""

CASES = {
    # name: (recipe text, the field the message must name)
    "yaml-syntax": ("model: {hf: Qwen/Qwen3.5-2B\ntext: [", "invalid YAML"),
    "unknown-key": ("model: {hf: Qwen/Qwen3.5-2B}\nturbo: true\n" + BASE, "turbo: unknown field"),
    "unknown-nested-key": ("model: {hf: Qwen/Qwen3.5-2B}\nparallel: {tp: 2, pp: 2}\n" + BASE, "parallel.pp"),
    "wrong-type": ("model: {hf: Qwen/Qwen3.5-2B}\nparallel: {tp: eight}\n" + BASE, "parallel.tp"),
    "tp-not-dividing-heads": ("model: {hf: Qwen/Qwen3.5-2B}\nparallel: {tp: 3}\n" + BASE, "parallel.tp"),
    "unsorted-buckets": ("model: {hf: Qwen/Qwen3.5-2B}\ntext: {seq_len: 128, cte_buckets: [64, 32]}\n",
                         "text.cte_buckets"),
    "duplicate-buckets": ("model: {hf: Qwen/Qwen3.5-2B}\ntext: {seq_len: 128, cte_buckets: [32, 32]}\n",
                          "text.cte_buckets"),
    "bucket-over-seq-len": ("model: {hf: Qwen/Qwen3.5-2B}\ntext: {seq_len: 64, cte_buckets: [32, 128]}\n",
                            "text"),
    "bad-fp8-value": ("model: {hf: Qwen/Qwen3.5-2B}\nfp8: int4\n" + BASE, "fp8"),
    "fp8-full-on-moe": ("model: {hf: Qwen/Qwen3.5-35B-A3B}\nparallel: {tp: 8}\nfp8: full\n" + BASE, "fp8"),
    "missing-model-source": ("model: {revision: main}\n" + BASE, "model"),
    "two-model-sources": ("model: {hf: Qwen/Qwen3.5-2B, path: ./x}\n" + BASE, "model"),
    "missing-text": ("model: {hf: Qwen/Qwen3.5-2B}\n", "text"),
    "vision-on-text-only": ("model: {hf: Qwen/Qwen3-Coder-Next}\nparallel: {tp: 8}\nvision: {buckets: [1024]}\n"
                            + BASE, "vision"),
    "vision-bucket-not-mergeable": ("model: {hf: Qwen/Qwen3.5-2B}\nvision: {buckets: [1022]}\n" + BASE,
                                    "vision.buckets.0"),
    "moe-backend-on-dense": ("model: {hf: Qwen/Qwen3.5-2B}\nmoe_backend: torch_blockwise\n" + BASE, "moe_backend"),
    "ep-on-dense": ("model: {hf: Qwen/Qwen3.5-2B}\nparallel: {tp: 2, ep: 2}\n" + BASE, "parallel.ep"),
    "ep-not-dividing-tp": ("model: {hf: Qwen/Qwen3.5-35B-A3B}\nparallel: {tp: 4, ep: 3}\n" + BASE, "parallel"),
    "over-device-memory": ("model: {hf: Qwen/Qwen3-Coder-Next}\nparallel: {tp: 4}\ndtype: bfloat16\n"
                           "text: {seq_len: 1024, cte_buckets: [128]}\n", "parallel.tp"),
    "path-not-a-dir": ("model: {path: ./does-not-exist}\n" + BASE, "model.path"),
    "bad-name": ("name: 'bad name!'\nmodel: {hf: Qwen/Qwen3.5-2B}\n" + BASE, "name"),
    "duplicate-key": ("model: {hf: Qwen/Qwen3.5-2B}\ndtype: float32\n" + BASE, "duplicate key"),
    "bad-target": ("model: {hf: Qwen/Qwen3.5-2B}\ncompiler: {target: trn9}\n" + BASE, "compiler.target"),
    # neuron builds: a port that serves the recipe and a pinned SDK
    "backend-auto-is-gone": ("model: {hf: Qwen/Qwen3.5-2B}\n" + BASE.replace("export", "auto"), "backend"),
    "neuron-without-port": ("model: {hf: Qwen/Qwen3.5-2B}\n" + NEURON_BASE, "port"),
    "neuron-without-pins": ("model: {hf: Qwen/Qwen3.5-2B}\nport: {path: ./p}\n" + NEURON_BASE.split("toolchain")[0],
                            "toolchain"),
    "moe-lineage-for-dense": ("model: {hf: Qwen/Qwen3.5-2B}\nport: {lineage: moe, path: ./p}\n" + NEURON_BASE,
                              "port.lineage"),
    "main-lineage-for-coder-next": ("model: {hf: Qwen/Qwen3-Coder-Next}\nparallel: {tp: 8}\n"
                                    "port: {lineage: main, path: ./p}\n" + NEURON_BASE, "port.lineage"),
    "main-lineage-with-ep": ("model: {hf: Qwen/Qwen3.5-35B-A3B}\nparallel: {tp: 8, ep: 2}\nport: {path: ./p}\n"
                             + NEURON_BASE, "parallel.ep"),
    "moe-lineage-with-ep": ("model: {hf: Qwen/Qwen3-Coder-Next}\nparallel: {tp: 8, ep: 2}\n"
                            "port: {path: ./p}\n" + NEURON_BASE, "parallel.ep"),
    "moe-lineage-with-vision": ("model: {hf: Qwen/Qwen3.5-35B-A3B}\nparallel: {tp: 8}\nvision: {buckets: [1024]}\n"
                                "port: {lineage: moe, path: ./p}\n" + NEURON_BASE, "vision"),
    "neuron-vision-not-bf16": ("model: {hf: Qwen/Qwen3.5-2B}\nvision: {buckets: [1024]}\ndtype: float32\n"
                               "port: {path: ./p}\n" + NEURON_BASE, "dtype"),
    "neuron-fp8-full": ("model: {hf: Qwen/Qwen3.5-27B}\nparallel: {tp: 8}\nfp8: full\nport: {path: ./p}\n"
                        + NEURON_BASE, "fp8"),
    "neuron-fp8-moe": ("model: {hf: Qwen/Qwen3.5-35B-A3B}\nparallel: {tp: 8}\nfp8: mlp_only\nport: {path: ./p}\n"
                       + NEURON_BASE, "fp8"),
    "port-path-and-module": ("model: {hf: Qwen/Qwen3.5-2B}\nport: {path: ./p, module: x}\n" + NEURON_BASE, "port"),
}


def _write(tmp: Path, name: str, text: str) -> Path:
    f = tmp / "recipes" / f"{name}.yaml"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(text)
    return f


def _assert_rejected(proc, recipe: Path, needle: str, tmp: Path) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(recipe) in lines[0] or recipe.name in lines[0], lines[0]
    assert needle in lines[0], lines[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp / "store").exists() and not (tmp / "artifacts.lock").exists()


@pytest.mark.parametrize("case", sorted(CASES))
def test_broken_recipe_exits_2_naming_file_and_field(tmp_path, case):
    text, needle = CASES[case]
    recipe = _write(tmp_path, case, text)
    proc = qbuild("compile", str(recipe), "--store", str(tmp_path / "store"), "--lock",
                  str(tmp_path / "artifacts.lock"), cwd=tmp_path)
    _assert_rejected(proc, recipe, needle, tmp_path)


def test_error_points_at_line_and_column(tmp_path):
    recipe = _write(tmp_path, "pos", "model: {hf: Qwen/Qwen3.5-2B}\nparallel:\n  tp: 3\n" + BASE)
    proc = qbuild("recipe", "validate", str(recipe))
    assert proc.returncode == 2
    assert f"{recipe}:3:" in proc.stderr  # the `tp` line


def test_extends_cycle(tmp_path):
    a = _write(tmp_path, "a", "extends: b.yaml\n")
    _write(tmp_path, "b", "extends: a.yaml\n")
    proc = qbuild("plan", str(a), "--store", str(tmp_path / "store"), "--lock", str(tmp_path / "artifacts.lock"))
    _assert_rejected(proc, a, "extends cycle", tmp_path)


def test_extends_missing_file(tmp_path):
    a = _write(tmp_path, "a", "extends: nowhere.yaml\nmodel: {hf: Qwen/Qwen3.5-2B}\n")
    proc = qbuild("plan", str(a), "--store", str(tmp_path / "store"), "--lock", str(tmp_path / "artifacts.lock"))
    _assert_rejected(proc, a, "extends", tmp_path)


def test_ep_not_dividing_experts(tmp_path):
    ckpt = _checkpoint(tmp_path, "Qwen/Qwen3.5-35B-A3B", num_experts=250)
    recipe = _write(tmp_path, "ep", f"model: {{path: {ckpt}}}\nparallel: {{tp: 4, ep: 4}}\n" + BASE)
    proc = qbuild("compile", str(recipe), "--store", str(tmp_path / "store"), "--lock",
                  str(tmp_path / "artifacts.lock"))
    _assert_rejected(proc, recipe, "parallel.ep", tmp_path)
    assert "250 experts" in proc.stderr


def test_deltanet_heads_not_divisible(tmp_path):
    ckpt = _checkpoint(tmp_path, "Qwen/Qwen3.5-2B", linear_num_value_heads=12)
    recipe = _write(tmp_path, "dn", f"model: {{path: {ckpt}}}\nparallel: {{tp: 8}}\n" + BASE)
    proc = qbuild("recipe", "validate", str(recipe))
    assert proc.returncode == 2 and "DeltaNet value heads" in proc.stderr


def test_unknown_model_type(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    recipe = _write(tmp_path, "llama", f"model: {{path: {d}}}\n" + BASE)
    proc = qbuild("plan", str(recipe), "--store", str(tmp_path / "store"), "--lock", str(tmp_path / "artifacts.lock"))
    assert proc.returncode == 2 and "model_type" in proc.stderr and "config.json" in proc.stderr
    assert not (tmp_path / "store").exists()


def test_a_recipe_switches_its_bases_hub_source_to_a_local_path(tmp_path):
    """The model source is one of two types; `hf: null` drops a base's hub repo (and the revision that pinned it)."""
    _write(tmp_path, "base", "model: {hf: Qwen/Qwen3.5-2B, revision: v1}\n" + BASE)
    local = load_recipe(_write(tmp_path, "local", "extends: base.yaml\nmodel: {hf: null, path: ./ckpt}\n"))
    assert local.recipe.model == PathSource(path="./ckpt")
    assert local.source_dir == (tmp_path / "recipes" / "ckpt").resolve()
    hub = load_recipe(tmp_path / "recipes" / "base.yaml")
    assert hub.recipe.model == HFSource(hf="Qwen/Qwen3.5-2B", revision="v1") and hub.source_dir is None
    with pytest.raises(RecipeError) as info:   # a path added without dropping the repo names two sources
        load_recipe(_write(tmp_path, "both", "extends: base.yaml\nmodel: {path: ./ckpt}\n"))
    assert str(info.value).endswith(":2:8: model: give exactly one of `hf` or `path`"), info.value
    with pytest.raises(RecipeError) as info:   # an error inside one source names its field, not the union's tag
        load_recipe(_write(tmp_path, "bad-repo", "model: {hf: 'not a repo'}\n" + BASE))
    assert str(info.value).endswith(":1:13: model.hf: String should match pattern '^[\\w.-]+/[\\w.-]+$'"), info.value


def test_shipped_recipes_validate():
    recipes = sorted(Path("recipes").glob("*.yaml"))
    assert len(recipes) == 5
    proc = qbuild("recipe", "validate", *map(str, recipes))
    assert proc.returncode == 0, proc.stderr


def test_schema_is_json_schema():
    proc = qbuild("recipe", "schema", check=True)
    schema = json.loads(proc.stdout)
    assert schema["additionalProperties"] is False and "parallel" in schema["properties"]
