"""Everything planning reads is in a key: an edit of each kind of input changes exactly the keys that depend on it,
and nothing else planning could see (other directories, unrelated variables) changes any. Planned with the real
environment over real files, every node keyed (each input's digest stands in for its output)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from qbuild.steps.registry import STEPS
from qbuild import backends
from qbuild.core.hashing import StatCache
from qbuild.planning.environment import HostEnvironment
from qbuild.planning.keys import walk
from qbuild.planning.plan import build_plan
from qbuild.recipe.schema import load_recipe
from tests.nxdi_double import MAIN_PORT

BASE = """\
text: {seq_len: 64, cte_buckets: [16, 32], tkg_buckets: [64]}
dtype: float32
verify: {top1_min: 0.9}
"""
CPU = """\
extends: base.yaml
name: cpu
model: {path: ck}
backend: export
"""
NEURON = """\
extends: base.yaml
name: nrn
model: {path: ck}
backend: neuron
dtype: bfloat16
port: {lineage: main, path: port}
toolchain: {sdk: "2.31.0"}
"""


@pytest.fixture
def project(tmp_path, tiny_checkpoints) -> Path:
    shutil.copytree(tiny_checkpoints["qwen3_5"], tmp_path / "ck")
    shutil.copytree(MAIN_PORT, tmp_path / "port")
    (tmp_path / "base.yaml").write_text(BASE)
    (tmp_path / "cpu.yaml").write_text(CPU)
    (tmp_path / "nrn.yaml").write_text(NEURON)
    return tmp_path


def _keys(project: Path) -> dict[tuple[str, str], str]:
    """(recipe, role) -> key, with each node's output digest taken to be its key."""
    recipes = [load_recipe(project / "cpu.yaml"), load_recipe(project / "nrn.yaml")]
    plan = build_plan(recipes, HostEnvironment(StatCache(project.parent / f"{project.name}-stat.db")),
                      backends=backends, steps=STEPS)
    keys = walk(plan, lambda nid, key: key)
    assert all(k.key for k in keys.values())
    return {(name, role): keys[nid].key for name, pr in plan.recipes.items() for role, nid in pr.nodes.items()}


def _changed(before: dict, after: dict) -> set[tuple[str, str]]:
    assert set(before) == set(after)
    return {k for k in before if before[k] != after[k]}


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def test_each_kind_of_input_changes_exactly_what_depends_on_it(project):
    before = _keys(project)

    # A recipe field: the verify thresholds of one recipe.
    _edit(project / "cpu.yaml", "backend: export", "backend: export\nverify: {top1_min: 0.8}")
    after = _keys(project)
    assert _changed(before, after) == {("cpu", "verify")}
    before = after

    # A base both recipes extend: its verify threshold, which the cpu recipe now sets itself.
    _edit(project / "base.yaml", "verify: {top1_min: 0.9}", "verify: {top1_min: 0.85}")
    after = _keys(project)
    assert _changed(before, after) == {("nrn", "verify")}
    before = after

    # A checkpoint file: the weights change fetch and everything below it; the compiles do not read weights.
    weights = next((project / "ck").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    after = _keys(project)
    below_weights = ("fetch", "convert", "shard", "package", "reference", "verify")
    assert _changed(before, after) == {(r, role) for r in ("cpu", "nrn") for role in below_weights}
    before = after

    # A port file: the port, and what runs it.
    port_file = next(p for p in (project / "port").rglob("*.py") if "test" not in p.parts)
    port_file.write_text(port_file.read_text() + "\nPROBE = 1\n")
    after = _keys(project)
    assert _changed(before, after) == {("nrn", role) for role in ("port", "shard", "compile text", "package", "verify")}
    before = after

    # The port's own switches, read while tracing: the compile.
    _edit(project / "nrn.yaml", "port: {lineage: main, path: port}",
          "port: {lineage: main, path: port, env: {SKIP_MOE_COMPUTE: '1'}}")
    after = _keys(project)
    assert _changed(before, after) == {("nrn", role) for role in ("compile text", "package", "verify")}


def test_nothing_else_changes_a_key(project, tmp_path_factory, monkeypatch):
    before = _keys(project)
    moved = tmp_path_factory.mktemp("moved") / "project"
    shutil.copytree(project, moved)
    for name in ("SKIP_MOE_COMPUTE", "NEURON_CC_FLAGS", "TMPDIR", "HOME", "USER", "LANG", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(name, "1" if name != "TMPDIR" else str(tmp_path_factory.mktemp("tmp")))
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))
    after = _keys(moved)
    assert after == before
