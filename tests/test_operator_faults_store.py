"""Operator faults around the store and the remote: maintenance commands looping during builds, and publish and
pull killed at random points. After each, the store, the lockfile and the remote are consistent, and the next run
finishes."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from qbuild.store import LocalStore
from tests.s3server import shared_server
from tests.test_gc_during_build import GcLoop, make_project, ok, qb, write_recipe
from tests.test_remote_pipeline import MODULE, REPO, assert_no_dangling_manifest, base_env, run_qbuild

BUCKET = "qb-faults"


@pytest.fixture(scope="module")
def s3():
    client = shared_server().client()
    client.create_bucket(Bucket=BUCKET)
    return client


@pytest.mark.slow
def test_gc_and_store_verify_repair_looping_during_builds(tmp_path):
    project = make_project(tmp_path / "p")
    stop = threading.Event()
    failures: list[str] = []

    def verify_loop() -> None:
        deadline = time.monotonic() + 240
        while not stop.is_set() and time.monotonic() < deadline:
            proc = qb(project, "store", "verify", "--repair")
            # A sound store under concurrent builds has nothing to repair but staging that live builds hold.
            if proc.returncode != 0 or "Traceback" in proc.stderr or "corrupt" in proc.stderr:
                failures.append(f"exit {proc.returncode}: {proc.stderr[-2000:]}")

    thread = threading.Thread(target=verify_loop, daemon=True)
    thread.start()
    try:
        with GcLoop(project, "0"):
            for tp, buckets in ((1, [32]), (2, [32, 64])):
                write_recipe(project, "alpha", tp, buckets)
                ok(qb(project, "compile", "recipes/alpha.yaml", "--mem", "1T"))
    finally:
        stop.set()
        thread.join(timeout=120)
    assert not failures, failures[0]
    ok(qb(project, "compile", "recipes/alpha.yaml", "--mem", "1T"))
    ok(qb(project, "lock", "check"))
    assert LocalStore(project / "store").verify() == []


def _killed_after(project, delay: float, *args: str) -> int | None:
    """Start `qbuild ARGS`, SIGKILL its process group after `delay` seconds; its exit code if it finished first."""
    env = {**base_env(), "PYTHONPATH": str(REPO), "XDG_CACHE_HOME": str(project / ".cache")}
    proc = subprocess.Popen([sys.executable, "-m", MODULE, *args], cwd=project, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        return proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        return None


@pytest.mark.slow
def test_publish_and_pull_killed_at_random_points_leave_everything_consistent(s3, tmp_path):
    project = make_project(tmp_path / "p")
    ok(qb(project, "compile", "recipes/alpha.yaml", "--mem", "1T"))
    lock_before = (project / "artifacts.lock").read_bytes()
    rng = random.Random(20240611)
    remote = f"s3://{BUCKET}/kill"
    for i in range(4):
        _killed_after(project, rng.uniform(0.3, 2.5), "publish", "--all", "--store", "store", "--remote", remote)
        assert_no_dangling_manifest(s3, BUCKET, "kill")     # manifests go up only after their blobs
        assert (project / "artifacts.lock").read_bytes() == lock_before
        assert LocalStore(project / "store").verify() == []
    ok(run_qbuild(project, "publish", "--all", "--store", "store", "--remote", remote))
    host = tmp_path / "host"
    host.mkdir()
    shutil.copyfile(project / "artifacts.lock", host / "artifacts.lock")
    for i in range(4):
        shutil.rmtree(host / "bundle", ignore_errors=True)
        _killed_after(host, rng.uniform(0.3, 2.5), "pull", "alpha", "--to", "bundle", "--store", "s", "--remote",
                      remote)
        # A pull lays its bundle out under a temporary name: the directory is complete or absent.
        assert not (host / "bundle").exists() or any((host / "bundle").iterdir())
        problems = [p for p in LocalStore(host / "s").verify() if not p.startswith("orphaned staging")]
        assert problems == []
    shutil.rmtree(host / "bundle", ignore_errors=True)
    ok(run_qbuild(host, "pull", "alpha", "--to", "bundle", "--store", "s", "--remote", remote))
    assert any((host / "bundle").rglob("*.safetensors"))
    assert (host / "artifacts.lock").read_bytes() == lock_before
