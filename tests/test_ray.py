"""The Ray executor: pure pieces without a cluster, then a real two-node Ray cluster on loopback with S3 (moto).

The cluster is a head and one worker node, each a separate `ray start` with 1 CPU and a 2 GiB memory resource,
and each with its own QBUILD_STORE, so workers share no store with the driver or with each other: the S3 server
is the only shared state, as on a real cluster. Teardown ends exactly the processes each `ray start` spawned (its
own process group) instead of `ray stop`, which would end every Ray process of this user on the machine,
including another test process's cluster.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from qbuild.planning.keys import code_hash, toolchain_versions
from qbuild.planning.step import Step
from qbuild.core.errors import InfraError, UserError
from qbuild.execution.executors import ray as rayexec
from qbuild.planning.dag import Node, Plan
from qbuild.store.spec import StoreSpec
from tests.conftest import wait_until
from tests.s3server import free_port, s3_env, shared_server
from tests.engine_actions import read_log
from tests.engine_actions import add
from tests.ray_actions import KINDS, Text

REPO = Path(__file__).resolve().parent.parent
GIB = 1 << 30
NODE_MEMORY = 256 * GIB              # each Ray node's declared `memory` (logical: the tiny pipeline's steps are
                                     # planned for the real 2B model, ~8-40 GiB, and only reserve it)
START_TIMEOUT_S = 90
BUILD_TIMEOUT_S = 180
# The tests on the Ray cluster run on one xdist worker, so the module-scoped cluster starts once.
ON_THE_CLUSTER = pytest.mark.xdist_group("ray-cluster")


def _node(name: str, peak: int = GIB, needs_device: bool = False) -> Node:
    return Node(id=name, step=Text, name=name, params={}, deps={}, backend=None, est_out_bytes=1, est_peak_bytes=peak,
                resources={"neuron_cores": 8} if needs_device else {})


def _worker(address: str, memory: int, cpus: float = 4, **custom: float) -> rayexec.WorkerNode:
    return rayexec.WorkerNode(address, "f" * 32, cpus, memory, custom)


# --- pure pieces (no cluster) ----------------------------------------------------------------------------------

def test_task_resources_come_from_the_node_estimates():
    plain = rayexec.task_resources(_node("convert", peak=12 * GIB))
    assert plain.ray_options() == {"num_cpus": 1, "memory": 12 * GIB, "resources": {}}
    device = rayexec.task_resources(_node("verify", peak=GIB, needs_device=True))
    assert device.ray_options()["resources"] == {"neuron_cores": 8.0}   # the backend's name for them, as it is


def test_capacity_problem_names_the_node_and_the_largest_worker():
    workers = [_worker("10.0.0.1", 16 * GIB), _worker("10.0.0.2", 64 * GIB)]
    assert rayexec.capacity_problem(_node("small"), rayexec.task_resources(_node("small")), workers) is None
    huge = _node("convert huge", peak=200 * GIB)
    msg = rayexec.capacity_problem(huge, rayexec.task_resources(huge), workers)
    assert msg.startswith("convert huge needs ~200.0 GiB") and "10.0.0.2" in msg and "64.0 GiB" in msg
    assert "\n" not in msg


def test_capacity_problem_for_devices_cpus_and_an_empty_cluster():
    dev = _node("verify on trn", needs_device=True)
    msg = rayexec.capacity_problem(dev, rayexec.task_resources(dev), [_worker("10.0.0.1", 64 * GIB)])
    assert "neuron_cores" in msg and "--resources" in msg
    assert rayexec.capacity_problem(dev, rayexec.task_resources(dev),
                                    [_worker("10.0.0.1", 64 * GIB, neuron_cores=32)]) is None
    zero_cpu = [_worker("10.0.0.1", 64 * GIB, cpus=0)]
    assert "needs 1 CPUs" in rayexec.capacity_problem(dev, rayexec.task_resources(_node("x")), zero_cpu)
    assert "no alive node" in rayexec.capacity_problem(dev, rayexec.task_resources(dev), [])
    # Memory on one host, devices on another: no single worker has both.
    split = [_worker("10.0.0.1", 4 * GIB, neuron_cores=32), _worker("10.0.0.2", 64 * GIB)]
    big_dev = _node("verify big", peak=32 * GIB, needs_device=True)
    assert "no single Ray worker" in rayexec.capacity_problem(big_dev, rayexec.task_resources(big_dev), split)


def test_workers_from_ray_nodes_keeps_alive_nodes_and_custom_resources():
    nodes = [{"Alive": True, "NodeManagerAddress": "10.0.0.1", "NodeID": "a" * 32,
              "Resources": {"CPU": 8.0, "memory": 3.0 * GIB, "object_store_memory": 1e9, "node:10.0.0.1": 1.0,
                            "neuron_cores": 32.0}},
             {"Alive": False, "NodeManagerAddress": "10.0.0.2", "NodeID": "b" * 32, "Resources": {"CPU": 64.0}}]
    (w,) = rayexec.workers_from_ray_nodes(nodes)
    assert (w.address, w.cpus, w.memory, w.custom) == ("10.0.0.1", 8.0, 3 * GIB, {"neuron_cores": 32.0})


def test_remote_is_required():
    with pytest.raises(UserError, match="needs a remote store"):
        rayexec.require_remote(StoreSpec(local="/tmp/x"))
    rayexec.require_remote(StoreSpec(local="/tmp/x", remote="s3://b/p"))
    spec = rayexec.worker_spec(StoreSpec(local="/driver", remote="s3://b/p", push=False), "/worker")
    assert spec == StoreSpec(local="/worker", remote="s3://b/p", push=True)


def _job(step, pre: dict):
    from qbuild.execution.job import Job

    return Job("n", step, f"{step.kind} a", "k" * 64, pre, {}, {}, StoreSpec(local="/x", remote="s3://b/p"))


def test_worker_with_other_step_code_refuses_to_build():
    pre = {"action": "ray-text", "code_hash": "0" * 32, "params": {}, "inputs": {}, "toolchain": {}}
    with pytest.raises(InfraError, match="not set up like the driver.*step code"):
        rayexec._check_same_code(_job(Text, pre))
    rayexec._check_same_code(_job(Text, {**pre, "code_hash": code_hash(Text), "toolchain": toolchain_versions(Text)}))


def test_a_worker_reads_its_code_afresh_for_each_task(tmp_path, monkeypatch):
    """A Ray worker outlives many tasks; its checkout may change between them. The check reads the code as it is at
    each task, never as an earlier task found it."""
    (tmp_path / "probestep").mkdir()
    (tmp_path / "probestep" / "__init__.py").write_text("")
    module = tmp_path / "probestep" / "act.py"
    module.write_text("def run(ctx):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    probe = type("Probe", (Step,), {"kind": "probe", "params": dict, "__module__": "probestep.act",
                                   "run": classmethod(lambda cls, ctx: None)})
    pre = {"action": "probe", "code_hash": code_hash(probe), "params": {}, "inputs": {},
           "toolchain": toolchain_versions(probe)}
    rayexec._check_same_code(_job(probe, pre))
    module.write_text("def run(ctx):\n    return 1\n")
    with pytest.raises(InfraError, match="not set up like the driver.*probe step code"):
        rayexec._check_same_code(_job(probe, pre))


def test_worker_on_another_platform_refuses_a_node_that_is_not_portable():
    from qbuild.core.platform import host_tag

    native = type("Native", (Text,), {"portable": False})
    pre = {"action": "ray-text", "code_hash": code_hash(native), "params": {}, "inputs": {},
           "toolchain": toolchain_versions(native), "platform": "aarch64-linux-glibc2.39-cp311-SVE256"}
    with pytest.raises(InfraError, match=f"not set up like the driver: platform {host_tag()} \\(driver: aarch64"):
        rayexec._check_same_code(_job(native, pre))
    rayexec._check_same_code(_job(native, {**pre, "platform": host_tag()}))


def _cli(*args: str, cwd: Path, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "qbuild.cli", *args], cwd=cwd, env=full, capture_output=True,
                          text=True, timeout=timeout)


def test_cli_refuses_ray_without_a_remote_in_one_line(tmp_path):
    (tmp_path / "recipes").mkdir()
    proc = _cli("compile", "--all", "--executor", "ray", "--store", "store", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "--executor ray needs a remote store" in proc.stderr
    assert not (tmp_path / "store").exists() and not (tmp_path / "artifacts.lock").exists()
    proc = _cli("compile", "--all", "--address", "auto", cwd=tmp_path)
    assert proc.returncode == 2 and "--address: only used with --executor ray" in proc.stderr
    proc = _cli("compile", "--all", "--executor", "dask", cwd=tmp_path)
    assert proc.returncode == 2 and "'dask' is not one of 'local', 'ray'" in proc.stderr


def test_ray_is_not_imported_on_the_planning_path():
    code = ("import sys, qbuild.cli, qbuild.execution.executors.ray, qbuild.execution.workspace, qbuild.execution.engine; "
            "sys.exit(1 if 'ray' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)},
                          timeout=60).returncode == 0


def test_no_cluster_at_the_address_fails_fast_in_one_line(tmp_path):
    """ray.init alone would wait for minutes; the CLI says where it looked, with exit 3 (infrastructure)."""
    from tests.test_remote_pipeline import make_project, run_qbuild

    client = shared_server().client()
    if "qb-ray-none" not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
        client.create_bucket(Bucket="qb-ray-none")
    project = make_project(tmp_path / "project")
    port = free_port()
    proc = run_qbuild(project, "compile", "--all", "--executor", "ray", "--address", f"127.0.0.1:{port}",
                      "--remote", "s3://qb-ray-none/p", "--store", "store", "--mem", "1T", timeout=60)
    assert proc.returncode == 3   # the timeout above guards against a driver that waits for the cluster forever
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert f"cannot reach the Ray cluster at 127.0.0.1:{port}" in line and "ray start --head" in line
    assert "Traceback" not in proc.stderr
    with pytest.raises(InfraError, match="cannot reach the Ray cluster"):
        rayexec._check_reachable(f"ray://127.0.0.1:{port}")


def test_errors_become_one_line_domain_errors():
    from ray.exceptions import RayTaskError, WorkerCrashedError

    from qbuild.core.errors import BuildError

    own = BuildError("convert: ValueError: bad tensor (convert.py:10)")
    assert rayexec._translate(RayTaskError("run_task", "tb", own), "convert") is own
    infra = InfraError("s3://b/p/cas/ab/x: timed out")
    assert rayexec._translate(infra, "convert") is infra           # raised while seeding inputs, not by Ray
    lost = rayexec._translate(WorkerCrashedError(), "convert")
    assert isinstance(lost, InfraError) and str(lost).startswith("convert: the Ray worker was lost 3 times")
    bug = rayexec._translate(RayTaskError("run_task", "tb", KeyError("digest")), "convert")
    assert isinstance(bug, InfraError) and str(bug) == "convert: KeyError: 'digest'"


def test_ray_cluster_messages_never_reach_stdout(capsys):
    import ray._private.worker as ray_worker

    rayexec._cluster_messages_to_stderr()
    rayexec._cluster_messages_to_stderr()      # idempotent: one wrapper, not two
    ray_worker.print_to_stdstream({"lines": ["Task run_task failed. There are 2 retries remaining"], "pid": "raylet",
                                   "ip": "127.0.0.1", "is_err": False}, ignore_prefix=False)
    out, err = capsys.readouterr()
    assert out == "" and "2 retries remaining" in err


# --- a real cluster ----------------------------------------------------------------------------------------------

@dataclass
class Cluster:
    address: str
    bucket: str
    node_stores: list[Path]
    groups: list[int]                    # process group of each `ray start` (all it spawned)

    def remote(self, name: str) -> str:
        return f"s3://{self.bucket}/{name}"


def _ray_start(args: list[str], env: dict) -> int:
    proc = subprocess.Popen([str(Path(sys.executable).with_name("ray")), "start", *args, "--disable-usage-stats"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _end_group(proc.pid)
        raise
    if proc.returncode != 0:
        _end_group(proc.pid)
        raise RuntimeError(f"ray start {' '.join(args)} exited {proc.returncode}:\n{out[-3000:]}")
    return proc.pid


def _end_group(pgid: int) -> None:
    """SIGTERM the group, then SIGKILL what is left after a grace period (Ray's own daemons ignore TERM at times)."""
    def gone() -> bool:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        return False

    for sig, grace in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        try:
            wait_until(gone, grace, f"process group {pgid} to end", interval=0.1)
            return
        except AssertionError:
            pass


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    server = shared_server()
    bucket = "qb-ray"
    client = server.client()
    if bucket not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
        client.create_bucket(Bucket=bucket)
    root = tmp_path_factory.mktemp("ray-nodes")
    temp_dir = tempfile.mkdtemp(prefix="qbray-")       # short: Ray's socket paths must fit in 107 bytes
    port = free_port()
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--memory", str(NODE_MEMORY),
              "--object-store-memory", str(80 << 20)]
    stores = [root / "head-store", root / "worker-store"]
    groups: list[int] = []
    base = {**s3_env(server.endpoint), "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
            "RAY_DEDUP_LOGS": "0", "XDG_CACHE_HOME": str(root / "xdg")}
    try:
        groups.append(_ray_start(["--head", "--port", str(port), "--include-dashboard=false",
                                  "--temp-dir", temp_dir, "--ray-client-server-port", str(free_port()),
                                  "--dashboard-port", str(free_port()),
                                  "--dashboard-agent-listen-port", str(free_port()), *common],
                                 {**base, "QBUILD_STORE": str(stores[0])}))
        groups.append(_ray_start(["--address", f"127.0.0.1:{port}", "--dashboard-agent-listen-port",
                                  str(free_port()), *common], {**base, "QBUILD_STORE": str(stores[1])}))
        yield Cluster(f"127.0.0.1:{port}", bucket, stores, groups)
    finally:
        for pgid in reversed(groups):
            _end_group(pgid)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def driver(cluster):
    """This process as a Ray driver of the test cluster (the executor reuses a connection it did not open)."""
    import ray

    ray.init(address=cluster.address, log_to_driver=False, logging_level="WARNING", configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture
def s3_client_env(monkeypatch):
    """The pytest process talks to the loopback S3 server with fake credentials (the driver's store)."""
    server = shared_server()
    env = s3_env(server.endpoint)
    for k, v in env.items():
        if k.startswith("AWS_") or k.startswith("QBUILD_S3"):
            monkeypatch.setenv(k, v)
    return server.client()


def _graph(log: Path, spec: list[tuple[str, str, list[str], float]], **extra) -> Plan:
    """spec: (name, kind, input names, peak GiB) in topological order; `extra` goes into every node's params."""
    nodes, ids = {}, {}
    for name, kind, deps, peak in spec:
        ids[name] = add(nodes, KINDS[kind], name, {"name": name, "log": str(log), **extra},
                        {d: ids[d] for d in deps}, 1, int(peak * GIB))
    return Plan(nodes, {})


def _build(plan: Plan, spec: StoreSpec, cluster: Cluster, timeline: list | None = None, **opts):
    """engine.build on the Ray executor, in a thread so that a hang fails the test instead of stalling it. With
    `timeline`, every event ("event", kind, node name) and progress report ("progress", node name, report) is
    appended to it as the driver hears it."""
    from qbuild.execution.engine import BuildOptions, build
    from qbuild.store.remote import open_store

    box: dict = {"events": []}
    on_event, on_progress = box["events"].append, None
    if timeline is not None:
        def on_event(e) -> None:
            box["events"].append(e)
            timeline.append(("event", e.kind, e.node.name))

        def on_progress(node, report) -> None:
            timeline.append(("progress", node.name, report))

    def run() -> None:
        try:
            store = open_store(spec)
            box["result"] = build(plan, store, spec,
                                  lambda: rayexec.RayExecutor(store, cluster.address),
                                  BuildOptions(jobs=4, **opts), on_event, on_progress=on_progress)
        except BaseException as e:  # reported below, in the test's thread
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(BUILD_TIMEOUT_S)
    assert not thread.is_alive(), f"the build did not finish in {BUILD_TIMEOUT_S}s: {box['events']}"
    if "error" in box:
        raise box["error"]
    return box["result"], box["events"]


def _remote_manifests(client, bucket: str, prefix: str) -> dict[str, dict]:
    from tests.test_remote_pipeline import assert_no_dangling_manifest, remote_state

    assert_no_dangling_manifest(client, bucket, prefix)
    return remote_state(client, bucket, prefix)[0]


@ON_THE_CLUSTER
@pytest.mark.slow
def test_worker_killed_mid_task_is_retried_and_never_half_published(cluster, driver, s3_client_env, tmp_path):
    log, marker = tmp_path / "log", tmp_path / "first-attempt.pid"
    plan = _graph(log, [("a", "ray-text", [], 0.25), ("victim", "ray-crash-once", ["a"], 0.25),
                        ("after", "ray-text", ["victim"], 0.25)], marker=str(marker))
    prefix = f"crash-{tmp_path.name}"
    spec = StoreSpec(local=str(tmp_path / "driver"), remote=cluster.remote(prefix))
    killed: dict = {}

    def kill_first_attempt() -> None:
        try:
            wait_until(marker.exists, BUILD_TIMEOUT_S / 2, "the first attempt")
        except AssertionError:
            return      # the test fails below: "the first attempt never started"
        killed["pid"] = int(marker.read_text())
        os.kill(killed["pid"], signal.SIGKILL)

    killer = threading.Thread(target=kill_first_attempt, daemon=True)
    killer.start()
    result, _ = _build(plan, spec, cluster)
    killer.join(5)
    assert "pid" in killed, "the first attempt never started"
    assert result.ok, result.failed
    runs = [e for e in read_log(log) if e["node"] == "victim"]
    assert [e["event"] for e in runs] == ["first-attempt", "start", "end"]
    assert runs[0]["pid"] == killed["pid"] and runs[1]["pid"] != killed["pid"]
    # The result is the retry's, complete; the killed attempt's half output went nowhere.
    from qbuild.store.remote import open_store

    ids = {plan.nodes[n].name: n for n in plan.nodes}
    store = open_store(spec)
    victim = result.manifests[ids["victim"]]
    after = result.manifests[ids["after"]]
    store.ensure_blobs({**victim.outputs, **{f"after/{k}": v for k, v in after.outputs.items()}})   # lazy: on use
    assert store.blob_path(victim.outputs["value.txt"]["digest"]).read_text() == "victim(a())"
    assert store.blob_path(after.outputs["value.txt"]["digest"]).read_text() == "after(victim(a()))"
    remote = _remote_manifests(s3_client_env, cluster.bucket, prefix)
    assert set(remote) == {m.key for m in result.manifests.values()}
    assert remote[victim.key]["digest"] == victim.digest


@ON_THE_CLUSTER
@pytest.mark.slow
def test_progress_of_steps_on_ray_workers_reaches_the_driver_before_their_results(cluster, driver, s3_client_env,
                                                                                  tmp_path):
    """What a step measures on a Ray worker (its own bytes written, its store's upload) reaches the driver through the
    progress inbox, each step's last count before the step's built event."""
    plan = _graph(tmp_path / "log", [("a", "ray-text", [], 0.25), ("b", "ray-text", ["a"], 0.25)])
    spec = StoreSpec(local=str(tmp_path / "driver"), remote=cluster.remote(f"progress-{tmp_path.name}"))
    timeline: list = []
    result, _ = _build(plan, spec, cluster, timeline)
    assert result.ok, result.failed
    for name in ("a", "b"):
        reports = [(i, t[2]) for i, t in enumerate(timeline) if t[0] == "progress" and t[1] == name]
        writes = [r for _, r in reports if r.what == "write"]
        assert writes and writes[-1].done == writes[-1].total == 256 * 1024
        uploads = [r for _, r in reports if r.what == "upload"]
        assert uploads and uploads[-1].done == uploads[-1].total > 256 * 1024
        assert max(i for i, _ in reports) < timeline.index(("event", "built", name))


@ON_THE_CLUSTER
@pytest.mark.slow
def test_too_big_for_every_worker_fails_clearly_and_errors_are_not_retried(cluster, driver, s3_client_env,
                                                                           tmp_path):
    log = tmp_path / "log"
    plan = _graph(log, [("huge", "ray-text", [], 4096), ("fine", "ray-text", [], 0.25),
                        ("broken", "ray-fail", [], 0.25)])
    spec = StoreSpec(local=str(tmp_path / "driver"), remote=cluster.remote(f"cap-{tmp_path.name}"))
    started = time.monotonic()
    result, events = _build(plan, spec, cluster, keep_going=True)
    # A hang guard only (a task no worker can take must fail, not wait): far above any machine's build time.
    assert time.monotonic() - started < 600
    ids = {plan.nodes[n].name: n for n in plan.nodes}
    assert result.built == [ids["fine"]]
    huge = result.failed[ids["huge"]]
    assert huge.startswith("huge needs ~4096.0 GiB of memory") and "the largest is" in huge and "256.0 GiB" in huge
    assert "failed on purpose" in result.failed[ids["broken"]]
    failures = {e.node.name: e.worker for e in events if e.kind == "failed"}
    assert re.fullmatch(r"\S+ \(pid \d+\)", failures["broken"]), failures   # the worker it failed on
    assert failures["huge"] is None                                            # refused before any worker ran it
    assert [e["event"] for e in read_log(log) if e["node"] == "broken"] == ["start"], "a BuildError was retried"
    assert not any(e["node"] == "huge" for e in read_log(log))


@ON_THE_CLUSTER
@pytest.mark.slow
def test_pipeline_through_ray_gives_the_local_lockfile(cluster, s3_client_env, tmp_path):
    """The real CLI, planner, engine and lockfile (fetch of a local checkpoint, then test-defined steps) built
    once with the local executor and once on the Ray cluster: the same lockfile, byte for byte."""
    from tests.test_remote_pipeline import make_project, ok, run_qbuild

    project = make_project(tmp_path / "project")
    ok(run_qbuild(project, "compile", "--all", "--store", "local-store", "--lock", "local.lock", "--mem", "1T",
                  "-j", "2"))
    prefix = f"pipeline-{tmp_path.name}"
    ray_args = ["compile", "--all", "--store", "driver-store", "--lock", "ray.lock", "--executor", "ray",
                "--address", cluster.address, "--remote", cluster.remote(prefix), "--json"]
    first = ok(run_qbuild(project, *ray_args, timeout=BUILD_TIMEOUT_S))
    out = json.loads(first.stdout)
    assert out["failed"] == {} and len(out["built"]) > 0
    assert (project / "ray.lock").read_bytes() == (project / "local.lock").read_bytes()
    # Every locked entry is on the remote, complete; the workers built them in their own stores, and the
    # driver read them through the remote, downloading only what it needed (the fetch snapshots the lockfile
    # writer reads), so only those are recorded in its store.
    lock = json.loads((project / "ray.lock").read_text())
    keys = {n["key"] for n in lock["nodes"].values()}
    assert keys <= set(_remote_manifests(s3_client_env, cluster.bucket, prefix))
    built_on_workers = {p.stem for s in cluster.node_stores for p in (s / "ac").glob("*/*.json")}
    assert keys <= built_on_workers
    fetches = {lock["nodes"][e["nodes"]["fetch"]]["key"] for e in lock["recipes"].values()}
    assert {p.stem for p in (project / "driver-store" / "ac").glob("*/*.json")} == fetches
    # A second run on Ray builds nothing.
    again = json.loads(ok(run_qbuild(project, *ray_args, timeout=BUILD_TIMEOUT_S)).stdout)
    assert again["built"] == [] and again["failed"] == {}


@ON_THE_CLUSTER
@pytest.mark.slow
def test_real_tiny_recipe_through_ray_gives_the_local_lockfile(cluster, dense_project, tmp_path):
    """Every real action (fetch, convert, shard, export compile, package, reference, verify) on Ray workers, against
    the same recipe built by the local executor (conftest's dense_project, whose lockfile is local.lock here)."""
    project = Path(shutil.copytree(dense_project, tmp_path / "project", ignore=shutil.ignore_patterns("store")))
    shutil.move(project / "artifacts.lock", project / "local.lock")
    env = {**s3_env(shared_server().endpoint), "XDG_CACHE_HOME": str(project / ".cache"), "HF_HUB_OFFLINE": "1"}

    def run(*args: str) -> subprocess.CompletedProcess:
        proc = _cli(*args, cwd=project, env=env, timeout=600)
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc

    out = json.loads(run("compile", "--all", "--executor", "ray", "--address", cluster.address, "--remote",
                         cluster.remote(f"real-{tmp_path.name}"), "--store", "driver-store", "--lock", "ray.lock",
                         "--json").stdout)
    assert out["failed"] == {} and len(out["built"]) == 8
    local, on_ray = (json.loads((project / f"{n}.lock").read_text()) for n in ("local", "ray"))
    assert on_ray["recipes"]["tiny-dense"]["verified"]
    assert {n: e["key"] for n, e in on_ray["nodes"].items() if e["kind"] != "package" and e["kind"] != "verify"} \
        == {n: e["key"] for n, e in local["nodes"].items() if e["kind"] != "package" and e["kind"] != "verify"}
    assert (project / "ray.lock").read_bytes() == (project / "local.lock").read_bytes()
    # The build record names the Ray worker of each step (a host and a pid), for `qbuild report`'s lanes.
    (record,) = (project / ".cache" / "qbuild" / "builds").glob("ray.lock-*.json")
    steps = json.loads(record.read_text())["steps"]
    assert len(steps) == 8 and all(re.fullmatch(r".+ \(pid \d+\)", s["worker"] or "") for s in steps), steps
