"""The plan of a build without the converted bytes: shard reads the description and the checkpoint, the materialized
weights are a node of their own that changes no other key, and the plan says what a build writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from qbuild.planning.step import Source
from qbuild.steps.registry import STEPS
from qbuild import backends
from qbuild.planning.keys import walk
from qbuild.planning.plan import build_plan, written_bytes
from tests.conftest import REPO
from tests.test_planner import FakeEnvironment, _cpu


def _plan(tmp_path, keep: bool = False):
    env = FakeEnvironment(checkpoints={tmp_path / "ck": {"config.json": "blake3:1", "model.safetensors": "blake3:2"}})
    return build_plan([_cpu(tmp_path, "one"), _cpu(tmp_path, "two", tp=2)], env, keep_intermediates=keep,
                      backends=backends, steps=STEPS)


def test_shard_reads_the_description_and_the_checkpoint_where_the_fetch_found_it(tmp_path):
    plan = _plan(tmp_path)
    roles = plan.recipes["one"].nodes
    shard, fetch = plan.nodes[roles["shard"]], plan.nodes[roles["fetch"]]
    assert shard.deps == {"converted": roles["convert"], "snapshot": roles["fetch"]}
    assert shard.source == fetch.source == Source(path=str(tmp_path / "ck"))


def _keys(plan) -> dict[str, str | None]:
    return {nid: nk.key for nid, nk in walk(plan, lambda nid, key: "blake3:" + nid).items()}


def test_keeping_the_intermediates_adds_one_node_and_changes_no_other(tmp_path):
    plain, kept = _plan(tmp_path), _plan(tmp_path, keep=True)
    extra = set(kept.nodes) - set(plain.nodes)
    assert len(extra) == 1 and set(plain.nodes) <= set(kept.nodes)
    (nid,) = extra
    node = kept.nodes[nid]
    roles = kept.recipes["one"].nodes
    assert node.kind == "materialize" and node.deps == {"converted": roles["convert"], "snapshot": roles["fetch"]}
    assert kept.recipes["one"].kept == kept.recipes["two"].kept == nid     # one per conversion, shared like it
    assert all(nid not in pr.nodes.values() for pr in kept.recipes.values())   # no role: never locked
    keys = _keys(kept)
    assert {n: k for n, k in keys.items() if n != nid} == _keys(plain) and keys[nid] is not None


def test_the_bytes_a_build_writes_count_each_node_once_and_a_bundles_links_not_at_all(tmp_path):
    plan = _plan(tmp_path)
    roles = plan.recipes["one"].nodes
    w = written_bytes(plan, "one")
    nodes = [plan.nodes[n] for r, n in roles.items() if r != "fetch"]
    assert w.model == plan.nodes[roles["fetch"]].est_out_bytes
    package = plan.nodes[roles["package"]]
    assert package.est_new_bytes < package.est_out_bytes
    assert w.written == sum(n.est_out_bytes for n in nodes) - package.est_out_bytes + package.est_new_bytes


def test_the_plan_of_each_shipped_recipe_says_what_it_writes(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "qbuild.cli", "plan", "--all", "--json", "--lock",
                           str(tmp_path / "artifacts.lock")], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    for name, entry in doc["recipes"].items():
        b = entry["bytes"]
        assert b["ratio"] == round(b["written"] / b["model"], 3), name
        # shards of the model's dtype, the vision weights once, graphs and reports; never a second copy
        assert 0.5 < b["ratio"] < 1.05, (name, b)
    assert doc["recipes"]["35b-a3b-tp8"]["bytes"]["ratio"] <= 1.02
    tree = subprocess.run([sys.executable, "-m", "qbuild.cli", "plan", "recipes/35b-a3b-tp8.yaml", "--lock",
                           str(tmp_path / "artifacts.lock")], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"})
    # The tree's headline says what the JSON says, in GiB.
    import re
    b = doc["recipes"]["35b-a3b-tp8"]["bytes"]
    m = re.search(r"writes ~([\d.]+) GiB \(([\d.]+)x the model's ([\d.]+) GiB\)", tree.stdout)
    assert m, tree.stdout[:400]
    assert float(m[1]) == round(b["written"] / 2**30, 1) and float(m[3]) == round(b["model"] / 2**30, 1), (m[0], b)
    assert float(m[2]) == round(b["ratio"], 2), (m[0], b)


def test_keep_intermediates_builds_the_materialized_weights_and_leaves_the_lock_alone(tmp_path, dense_project):
    import shutil

    from qbuild.store.manifest import Manifest
    from tests.conftest import qbuild

    project = Path(shutil.copytree(dense_project, tmp_path / "project"))
    lock = (project / "artifacts.lock").read_bytes()
    out = json.loads(qbuild("compile", "--all", "--keep-intermediates", "--json", "--store", "store", cwd=project,
                            check=True).stdout)
    assert len(out["built"]) == 1 and out["failed"] == {}
    assert (project / "artifacts.lock").read_bytes() == lock
    manifests = [Manifest.from_json(json.loads(p.read_text())) for p in (project / "store" / "ac").rglob("*.json")]
    kept = [m for m in manifests if m.kind == "materialize"]
    assert len(kept) == 1
    assert "text/model.safetensors.index.json" in kept[0].outputs
    assert any(rel.startswith("text/model-") for rel in kept[0].outputs)
    convert = [m for m in manifests if m.kind == "convert"]
    assert [rel for rel in convert[0].outputs if rel.startswith("text/")] == ["text/description.json"]
    # A CI build that must not change the lock may keep them too; and one without the flag builds nothing.
    qbuild("compile", "--all", "--frozen", "--keep-intermediates", "--store", "store", cwd=project, check=True)
    again = json.loads(qbuild("compile", "--all", "--frozen", "--json", "--store", "store", cwd=project,
                              check=True).stdout)
    assert again["built"] == []
    # Never locked, the kept weights are a cache entry like any other: gc keeps them within --keep-size, LRU.
    local, = json.loads(qbuild("gc", "--keep-size", "0", "--grace", "0", "--json", "--store", "store", cwd=project,
                               check=True).stdout)
    assert [r["kind"] for r in local["removed"] if r["what"] == "manifest"] == ["materialize"]
    assert (project / "artifacts.lock").read_bytes() == lock
    assert json.loads(qbuild("compile", "--all", "--json", "--store", "store", cwd=project,
                             check=True).stdout)["built"] == []


def test_kept_intermediates_count_in_what_the_plan_says_a_build_writes(tmp_path):
    plain, kept = _plan(tmp_path), _plan(tmp_path, keep=True)
    materialize = kept.nodes[kept.recipes["one"].kept]
    assert written_bytes(kept, "one").written == written_bytes(plain, "one").written + materialize.est_out_bytes
