"""The real pipeline under SIGKILL and under concurrent builders sharing one store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from qbuild.store.local import LocalStore
from tests.conftest import REPO, qbuild, wait_until

pytestmark = pytest.mark.slow

STARTUP = Path(__file__).resolve().parent / "startup"
# Each run is killed at the next of these points and the one after resumes from what it left. With -j 1 the steps
# run in plan order (fetch, convert, shard, compile cte, compile tkg, package, reference, verify), so a point of a
# kind names the first of its steps not yet committed. Every phase is hit on a cheap step, and every kind of step
# at least once; the slow steps (compile, reference, verify) are stopped only where no finished work is lost.
KILL_POINTS = ["fetch:committed",
               "convert:start", "convert:written", "convert:ingested",
               "shard:committed",
               "compile:start", "compile:committed",
               "package:written", "package:ingested",
               "reference:start", "verify:start"]

RECIPE = """\
model: {{path: {path}}}
text: {{seq_len: 128, cte_buckets: [32], tkg_buckets: [128]}}
dtype: float32
backend: export
verify: {{prompts: ["Hello"], new_tokens: 2, top1_min: 0.99, token_match_min: 1.0, max_logit_err: 0.001}}
"""


@pytest.fixture
def recipe(tmp_path, small_checkpoints) -> Path:
    f = tmp_path / "crashy.yaml"
    f.write_text(RECIPE.format(path=small_checkpoints["qwen3_next"]))
    return f


def _compile_killed_at(recipe: Path, store: Path, lock: Path, point: str, tmp: Path) -> str:
    """Run `qbuild compile -j 1` until a step reaches `point` (see tests/crash_points.py), then SIGKILL its whole
    process group: driver and worker. Returns the key of the step it stopped in."""
    marker = tmp / "stopped-at"
    marker.unlink(missing_ok=True)
    env = dict(os.environ, QBUILD_CRASH_AT=point, QBUILD_CRASH_MARKER=str(marker),
               PYTHONPATH=os.pathsep.join([str(STARTUP), str(REPO)]))
    with open(tmp / "compile.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "qbuild.cli", "compile", str(recipe), "--store", str(store),
                                 "--lock", str(lock), "-j", "1"], stderr=log, stdout=subprocess.DEVNULL,
                                start_new_session=True, env=env)
        wait_until(lambda: marker.exists() or proc.poll() is not None, 600, f"{point} or the end of the build")
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert marker.exists(), f"{point} was never reached:\n{(tmp / 'compile.log').read_text()[-3000:]}"
    return marker.read_text()


def _store_problems(store: Path) -> list[str]:
    """What `qbuild store verify` reports, read in this process: the sweep checks the store after every kill."""
    return LocalStore(store).verify()


def _locked_keys(lock: Path) -> set[str]:
    # Written by atomic rename only: never torn, whenever the kill came.
    return {n["key"] for n in json.loads(lock.read_text())["nodes"].values()} if lock.exists() else set()


def test_sigkill_at_each_point_of_each_step_leaves_a_consistent_store_and_the_next_run_finishes(recipe, tmp_path):
    store, lock = tmp_path / "store", tmp_path / "artifacts.lock"
    for point in KILL_POINTS:
        key = _compile_killed_at(recipe, store, lock, point, tmp_path)
        phase = point.split(":")[1]
        # Consistent after every kill: no corrupt blob, no manifest missing a blob. Only a killed step's own
        # staging dir may remain, and the next run clears it.
        assert [p for p in _store_problems(store) if not p.startswith("orphaned staging")] == [], point
        assert (LocalStore(store).get_manifest(key) is not None) == (phase == "committed"), point
        assert key not in _locked_keys(lock), point
    final = qbuild("compile", str(recipe), "--store", str(store), "--lock", str(lock), "--json", check=True)
    # Everything committed before a kill was kept; only the step stopped last is left to build.
    assert [name.split()[0] for name in json.loads(final.stdout)["built"]] == ["verify"]
    qbuild("lock", "check", "--store", str(store), "--lock", str(lock), check=True)
    assert _store_problems(store) == []
    again = qbuild("compile", str(recipe), "--store", str(store), "--lock", str(lock), "--json", check=True)
    assert json.loads(again.stdout)["built"] == []


@pytest.mark.parametrize("processes", [3])
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
