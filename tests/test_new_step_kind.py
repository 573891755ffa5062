"""A new step kind is one module and one entry in the registry (docs/developer-guide.md, "Adding a step kind").

On a copy of the package, a toy step kind (checksums: sha256sum of a recipe's bundle) is added as qbuild/steps/
checksums.py and its class in qbuild/steps/registry.py's list (with its import), nothing else; the real CLI then plans it, builds it into the
store, locks it, reuses it, and re-keys it (and it alone) when its module's code changes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

TOY = '''"""checksums: the SHA-256 of every file of a recipe's bundle, as sha256sum writes them."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from qbuild.planning.step import Context, PlannedNode, Step


@dataclass(frozen=True)
class ChecksumParams:
    algorithm: str = "sha256"


class Checksums(Step):
    kind = "checksums"
    params = ChecksumParams
    inputs = ("bundle",)

    @classmethod
    def plan(cls, recipe) -> None:
        recipe.add(PlannedNode("checksums", cls.kind, f"checksums {recipe.name}", ChecksumParams(),
                               {"bundle": "package"}, 1 << 16, 1 << 20))

    @classmethod
    def run(cls, ctx: Context) -> None:
        bundle = ctx.inputs["bundle"]
        lines = [f"{hashlib.new(ctx.params.algorithm, p.read_bytes()).hexdigest()}  {p.relative_to(bundle)}"
                 for p in sorted(bundle.rglob("*")) if p.is_file()]
        (ctx.out / "SHA256SUMS").write_text("\\n".join(lines) + "\\n")
'''

RECIPE = """name: toy
model: {{path: {model}}}
text: {{seq_len: 48, cte_buckets: [32], tkg_buckets: [48]}}
dtype: float32
backend: export
verify: {{prompts: ["Hello"], new_tokens: 2, top1_min: 0.99, token_match_min: 1.0, max_logit_err: 0.001}}
"""


@pytest.fixture
def project(tmp_path, small_checkpoints) -> Path:
    """A copy of the package with the toy step kind: its module, and one line appended to the registry's list."""
    root = tmp_path / "src"
    shutil.copytree(REPO / "qbuild", root / "qbuild", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "qbuild" / "steps" / "checksums.py").write_text(TOY)
    registry = root / "qbuild" / "steps" / "registry.py"
    text = registry.read_text()
    assert text.rstrip().endswith("]") and "\nSTEPS" in text
    head, _, tail = text.rstrip()[:-1].partition("\nSTEPS")
    registry.write_text(f"{head}from qbuild.steps.checksums import Checksums\n\nSTEPS{tail}    Checksums,\n]\n")
    work = tmp_path / "work"
    (work / "recipes").mkdir(parents=True)
    (work / "recipes" / "toy.yaml").write_text(RECIPE.format(model=small_checkpoints["qwen3_5"]))
    return root


def _qbuild(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root), "QBUILD_STORE": str(root.parent / "store")}
    proc = subprocess.run([sys.executable, "-m", "qbuild.cli", *args], cwd=root.parent / "work", env=env,
                          capture_output=True, text=True)
    assert not check or proc.returncode == 0, proc.stderr
    return proc


def _toy_node(root: Path) -> dict:
    doc = json.loads(_qbuild(root, "plan", "--json", "recipes/toy.yaml").stdout)
    nodes = {n["id"]: n for n in doc["nodes"]}
    planned = {role: nodes[nid] for role, nid in doc["recipes"]["toy"]["nodes"].items()}
    return planned


def test_a_toy_step_kind_is_one_module_and_one_registry_line(project):
    root = project
    planned = _toy_node(root)
    assert planned["checksums"]["kind"] == "checksums"
    assert planned["checksums"]["deps"] == {"bundle": planned["package"]["id"]}

    _qbuild(root, "compile", "recipes/toy.yaml")
    lock = json.loads((root.parent / "work" / "artifacts.lock").read_text())
    entry = lock["nodes"][lock["recipes"]["toy"]["nodes"]["checksums"]]
    assert entry["kind"] == "checksums"

    # What it built is the sums of the bundle's files, as the store holds both.
    out = root.parent / "pulled"
    _qbuild(root, "pull", "toy", "--to", str(out))
    from qbuild.store.local import LocalStore

    store = LocalStore(root.parent / "store")
    manifest = store.get_manifest(entry["key"])
    sums = store.blob_path(manifest.outputs["SHA256SUMS"]["digest"]).read_text().splitlines()
    expected = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(out)}"
                for p in sorted(out.rglob("*")) if p.is_file()]
    assert sums == expected and len(sums) > 3

    # Built once: the next plan has it cached; an edit of its module's code re-keys it and nothing else.
    again = _toy_node(root)
    assert {role: n["status"] for role, n in again.items()} == {role: "cached" for role in again}
    toy = root / "qbuild" / "steps" / "checksums.py"
    toy.write_text(toy.read_text().replace('lines = [', 'lines = [] + ['))
    edited = _toy_node(root)
    assert {role for role, n in edited.items() if n["key"] != again[role]["key"]} == {"checksums"}


def test_a_step_kind_without_run_kind_or_params_is_refused_where_it_is_defined():
    """The base Step defines no run: a kind that forgets one (or its kind, or its params) is a TypeError as its module
    is imported, naming what it lacks, not a failure when a node of it first runs."""
    from qbuild.planning.step import Step

    with pytest.raises(TypeError, match=r"^step kind .*NoRun does not set run$"):
        class NoRun(Step):
            kind = "no-run"
            params = dict
    with pytest.raises(TypeError, match=r"does not set kind, params$"):
        class Bare(Step):
            @classmethod
            def run(cls, ctx) -> None:
                pass
