"""The planner: sharing across recipes, key stability, keys that change exactly when an allow-listed input does."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, qbuild

TINY = """\
model: {{path: {path}}}
parallel: {{tp: {tp}}}
text: {{seq_len: 128, cte_buckets: {cte}}}
dtype: {dtype}
backend: export
"""


def _recipe(root: Path, name: str, path: Path, tp: int = 1, cte: str = "[32, 64]", dtype: str = "float32",
            extra: str = "") -> Path:
    f = root / f"{name}.yaml"
    f.write_text(TINY.format(path=path, tp=tp, cte=cte, dtype=dtype) + extra)
    return f


def _plan(*recipes: Path, cwd: Path | None = None, env: dict | None = None) -> dict:
    proc = qbuild("plan", "--json", *map(str, recipes), cwd=cwd, env=env, check=True)
    return json.loads(proc.stdout)


def _by_role(doc: dict, recipe: str) -> dict[str, dict]:
    nodes = {n["id"]: n for n in doc["nodes"]}
    return {role: nodes[nid] for role, nid in doc["recipes"][recipe]["nodes"].items()}


def test_tp_variants_share_fetch_convert_and_reference(tmp_path, tiny_checkpoints):
    ck = tiny_checkpoints["qwen3_5"]
    doc = _plan(_recipe(tmp_path, "a-tp1", ck, tp=1), _recipe(tmp_path, "a-tp2", ck, tp=2))
    one, two = _by_role(doc, "a-tp1"), _by_role(doc, "a-tp2")
    for role in ("fetch", "convert", "reference"):
        assert one[role]["id"] == two[role]["id"], role
        assert sorted(one[role]["recipes"]) == ["a-tp1", "a-tp2"]
    for role in ("shard", "compile cte-32", "package", "verify"):
        assert one[role]["id"] != two[role]["id"], role
    # Shared nodes appear once in the document.
    ids = [n["id"] for n in doc["nodes"]]
    assert len(ids) == len(set(ids))


def test_plan_json_shape_and_statuses(tmp_path, tiny_checkpoints):
    doc = _plan(_recipe(tmp_path, "t", tiny_checkpoints["qwen3_next"]))
    roles = _by_role(doc, "t")
    assert set(roles) == {"fetch", "convert", "shard", "compile cte-32", "compile cte-64", "compile tkg-128",
                          "package", "reference", "verify"}
    for n in doc["nodes"]:
        assert set(n) >= {"id", "kind", "recipes", "key", "deps", "status", "params"}
    # Nothing is built yet: nodes without inputs have keys and are to build; the rest wait on an upstream output.
    assert roles["fetch"]["status"] == "build" and roles["fetch"]["key"]
    assert roles["compile cte-32"]["status"] == "build" and roles["compile cte-32"]["key"]
    assert roles["convert"]["status"] == "waiting" and roles["convert"]["key"] is None
    assert roles["verify"]["deps"] == {"bundle": roles["package"]["id"], "reference": roles["reference"]["id"]}


def test_keys_are_stable_across_runs_and_machines(tmp_path, tiny_checkpoints):
    """Another checkout location, another store, another cache, another copy of the checkpoint: same keys."""
    ck = tiny_checkpoints["qwen3_5_moe"]
    a = _plan(_recipe(tmp_path, "m", ck, tp=2))
    other = tmp_path / "elsewhere"
    other.mkdir()
    shutil.copytree(ck, other / "copy")
    b = _plan(_recipe(other, "m", other / "copy", tp=2),
              env={"XDG_CACHE_HOME": str(other / "cache"), "QBUILD_STORE": str(other / "store")})
    ka = {r: n["key"] for r, n in _by_role(a, "m").items()}
    kb = {r: n["key"] for r, n in _by_role(b, "m").items()}
    assert ka == kb and ka["fetch"] and ka["compile cte-32"]


def test_key_changes_exactly_when_an_allow_listed_input_changes(tmp_path, tiny_checkpoints):
    ck = tiny_checkpoints["qwen3_5"]
    base = _by_role(_plan(_recipe(tmp_path, "k", ck, cte="[32, 64]")), "k")
    # A bucket change: only that bucket's graph (and what consumes it) changes.
    bucket = _by_role(_plan(_recipe(tmp_path, "k", ck, cte="[32, 96]")), "k")
    assert bucket["compile cte-32"]["key"] == base["compile cte-32"]["key"]
    assert bucket["compile tkg-128"]["key"] == base["compile tkg-128"]["key"]
    assert "compile cte-64" not in bucket and bucket["compile cte-96"]["key"] != base["compile cte-64"]["key"]
    assert bucket["fetch"]["key"] == base["fetch"]["key"] and bucket["convert"]["id"] == base["convert"]["id"]
    # Fields outside the allow-list (thresholds, the recipe's name) change no compile or convert key.
    other = _by_role(_plan(_recipe(tmp_path, "renamed", ck, extra="verify: {top1_min: 0.5}\n")), "renamed")
    for role in ("fetch", "convert", "shard", "compile cte-32", "compile tkg-128", "reference"):
        assert other[role]["id"] == base[role]["id"], role
    assert other["verify"]["id"] != base["verify"]["id"]
    # dtype enters convert and compile.
    bf16 = _by_role(_plan(_recipe(tmp_path, "k", ck, dtype="bfloat16")), "k")
    assert bf16["convert"]["id"] != base["convert"]["id"]
    assert bf16["compile cte-32"]["key"] != base["compile cte-32"]["key"]
    assert bf16["fetch"]["key"] == base["fetch"]["key"]


def test_changing_weights_changes_fetch_but_no_compile_key(tmp_path, tiny_checkpoints):
    from qbuild.model.tinymodel import FOUR_LAYERS, write_tiny_checkpoint

    ck2 = write_tiny_checkpoint(tmp_path / "seed1", "qwen3_next", seed=1, text_overrides=FOUR_LAYERS)
    a = _by_role(_plan(_recipe(tmp_path, "w", tiny_checkpoints["qwen3_next"])), "w")
    b = _by_role(_plan(_recipe(tmp_path, "w", ck2)), "w")
    assert a["fetch"]["key"] != b["fetch"]["key"]
    for role in ("compile cte-32", "compile cte-64", "compile tkg-128"):
        assert a[role]["key"] == b[role]["key"], role


def test_plan_never_imports_torch_and_plans_shipped_recipes_offline(tmp_path):
    """Offline and without pins (an empty lockfile), the shipped recipes' `revision: main` cannot be resolved: each
    fetch is planned without a key and says why, and the rest of the plan is still shown."""
    code = ("import sys, io, contextlib; from qbuild.cli import app\n"
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n"
            f"    app(['plan', '--all', '--json', '--lock', {str(tmp_path / 'artifacts.lock')!r}], "
            "standalone_mode=False)\n"
            "heavy = [m for m in ('torch', 'transformers', 'boto3', 'ray', 'safetensors', 'huggingface_hub')"
            " if m in sys.modules]\n"
            "print(heavy); print(out.getvalue())\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    heavy, _, doc = proc.stdout.partition("\n")
    assert heavy == "[]", heavy
    plan = json.loads(doc)
    assert set(plan["recipes"]) == {"2b-tp8", "2b-vl-tp8", "27b-tp4", "35b-a3b-tp8", "35b-a3b-vl-tp8",
                                    "36-27b-fp8-128k", "coder-next-tp8"}
    # The 27B and 3.6-27B recipes differ in weights only through the model source.
    kinds = {n["kind"] for n in plan["nodes"]}
    assert kinds == {"fetch", "port", "convert", "shard", "compile", "package", "reference", "verify"}
    for fetch in (n for n in plan["nodes"] if n["kind"] == "fetch"):
        repo = fetch["params"]["repo"]
        assert fetch["status"] == "unresolved" and fetch["key"] is None, fetch
        assert fetch["why"].endswith(f"model.hf: {repo}@main is not resolved (offline); pin a commit in the recipe "
                                     "or run 'qbuild lock update' online"), fetch["why"]
    # Every shipped recipe is a neuron build: one text compile with every bucket, one vision compile per bucket.
    by_id = {n["id"]: n for n in plan["nodes"]}
    assert {name: entry["port"]["lineage"] for name, entry in plan["recipes"].items()} == {
        "2b-tp8": "main", "2b-vl-tp8": "main", "27b-tp4": "main-replicated", "35b-a3b-tp8": "main",
        "35b-a3b-vl-tp8": "main", "36-27b-fp8-128k": "main", "coder-next-tp8": "moe"}
    for name, entry in plan["recipes"].items():
        assert entry["backend"] == "neuron", name
        compiles = [by_id[nid] for role, nid in entry["nodes"].items() if role.startswith("compile")]
        text = [n for n in compiles if n["params"]["graph"] == "text"]
        assert len(text) == 1, name
        params = text[0]["params"]
        # With prefix caching each CTE bucket is compiled once per prefix length, prefix 0 included.
        prefixes = 1 + len((params.get("block_kv") or {}).get("prefix_buckets", ()))
        assert text[0]["neffs"] == len(params["cte_buckets"]) * prefixes + len(params["tkg_buckets"]), name
    assert by_id[plan["recipes"]["36-27b-fp8-128k"]["nodes"]["compile text"]]["neffs"] == 3


def test_plan_tree_names_status_and_why(tmp_path, tiny_checkpoints):
    f = _recipe(tmp_path, "tree", tiny_checkpoints["qwen3_next"])
    proc = qbuild("plan", str(f), check=True, env={"COLUMNS": "200"})
    out = proc.stdout
    assert "tree" in out and "verify tree" in out and "compile cte-32" in out
    assert "to build" in out and "waiting" in out and "no entry" in out and "waits on" in out
