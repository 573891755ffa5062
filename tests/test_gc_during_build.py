"""`qbuild gc` running in a loop while real builds run, and builds killed under it: gc removes nothing a running
build holds or wrote, and a dead build's lease stops protecting anything."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from qbuild.execution.job import AUDIT_ENV
from qbuild.store.local import LocalStore
from qbuild.store.gc import gc_local
from qbuild.store.lease import LEASES_DIR, Lease, live_leases
from tests.conftest import wait_until
from tests.remote_actions import MODULE, blob_bytes
from tests.test_remote_pipeline import write_recipe

REPO = Path(__file__).resolve().parent.parent
STARTUP = Path(__file__).resolve().parent / "startup"
GC_LOOP_LIMIT_S = 240      # a loop is stopped by its test long before this; the bound only guards a hung test

def make_project(root: Path) -> Path:
    """A checkpoint (a real Qwen3.5 config, placeholder weights) built by tests/remote_actions.py's fast steps."""
    (root / "model").mkdir(parents=True)
    (root / "model" / "config.json").write_bytes((REPO / "qbuild" / "configs" / "Qwen--Qwen3.5-2B.json").read_bytes())
    (root / "model" / "model.safetensors").write_bytes(blob_bytes("weights", 200 << 10))
    (root / "recipes").mkdir()
    write_recipe(root, "alpha", 1, [32, 64])
    (root / "other.lock").write_text(json.dumps({"version": 1, "recipes": {}, "nodes": {}}))
    return root


def env(**extra: str) -> dict:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("QBUILD_", "AWS_")) or k == AUDIT_ENV}
    full.update(PYTHONPATH=os.pathsep.join([str(STARTUP), str(REPO)]), HF_HUB_OFFLINE="1", **extra)
    return full


def qb(project: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", MODULE, *args, "--store", "store"], cwd=project, env=env(),
                          capture_output=True, text=True, timeout=timeout)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


class GcLoop:
    """`qbuild gc --keep-size 0 --lock other.lock` (a lockfile naming nothing) run again and again, as separate
    processes, until the block ends and one more run after it is done; every run must exit 0."""

    def __init__(self, project: Path, grace: str):
        self.project, self.grace = project, grace
        self.stop_event = threading.Event()
        self.failures: list[str] = []
        self.runs = 0
        self.removed = 0
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        deadline = time.monotonic() + GC_LOOP_LIMIT_S
        while not self.stop_event.is_set() and time.monotonic() < deadline:
            proc = qb(self.project, "gc", "--keep-size", "0", "--grace", self.grace, "--lock", "other.lock", "--json")
            self.runs += 1
            if proc.returncode != 0 or "Traceback" in proc.stderr:
                self.failures.append(f"exit {proc.returncode}: {proc.stderr[-2000:]}")
            else:
                self.removed += len(json.loads(proc.stdout)[0]["removed"])

    def __enter__(self) -> "GcLoop":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            # One whole run after the block (the one under way may have started before it ended): however fast this
            # machine built, a gc saw everything the builds left, so `runs` and `removed` do not depend on its speed.
            target = self.runs + 2
            wait_until(lambda: self.runs >= target or not self.thread.is_alive(), GC_LOOP_LIMIT_S,
                       "a gc run after the builds")
        self.stop_event.set()
        self.thread.join(timeout=120)
        assert not self.failures, self.failures[0]


@pytest.mark.slow
def test_gc_looping_during_builds_removes_nothing_they_use(tmp_path):
    project = make_project(tmp_path / "p")
    # With the default grace, what a build wrote outlives it: its lockfile is good the moment it exits, although
    # gc, told of another lockfile only, keeps removing whatever else it may.
    with GcLoop(project, "1h") as loop:
        for tp, buckets in ((1, [32, 64]), (1, [32]), (2, [16])):
            write_recipe(project, "alpha", tp, buckets)
            ok(qb(project, "compile", "recipes/alpha.yaml", "--mem", "1T"))
            ok(qb(project, "lock", "check"))
    assert loop.runs >= 2
    # With --grace 0 only the build's lease protects what it uses: each build still finishes.
    with GcLoop(project, "0") as loop:
        for tp, buckets in ((2, [32]), (1, [32, 64]), (2, [16, 64])):
            write_recipe(project, "alpha", tp, buckets)
            ok(qb(project, "compile", "recipes/alpha.yaml", "--mem", "1T"))
    assert loop.runs >= 2 and loop.removed > 0
    ok(qb(project, "compile", "recipes/alpha.yaml", "--mem", "1T"))
    ok(qb(project, "lock", "check"))
    assert not list((project / "store" / LEASES_DIR).glob("*.lease"))


def _compile_killed_at(project: Path, point: str) -> str:
    marker = project / "stopped-at"
    marker.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", MODULE, "compile", "recipes/alpha.yaml", "--store", "store",
                             "--mem", "1T", "-j", "1"], cwd=project, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True,
                            env=env(QBUILD_CRASH_AT=point, QBUILD_CRASH_MARKER=str(marker)))
    deadline = time.monotonic() + 120
    while proc.poll() is None and not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert marker.exists(), f"{point} was never reached"
    return marker.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("point", ["fetch:committed", "convert:ingested", "shard:committed", "package:ingested"])
def test_a_build_killed_under_a_gc_loop_is_finished_by_the_next(tmp_path, point):
    project = make_project(tmp_path / "p")
    with GcLoop(project, "0"):
        _compile_killed_at(project, point)
        ok(qb(project, "compile", "recipes/alpha.yaml", "--mem", "1T"))
    ok(qb(project, "compile", "recipes/alpha.yaml", "--mem", "1T"))   # whatever gc removed after the build
    ok(qb(project, "lock", "check"))
    assert LocalStore(project / "store").verify() == []
    # The killed build's lease is gone too: it protected nothing once its process was.
    assert not list((project / "store" / LEASES_DIR).glob("*.lease"))


def _entry(store: LocalStore, name: str, age_s: float) -> str:
    from qbuild.core.hashing import digest_json
    from qbuild.store.manifest import Manifest

    src = store.root.parent / f"{name}.bin"
    src.write_bytes(name.encode() * 100)
    pre = {"entry": name}
    m = Manifest(key=digest_json(pre), kind="compile", preimage=pre,
                 outputs={"out.bin": {"digest": store.put_file(src), "size": len(name) * 100}})
    store.put_manifest(m)
    then = time.time() - age_s
    os.utime(store.manifest_path(m.key), (then, then))
    return m.key


def test_gc_keeps_what_a_live_lease_holds_and_reaps_a_dead_one(tmp_path):
    store = LocalStore(tmp_path / "store")
    old, used = _entry(store, "old", 7200), _entry(store, "used", 7200)
    # A lease held by another process (flock is per open file, so a child process holds it for real).
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; from qbuild.store.lease import Lease; "
                              f"lease = Lease({str(store.root)!r}); lease.add({used!r}); print('held', flush=True); "
                              "time.sleep(600)"], stdout=subprocess.PIPE, text=True, env=env())
    try:
        assert child.stdout.readline().strip() == "held"
        fresh = _entry(store, "fresh", 0)
        assert live_leases(store.root).count == 1
        report = gc_local(store, set, keep_size=0, grace_s=0)
        # `used` is named by the lease and `fresh` was written after it began; only `old` goes.
        assert {r.name for r in report.removed if r.what == "manifest"} == {old}
        assert report.in_use == 2
        assert {m.key for m in store.manifests()} == {used, fresh}
    finally:
        child.kill()
        child.wait()
    # The lease's process is gone, so its flock is: gc removes the lease and everything it protected.
    report = gc_local(store, set, keep_size=0, grace_s=0)
    assert {r.name for r in report.removed if r.what == "manifest"} == {used, fresh}
    assert not list((store.root / LEASES_DIR).iterdir())


def test_grace_covers_recent_manifests_and_their_blobs(tmp_path):
    store = LocalStore(tmp_path / "store")
    old, recent = _entry(store, "old", 7200), _entry(store, "recent", 60)
    report = gc_local(store, set, keep_size=0, grace_s=600)
    assert {r.name for r in report.removed if r.what == "manifest"} == {old}
    assert {m.key for m in store.manifests()} == {recent}   # its blobs stayed too, or it would be a miss
    report = gc_local(store, set, keep_size=0, grace_s=30)
    assert {m.key for m in store.manifests()} == set()


def test_a_lease_releases_on_close(tmp_path):
    with Lease(tmp_path / "store") as lease:
        lease.add("k" * 64)
    assert live_leases(tmp_path / "store").count == 0
