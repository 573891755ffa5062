"""The real pipeline under SIGKILL and under concurrent builders sharing one store."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import qbuild

RECIPE = """\
model: {{path: {path}}}
text: {{seq_len: 128, cte_buckets: [32], tkg_buckets: [128]}}
dtype: float32
backend: export
verify: {{new_tokens: 4, top1_min: 0.99, token_match_min: 1.0, max_logit_err: 0.001}}
"""


@pytest.fixture
def recipe(tmp_path, tiny_checkpoints) -> Path:
    f = tmp_path / "crashy.yaml"
    f.write_text(RECIPE.format(path=tiny_checkpoints["qwen3_next"]))
    return f


def _compile_until(recipe: Path, store: Path, lock: Path, trigger: str, delay: float) -> bool:
    """Run `qbuild compile` and SIGKILL its whole process group `delay` s after a line starting `trigger`.

    Returns whether the kill happened (False: the build finished first)."""
    proc = subprocess.Popen([sys.executable, "-m", "qbuild.cli", "compile", str(recipe), "--store", str(store),
                             "--lock", str(lock)], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            start_new_session=True, env=os.environ.copy())
    killed = threading.Event()

    def kill_later():
        time.sleep(delay)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            killed.set()

    for line in proc.stderr:
        if line.startswith(trigger):
            threading.Thread(target=kill_later, daemon=True).start()
            break
    proc.stderr.read()
    proc.wait(timeout=600)
    time.sleep(delay + 0.1)
    return killed.is_set()


def _store_problems(store: Path) -> list[str]:
    proc = qbuild("store", "verify", "--json", "--store", str(store))
    return json.loads(proc.stdout)["problems"]


def test_sigkill_at_any_moment_leaves_a_consistent_store_and_the_next_run_finishes(recipe, tmp_path):
    store, lock = tmp_path / "store", tmp_path / "artifacts.lock"
    rng = random.Random(7)
    points = [("start  fetch", 0.0), ("start  convert", 0.05), ("start  convert", rng.uniform(0.5, 3)),
              ("start  shard", 0.0), ("start  shard", rng.uniform(0.2, 1)), ("start  compile", 0.1),
              ("start  compile", rng.uniform(1, 5)), ("start  compile tkg", rng.uniform(0.5, 4)),
              ("start  package", 0.0), ("start  package", rng.uniform(0.1, 1)), ("start  reference", rng.uniform(1, 4)),
              ("start  verify", rng.uniform(0.5, 4))]
    kills = 0
    for trigger, delay in points:
        kills += _compile_until(recipe, store, lock, trigger, delay)
        # Consistent after every kill: no corrupt blob, no manifest missing a blob. Only a killed step's own
        # staging dir may remain, and the next run clears it.
        assert [p for p in _store_problems(store) if not p.startswith("orphaned staging")] == []
        if lock.exists():
            json.loads(lock.read_text())  # never torn
    assert kills >= 10, f"only {kills} kill points were reached"
    qbuild("compile", str(recipe), "--store", str(store), "--lock", str(lock), check=True)
    qbuild("lock", "check", "--store", str(store), "--lock", str(lock), check=True)
    assert _store_problems(store) == []
    again = qbuild("compile", str(recipe), "--store", str(store), "--lock", str(lock), "--json", check=True)
    assert json.loads(again.stdout)["built"] == []


@pytest.mark.parametrize("processes", [2, 4])
def test_concurrent_cli_builds_share_work_and_agree(recipe, tmp_path, processes):
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, "-m", "qbuild.cli", "compile", str(recipe), "--store", str(store),
                               "--lock", str(tmp_path / f"lock{i}"), "--json"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(processes)]
    outs = [p.communicate(timeout=900) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    results = [json.loads(o[0]) for o in outs]
    built = [name for r in results for name in r["built"]]
    assert sorted(built) == sorted(set(built)), f"a node was built twice: {built}"
    total = set(results[0]["built"]) | set(results[0]["cached"])
    assert set(built) == total, "some node was never built by anyone"
    locks = {(tmp_path / f"lock{i}").read_text() for i in range(processes)}
    assert len(locks) == 1, "lockfiles differ"
