"""Operator faults around the store and the remote: maintenance commands looping during builds, publish and pull
killed at random points, a remote that drops connections mid-blob, a remote gc looping while publishes run, and a
file-size limit hit in the middle of a build. After each, the store, the lockfile and the remote are consistent,
and the next run finishes."""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from qbuild.core.hashing import digest_file, digest_json
from qbuild.store.local import LocalStore
from qbuild.store.manifest import Manifest
from tests.remote_actions import blob_bytes
from tests.s3server import free_port, shared_server, start_cutting_relay, start_relay, stop_process
from tests.test_gc_during_build import GcLoop, env, make_project, ok, qb, write_recipe
from tests.test_remote_pipeline import (MODULE, REPO, assert_no_dangling_manifest, base_env, make_locked_project,
                                        remote_state, run_qbuild)

# Lines a transfer or a build prints on stderr before its error line (plain lines when stderr is not a terminal).
PROGRESS = ("download ", "  download:", "upload ", "  upload:", "start  ", "built  ", "FAILED ", "skip   ")


def one_error_line(proc: subprocess.CompletedProcess, code: int, *fragments: str) -> str:
    """Exit `code`; stderr is progress lines and then one `error:` line holding every fragment; no traceback."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code, f"exit {proc.returncode}, want {code}:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert lines and lines[-1].startswith("error: "), proc.stderr
    assert all(line.startswith(PROGRESS) or line[:1].isdigit() for line in lines[:-1]), proc.stderr
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]
    return lines[-1]

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


@pytest.mark.slow
def test_pull_from_a_remote_dropping_connections_mid_blob_fails_clean_and_completes_once_healed(s3, tmp_path):
    project = make_locked_project(tmp_path / "p")
    remote = f"s3://{BUCKET}/drop"
    ok(run_qbuild(project, "publish", "--all", "--store", "store", "--remote", remote))
    remote_before = remote_state(s3, BUCKET, "drop")
    host = tmp_path / "host"
    host.mkdir()
    shutil.copyfile(project / "artifacts.lock", host / "artifacts.lock")
    lock_before = (host / "artifacts.lock").read_bytes()
    server = shared_server()
    port = free_port()
    # Each blob GET is cut after 1000 bytes of its body (the bundle's shards are 4 KiB; its config.json passes).
    relay = start_cutting_relay(port, server.port, cut_after=1000)
    via_relay = {**base_env(), "QBUILD_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    try:
        proc = run_qbuild(host, "pull", "beta", "--to", "bundle", "--store", "s", "--remote", remote, env=via_relay)
        one_error_line(proc, 3, f"error: {remote}/cas/", f"the connection to 127.0.0.1:{port} closed in the middle "
                                                         "of the transfer", "nothing of the blob was kept")
        assert not (host / "bundle").exists() and not [p.name for p in host.iterdir() if "bundle" in p.name]
        assert LocalStore(host / "s").verify() == []    # every blob it kept is whole; no staging left
        stop_process(relay)
        relay = start_relay(port, server.port)          # healed: the same endpoint, passing everything
        ok(run_qbuild(host, "pull", "beta", "--to", "bundle", "--store", "s", "--remote", remote, env=via_relay))
    finally:
        stop_process(relay)
    doc = json.loads(lock_before)
    outputs = doc["nodes"][doc["recipes"]["beta"]["nodes"]["package"]]["outputs"]
    assert {rel: digest_file(host / "bundle" / rel) for rel in outputs} == \
        {rel: meta["digest"] for rel, meta in outputs.items()}
    assert (host / "artifacts.lock").read_bytes() == lock_before
    assert remote_state(s3, BUCKET, "drop") == remote_before
    ok(run_qbuild(host, "store", "verify", "--store", "s"))
    ok(run_qbuild(host, "lock", "check", "--store", "s", env={**base_env(), "QBUILD_REMOTE": remote}))


SHARED_FILES = 6
UNIQUE_BYTES = 288 << 10
UPLOAD_RATE = 96 << 10          # bytes/s through the publisher's relay: the unique blob takes about 3 s to go up


def _lock_iteration(project: Path, i: int) -> Manifest:
    """Iteration i's bundle in the publisher's store: files every iteration shares (so a publish finds them present
    on the remote and uploads nothing for them) and one of its own (uploaded slowly); pub.lock and gc.lock name it
    and nothing else, so the gc keeps it and removes the iterations before."""
    store = LocalStore(project / "store")
    staging = project / ".staging"
    files = {f"shared/{j}.bin": blob_bytes(f"shared/{j}", 8 << 10) for j in range(SHARED_FILES)}
    files["unique.bin"] = blob_bytes(f"unique/{i}", UNIQUE_BYTES)
    for rel, data in files.items():
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        (staging / rel).write_bytes(data)
    outputs = store.ingest_tree(staging)
    shutil.rmtree(staging)
    preimage = {"action": "package", "iteration": i}
    manifest = Manifest(digest_json(preimage), "package", preimage, outputs)
    store.put_manifest(manifest)
    nid = f"n{manifest.key[:15]}"
    doc = {"version": 1, "nodes": {nid: {"kind": "package", "name": "package r", "key": manifest.key,
                                         "preimage": preimage, "digest": manifest.digest, "outputs": outputs}},
           "recipes": {"r": {"recipe": "recipes/r.yaml", "model": {"source": "path", "revision": None, "files": {}},
                             "nodes": {"package": nid}, "bundle": manifest.digest, "verified": False}}}
    for name in ("pub.lock", "gc.lock"):
        (project / f"{name}.tmp").write_text(json.dumps(doc, indent=1, sort_keys=True))
        os.replace(project / f"{name}.tmp", project / name)
    return manifest


class RemoteGcLoop:
    """`qbuild gc --remote --grace 0 --lock gc.lock` run again and again until stopped; `pause` holds the loop
    between two runs. Every run must exit 0.

    One condition guards both whether the loop may start a run and whether one is under way, so `pause` never
    returns while a run that it did not see start is about to begin."""

    def __init__(self, project: Path, remote: str):
        self.project, self.remote = project, remote
        self.runs, self.removed, self.failures = 0, 0, []
        self._cond = threading.Condition()
        self._go, self._running, self._stop = False, False, False   # starts paused
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            with self._cond:
                self._running = False
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._go or self._stop)
                if self._stop:
                    return
                self._running = True
            proc = run_qbuild(self.project, "gc", "--remote", self.remote, "--grace", "0", "--keep-size", "0",
                              "--lock", "gc.lock", "--store", "gc-store", "--json", timeout=120)
            self.runs += 1
            if proc.returncode != 0 or "Traceback" in proc.stderr:
                self.failures.append(f"exit {proc.returncode}: {proc.stderr[-2000:]}")
            else:
                self.removed += sum(len(r["removed"]) for r in json.loads(proc.stdout))
        with self._cond:
            self._running = False
            self._cond.notify_all()

    def pause(self) -> None:
        """Return once no gc runs, and start none until `resume`."""
        with self._cond:
            self._go = False
            assert self._cond.wait_for(lambda: not self._running, 150), "a gc run did not finish"

    def resume(self) -> None:
        with self._cond:
            self._go = True
            self._cond.notify_all()

    def __enter__(self) -> "RemoteGcLoop":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=150)


def _size(client, key: str) -> int | None:
    """The size of object `key` of the test bucket; None where it is absent."""
    from botocore.exceptions import ClientError

    try:
        return client.head_object(Bucket=BUCKET, Key=key)["ContentLength"]
    except ClientError as e:
        if e.response["ResponseMetadata"]["HTTPStatusCode"] == 404:
            return None
        raise


def _publish_resuming(project: Path, remote: str, env: dict, gc: RemoteGcLoop) -> subprocess.CompletedProcess:
    """`qbuild publish` of pub.lock, resuming the gc loop once the publish has checked what the remote holds and
    starts uploading (its `upload` progress line), so that gc runs while its upload is under way."""
    full = {**env, "PYTHONPATH": str(REPO), "XDG_CACHE_HOME": str(project / ".cache")}
    args = ["publish", "--all", "--lock", "pub.lock", "--store", "store", "--remote", remote, "--json"]
    proc = subprocess.Popen([sys.executable, "-m", MODULE, *args], cwd=project, env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    err = []
    try:
        for line in proc.stderr:
            err.append(line)
            if line.startswith("upload "):
                gc.resume()
        out = proc.stdout.read()
        proc.wait(timeout=120)
    finally:
        gc.resume()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return ok(subprocess.CompletedProcess(proc.args, proc.returncode, out, "".join(err)))


@pytest.mark.slow
def test_remote_gc_looping_during_publishes_never_removes_what_a_publish_relies_on(s3, tmp_path):
    """Each publish finds the shared blobs present (an earlier iteration's manifest names them) and uploads only its
    own blob, slowly; meanwhile the gc removes that earlier manifest, which no lockfile references any more. Without
    leases it removed the shared blobs too while the publish was uploading, and the publish then put up a manifest
    naming blobs that were gone."""
    project = tmp_path / "p"
    project.mkdir()
    remote = f"s3://{BUCKET}/gcpub"
    server = shared_server()
    port = free_port()
    relay = start_relay(port, server.port, bytes_per_s=UPLOAD_RATE)
    slow = {**base_env(), "QBUILD_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    published: list[Manifest] = []
    try:
        with RemoteGcLoop(project, remote) as gc:
            for i in range(5):
                gc.pause()   # every gc run from here on reads this iteration's gc.lock
                manifest = _lock_iteration(project, i)
                lock_before = (project / "pub.lock").read_bytes()
                proc = _publish_resuming(project, remote, slow, gc)
                report = json.loads(proc.stdout)
                assert report["manifests_uploaded"] == 1 and (i == 0 or report["blobs_present"] == SHARED_FILES)
                assert (project / "pub.lock").read_bytes() == lock_before
                # gc.lock names this manifest, so no gc removes it; it is on the remote and so is every blob it names.
                for rel, meta in manifest.outputs.items():
                    assert _size(s3, f"gcpub/cas/{meta['digest'][:2]}/{meta['digest']}") == meta["size"], \
                        f"iteration {i}: the published manifest names {rel}, which the gc removed"
                assert _size(s3, f"gcpub/ac/{manifest.key[:2]}/{manifest.key}.json") is not None
                published.append(manifest)
        assert not gc.failures, gc.failures[0]
        assert gc.runs >= 5 and gc.removed > 0, (gc.runs, gc.removed)
    finally:
        stop_process(relay)
    ok(run_qbuild(project, "gc", "--remote", remote, "--grace", "0", "--keep-size", "0", "--lock", "gc.lock",
                  "--store", "gc-store"))
    manifests, blobs = remote_state(s3, BUCKET, "gcpub")
    assert set(manifests) == {published[-1].key}
    assert set(blobs) == {o["digest"] for o in published[-1].outputs.values()}
    assert_no_dangling_manifest(s3, BUCKET, "gcpub")
    assert not [k for k in (o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="gcpub/leases/")
                            .get("Contents", []))], "a lease outlived its process"
    assert LocalStore(project / "store").verify() == []
    host = tmp_path / "host"
    host.mkdir()
    shutil.copyfile(project / "pub.lock", host / "artifacts.lock")
    ok(run_qbuild(host, "pull", "r", "--to", "bundle", "--store", "s", "--remote", remote, "--allow-unverified"))


@pytest.mark.slow
def test_file_size_limit_mid_shard_is_exit_3_and_the_next_run_completes(tmp_path):
    """RLIMIT_FSIZE (a full disk as one process sees it: writes past the limit fail with EFBIG) on a build whose
    new shard files outgrow it: the shard step fails, the build stops with one line, and nothing half-written
    stays."""
    project = make_project(tmp_path / "p")
    ok(qb(project, "compile", "recipes/alpha.yaml", "--mem", "1T"))
    write_recipe(project, "alpha", 2, [32, 64])   # tp 2: a new shard (64 KiB per rank), new graphs (24 KiB each)
    limit = 48 << 10

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    proc = subprocess.run([sys.executable, "-m", MODULE, "compile", "recipes/alpha.yaml", "--mem", "1T", "--store",
                           "store"], cwd=project, env=env(PYTHONDONTWRITEBYTECODE="1"), capture_output=True,
                          text=True, timeout=120, preexec_fn=limited)
    one_error_line(proc, 3, "shard cpu 2 ranks", str((project / "store").resolve()), "File too large", "ulimit -f")
    ok(qb(project, "lock", "check"))   # the lock records what did build, all of it in the store
    check = json.loads(qb(project, "store", "verify", "--json").stdout)
    assert check["problems"] == [], check
    assert not list((project / "store" / "staging").iterdir())
    proc = ok(qb(project, "compile", "recipes/alpha.yaml", "--mem", "1T", "--json"))
    assert "shard cpu 2 ranks" in json.loads(proc.stdout)["built"]
    ok(qb(project, "lock", "check"))
    assert LocalStore(project / "store").verify() == []
