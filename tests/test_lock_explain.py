"""The lockfile and explain, against the real tiny build that conftest makes once per run (dense_project)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from qbuild.core.hashing import digest_json
from qbuild.planning import lock as lockmod
from tests.conftest import REPO, qbuild

# One copy of the built project serves the whole file, on one worker, outside the fast lane.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("lock-explain")]

RECIPE = Path("recipes") / "tiny-dense.yaml"   # conftest's dense_project: the tiny Qwen3.5, buckets cte 32, tkg 48
NAME = "tiny-dense"


@pytest.fixture(scope="module")
def built(tmp_path_factory, dense_project):
    """A private copy of conftest's built project, for the tests that only read it: (dir, recipe, store, lock, env)."""
    root = Path(shutil.copytree(dense_project, tmp_path_factory.mktemp("locked") / "project", symlinks=True))
    # PYTHONPATH too: this module fixture runs before the per-test environment is set up, and without it the CLI
    # would import an installed qbuild instead of this tree's.
    env = {"QBUILD_STORE": str(root / "store"), "XDG_CACHE_HOME": str(root / "cache"), "PYTHONPATH": str(REPO)}
    return root, root / RECIPE, root / "store", root / "artifacts.lock", env


def _copy(built, tmp_path) -> tuple[Path, Path, dict]:
    """A private copy of the built workspace (store and lock), for tests that damage or change it."""
    root, recipe, store, lock, env = built
    shutil.copytree(store, tmp_path / "store", symlinks=True)
    shutil.copy(lock, tmp_path / "artifacts.lock")
    (tmp_path / RECIPE).parent.mkdir()
    shutil.copy(recipe, tmp_path / RECIPE)
    return tmp_path / RECIPE, tmp_path / "artifacts.lock", {**env, "QBUILD_STORE": str(tmp_path / "store")}


def test_lockfile_is_deterministic_sorted_and_round_trips(built):
    root, recipe, store, lock, env = built
    text = lock.read_text()
    doc = lockmod.read(lock)
    assert doc.dumps() == text and json.loads(text)["version"] == lockmod.LOCK_VERSION
    entry = doc.recipes[NAME]
    assert entry.model.source == "path" and entry.model.files["config.json"].startswith("blake3:")
    assert entry.bundle and entry.verified is True
    assert set(entry.nodes) == {"fetch", "convert", "shard", "compile cte-32", "compile tkg-48", "package",
                                "reference", "verify"}
    node = doc.node(NAME, "compile cte-32")
    assert node.preimage["params"]["bucket"] == 32 and "torch" in node.preimage["toolchain"]
    assert all(set(o) == {"digest", "size"} for o in json.loads(text)["nodes"][entry.nodes["package"]]["outputs"]
               .values())
    # Merging the same entries again changes nothing, byte for byte.
    written = lockmod.Lock(recipes={NAME: entry}, nodes={nid: doc.nodes[nid] for nid in entry.nodes.values()})
    assert lockmod.merge(doc, written).dumps() == text


def test_noop_and_lock_check(built):
    root, recipe, store, lock, env = built
    before = lock.read_text()
    out = qbuild("compile", str(recipe), "--lock", str(lock), "--json", cwd=root, env=env, check=True)
    assert json.loads(out.stdout)["built"] == []
    assert lock.read_text() == before
    qbuild("lock", "check", "--lock", str(lock), cwd=root, env=env, check=True)


def test_lock_check_names_a_corrupt_artifact(built, tmp_path):
    recipe, lock, env = _copy(built, tmp_path)
    node = lockmod.read(lock).node(NAME, "compile cte-32")
    rel, out = sorted(node.outputs.items())[-1]
    blob = tmp_path / "store" / "cas" / out.digest[:2] / out.digest
    os.chmod(blob, 0o644)
    data = bytearray(blob.read_bytes())
    data[-1] ^= 1
    blob.write_bytes(bytes(data))
    proc = qbuild("lock", "check", "--lock", str(lock), env=env)
    assert proc.returncode == 1 and f"compile cte-32: {rel}" in proc.stderr


def test_explain_says_cached_or_names_the_changed_field(built, tmp_path):
    recipe, lock, env = _copy(built, tmp_path)
    proc = qbuild("explain", str(recipe), "--lock", str(lock), "--json", env=env, check=True)
    assert {row["why"] for row in json.loads(proc.stdout)} == {"cached"}
    recipe.write_text(recipe.read_text().replace("dtype: float32", "dtype: bfloat16"))
    rows = {r["name"]: r for r in json.loads(qbuild("explain", str(recipe), "--lock", str(lock), "--json",
                                                    env=env, check=True).stdout)}
    compile_row = next(r for n, r in rows.items() if n.startswith("compile cte-32"))
    assert "params.dtype: float32 -> bfloat16" in compile_row["why"]
    fetch_row = next(r for n, r in rows.items() if n.startswith("fetch"))
    assert fetch_row["why"] == "cached"
    # A node id from `qbuild plan` works too.
    nid = compile_row["id"]
    proc = qbuild("explain", nid[:10], "--recipe", str(recipe), "--lock", str(lock), env=env, check=True)
    assert "params.dtype: float32 -> bfloat16" in proc.stdout


def test_explain_names_a_changed_converter_source(built, tmp_path):
    recipe, lock, env = _copy(built, tmp_path)
    doc = json.loads(lock.read_text())
    conv = doc["nodes"][doc["recipes"][NAME]["nodes"]["convert"]]
    stored_key = conv["key"]
    conv["preimage"]["version"] = "0" * 32   # as if the lock was written by another converter version
    conv["key"] = digest_json(conv["preimage"])
    lock.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    # Everything is cached, so the lock's record alone changes nothing the store answers.
    rows = json.loads(qbuild("explain", str(recipe), "--lock", str(lock), "--json", env=env, check=True).stdout)
    assert {r["why"] for r in rows} == {"cached"}
    # With the convert entry gone from the store, convert is a miss: explain names its changed field.
    _drop_entry(tmp_path / "store", stored_key)
    rows = json.loads(qbuild("explain", str(recipe), "--lock", str(lock), "--json", env=env, check=True).stdout)
    by_name = {r["name"].split()[0]: r for r in rows}
    assert by_name["convert"]["status"] == "build" and by_name["convert"]["why"] == "version changed"
    assert by_name["fetch"]["why"] == "cached"
    # Below the miss, shard waits on convert's output, and nothing of its own changed.
    assert by_name["shard"]["status"] == "waiting" and by_name["shard"]["why"] == "waits on converted"


def test_explain_names_a_field_changed_below_a_miss(built, tmp_path):
    """A step whose input is not built yet is keyed with the input's locked digest, so a change to the step itself
    is named even though its key cannot be known."""
    recipe, lock, env = _copy(built, tmp_path)
    doc = json.loads(lock.read_text())
    nodes = doc["recipes"][NAME]["nodes"]
    _drop_entry(tmp_path / "store", doc["nodes"][nodes["convert"]]["key"])
    shard = doc["nodes"][nodes["shard"]]
    shard["preimage"]["params"]["fused_qkv"] = not shard["preimage"]["params"]["fused_qkv"]
    shard["preimage"]["version"] = "0" * 32
    shard["key"] = digest_json(shard["preimage"])
    lock.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    rows = json.loads(qbuild("explain", str(recipe), "--lock", str(lock), "--json", env=env, check=True).stdout)
    by_name = {r["name"].split()[0]: r for r in rows}
    fused = shard["preimage"]["params"]["fused_qkv"]
    assert by_name["shard"]["status"] == "waiting"
    assert by_name["shard"]["why"] == f"waits on converted; params.fused_qkv: {fused} -> {not fused}; version changed"
    # Two levels below the miss (package waits on shard and convert): unchanged itself, so it only waits.
    assert by_name["package"]["why"] == "waits on converted, shard"
    # `plan` keeps its short reasons: a waiting node's key is unknown.
    plan = json.loads(qbuild("plan", str(recipe), "--lock", str(lock), "--json", env=env, check=True).stdout)
    shard_plan = next(n for n in plan["nodes"] if n["kind"] == "shard")
    assert shard_plan["status"] == "waiting" and shard_plan["why"] == "waits on converted"


def _drop_entry(store: Path, key: str) -> None:
    """Remove one store entry (its manifest), so that node is a miss and everything below it waits."""
    (store / "ac" / key[:2] / f"{key}.json").unlink()


def test_frozen_refuses_to_change_the_lockfile(built, tmp_path):
    recipe, lock, env = _copy(built, tmp_path)
    # Run where the lock was written from (it records recipe paths relative to the working directory).
    ok = qbuild("compile", str(RECIPE), "--lock", str(lock), "--frozen", env=env, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    before = lock.read_text()
    recipe.write_text(recipe.read_text().replace("new_tokens: 2", "new_tokens: 3"))
    proc = qbuild("compile", str(RECIPE), "--lock", str(lock), "--frozen", env=env, cwd=tmp_path)
    assert proc.returncode == 1 and "--frozen" in proc.stderr and "params.new_tokens: 2 -> 3" in proc.stderr
    assert lock.read_text() == before


# The CLI with `import torch` refused: what a command must do without torch, it does.
NO_TORCH = """\
import sys


class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("this command imported torch")
        return None


sys.meta_path.insert(0, _NoTorch())
"""


def test_a_recipe_edited_since_it_was_locked_is_named_without_importing_torch(built, tmp_path):
    recipe, lock, env = _copy(built, tmp_path)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(NO_TORCH)
    env = {**env, "PYTHONPATH": f"{hook}{os.pathsep}{REPO}"}
    proc = qbuild("pull", NAME, "--to", str(tmp_path / "b"), "--lock", str(lock), env=env, cwd=tmp_path)
    assert proc.returncode == 0 and "note:" not in proc.stderr, proc.stderr
    recipe.write_text(recipe.read_text().replace("top1_min: 0.99", "top1_min: 0.9"))
    proc = qbuild("pull", NAME, "--to", str(tmp_path / "c"), "--lock", str(lock), env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines()[0] == (
        f"note: {NAME}: {recipe.resolve()} changed since it was locked (verify: params.top1_min: 0.99 -> 0.9); the "
        f"lock holds what it asked for before: `qbuild compile {recipe.resolve()}` builds what it asks for now")
    proc = qbuild("pull", NAME, "--to", str(tmp_path / "d"), "--lock", str(lock), "--strict", env=env, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {NAME}: ") and "--strict refuses" in proc.stderr
    assert not (tmp_path / "d").exists()


def test_bench_refuses_more_new_tokens_than_the_cache_holds_instead_of_cutting_them(built, tmp_path):
    recipe, lock, env = _copy(built, tmp_path)
    args = ("bench", NAME, "--lock", str(lock), "--repeats", "1", "--warmup", "0")
    proc = qbuild(*args, "--new-tokens", "500", env=env, cwd=tmp_path)
    # conftest's recipe: CTE bucket 32 (the longest prompt swept), KV cache 48 tokens: room for 48 - 32 + 1
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: --new-tokens 500: after the longest prompt (32 tokens) the KV cache (48 tokens) holds 17 more; pass "
        "at most 17"), proc.stderr
    doc = json.loads(qbuild(*args, "--new-tokens", "17", "--json", env=env, cwd=tmp_path, check=True).stdout)
    assert [(p["prompt_len"], p["new_tokens"]) for p in doc["points"]] == [(16, 17), (32, 17)]
