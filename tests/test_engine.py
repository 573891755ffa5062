"""The engine on toy graphs of test-defined actions: ordering, parallelism, memory budget, failures, processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from qbuild.execution.engine import BuildOptions, build, raise_for
from qbuild.execution.executors.local import LocalExecutor
from qbuild.planning.dag import Plan
from qbuild.core.errors import UserError
from qbuild.store.local import LocalStore
from qbuild.store.spec import StoreSpec
from qbuild.planning.keys import LockedNode
from tests.engine_actions import KINDS, add, read_log

GIB = 1 << 30
MEET_TIMEOUT_S = 60     # how long a rendezvous step waits for its partner: far above a worker's start-up


def _graph(log: Path, spec: list[tuple[str, str, list[str], int]], seconds: float = 0.3) -> Plan:
    """spec: (name, kind, input names, peak GiB) in topological order."""
    nodes, ids = {}, {}
    for name, kind, deps, peak in spec:
        ids[name] = add(nodes, KINDS[kind], name, {"name": name, "log": str(log), "seconds": seconds},
                         {d: ids[d] for d in deps}, 1, peak * GIB)
    return Plan(nodes, {})


def _run(plan: Plan, root: Path, **opts):
    store = LocalStore(root)
    options = BuildOptions(**opts)
    events = []
    result = build(plan, store, StoreSpec(local=str(root)), lambda: LocalExecutor(options.jobs), options,
                   events.append)
    return result, events


def _intervals(log: Path) -> dict[str, tuple[float, float]]:
    out: dict[str, list[float]] = {}
    for e in read_log(log):
        out.setdefault(e["node"], [0.0, 0.0])[0 if e["event"] == "start" else 1] = e["t"]
    return {k: (v[0], v[1]) for k, v in out.items()}


def test_builds_in_dependency_order_and_outputs_flow_downstream(tmp_path):
    log = tmp_path / "log"
    plan = _graph(log, [("a", "test-sleep", [], 1), ("b", "test-sleep", ["a"], 1), ("c", "test-sleep", ["a", "b"], 1)],
                  seconds=0.05)
    result, _ = _run(plan, tmp_path / "store", jobs=2)
    assert result.ok and len(result.built) == 3
    iv = _intervals(log)
    assert iv["a"][1] <= iv["b"][0] and iv["b"][1] <= iv["c"][0]
    c = result.manifests[list(plan.nodes)[2]]
    assert (LocalStore(tmp_path / "store").blob_path(c.outputs["value.txt"]["digest"]).read_text()
            == "c(a(),b(a()))")


def test_second_run_is_all_cached(tmp_path):
    log = tmp_path / "log"
    plan = _graph(log, [("a", "test-sleep", [], 1), ("b", "test-sleep", ["a"], 1)], seconds=0.01)
    _run(plan, tmp_path / "store")
    n_events = len(read_log(log))
    result, events = _run(plan, tmp_path / "store")
    assert result.built == [] and len(result.cached) == 2
    assert len(read_log(log)) == n_events  # nothing ran


def test_independent_nodes_run_in_parallel(tmp_path):
    # Each step waits for the other to have started: both succeed only if -j 2 runs them at the same time.
    nodes: dict = {}
    for name, partner in (("a", "b"), ("b", "a")):
        add(nodes, KINDS["test-rendezvous"], name,
             {"name": name, "partner": partner, "dir": str(tmp_path), "timeout": MEET_TIMEOUT_S}, {}, 1, GIB)
    result, _ = _run(Plan(nodes, {}), tmp_path / "store", jobs=2)
    assert result.ok, result.failed
    assert len(result.built) == 2


def test_a_chain_of_steps_runs_in_one_worker_whatever_the_jobs(tmp_path):
    """A worker starts only when every started one is busy: each imports torch, which steps that run one at a time
    (most rebuilds) never need twice."""
    log = tmp_path / "log"
    plan = _graph(log, [("a", "test-sleep", [], 1), ("b", "test-sleep", ["a"], 1), ("c", "test-sleep", ["b"], 1),
                        ("d", "test-sleep", ["c"], 1)], seconds=0.01)
    result, _ = _run(plan, tmp_path / "store", jobs=4)
    assert result.ok and len(result.built) == 4
    assert len({e["pid"] for e in read_log(log)}) == 1


def test_test_steps_stay_out_of_the_production_registry():
    from qbuild.steps.registry import STEPS

    assert not any(step.kind.startswith("test-") for step in STEPS)


def test_memory_budget_is_never_exceeded(tmp_path):
    log = tmp_path / "log"
    plan = _graph(log, [("a", "test-sleep", [], 6), ("b", "test-sleep", [], 6), ("c", "test-sleep", [], 2)],
                  seconds=0.5)
    result, _ = _run(plan, tmp_path / "store", jobs=3, mem_budget=10 * GIB)
    assert result.ok
    iv = _intervals(log)
    peaks = {"a": 6, "b": 6, "c": 2}
    for t in sorted(x for pair in iv.values() for x in pair):
        in_use = sum(peaks[n] for n, (s, e) in iv.items() if s <= t < e)
        assert in_use <= 10, f"{in_use} GiB running at once"


def test_node_over_budget_fails_clearly_as_bad_input(tmp_path):
    log = tmp_path / "log"
    plan = _graph(log, [("huge", "test-sleep", [], 64)])
    result, _ = _run(plan, tmp_path / "store", mem_budget=8 * GIB, mem_source="--mem 8G")
    (error,) = result.failed.values()
    assert error == "huge needs ~64.0 GiB alone, more than the whole memory budget of 8.0 GiB (--mem 8G); give at " \
        "least that"
    # The budget, not the step, is what must change: exit 2, and nothing ran.
    assert list(result.failed_codes.values()) == [UserError.exit_code] and not read_log(log)
    with pytest.raises(UserError):
        raise_for(result, plan)


def test_a_built_result_other_than_the_locked_one_under_its_key_is_refused_before_it_is_committed(tmp_path):
    """The worker refuses it (the job carries the locked digest): it never becomes the key's entry, so neither a
    later build nor a push can take it."""
    log, root = tmp_path / "log", tmp_path / "store"
    plan = _graph(log, [("a", "test-sleep", [], 1)], seconds=0.01)
    result, _ = _run(plan, root)
    (nid, built), = result.manifests.items()
    store = LocalStore(root)
    store.manifest_path(built.key).unlink()
    locked = {nid: LockedNode(built.key, built.preimage, "0" * 64)}
    again = build(plan, store, StoreSpec(local=str(root)), lambda: LocalExecutor(1), BuildOptions(), lambda e: None,
                  locked)
    (error,) = again.failed.values()
    assert error.startswith(f"a: the built output {built.digest[:12]} differs from the locked 000000000000 under the "
                            f"same key {built.key[:16]}"), error
    assert store.get_manifest(built.key) is None


class _GcAfterLookup(LocalStore):
    """A store whose entry of `key` loses its blobs right after the first lookup finds it: gc removed them between
    the lookup and the use."""

    def __init__(self, root: Path, key: str):
        super().__init__(root)
        self.key, self.fired = key, False

    def get_manifest(self, key):
        manifest = super().get_manifest(key)
        if manifest is not None and key == self.key and not self.fired:
            self.fired = True
            for out in manifest.outputs.values():
                self.blob_path(out["digest"]).unlink()
        return manifest


def test_an_input_removed_meanwhile_is_reported_missing_and_its_producer_is_rebuilt(tmp_path):
    log, root = tmp_path / "log", tmp_path / "store"
    first = _graph(log, [("a", "test-sleep", [], 1)], seconds=0.01)
    result, _ = _run(first, root)
    (a_key,) = [m.key for m in result.manifests.values()]
    second = _graph(log, [("a", "test-sleep", [], 1), ("b", "test-sleep", ["a"], 1)], seconds=0.01)
    events = []
    result = build(second, _GcAfterLookup(root, a_key), StoreSpec(local=str(root)), lambda: LocalExecutor(1),
                   BuildOptions(), events.append)
    assert result.ok, result.failed
    assert [(e.kind, e.node.name) for e in events if e.kind in ("missing", "corrupt")] == [("missing", "b")]
    # b's first run stopped at laying out its input, before its action began.
    assert [e["node"] for e in read_log(log) if e["event"] == "start"] == ["a", "a", "b"]
    assert sorted(second.nodes[n].name for n in result.built) == ["a", "b"] and result.cached == []


def test_progress_names_a_missing_input_missing_and_a_corrupt_one_corrupt(capsys):
    from qbuild.execution.engine import Event
    from qbuild.render import BuildProgress

    plan = _graph(Path("log"), [("b", "test-sleep", [], 1)])
    (node,) = plan.nodes.values()
    progress = BuildProgress()
    progress.on_event(Event("missing", node, error="x: stored blob 1234 is missing from the store"))
    progress.on_event(Event("corrupt", node, error="corrupt blob 5678"))
    assert capsys.readouterr().err.splitlines() == ["MISSING input of b: x: stored blob 1234 is missing from the store",
                                                    "CORRUPT input of b: corrupt blob 5678"]


def test_failure_is_not_cached_and_stops_by_default(tmp_path):
    log = tmp_path / "log"
    plan = _graph(log, [("bad", "test-fail", [], 1), ("after", "test-sleep", ["bad"], 1),
                        ("other", "test-sleep", [], 1)], seconds=0.01)
    result, _ = _run(plan, tmp_path / "store", jobs=1)
    assert len(result.failed) == 1 and "failed on purpose" in next(iter(result.failed.values()))
    assert not result.ok
    ran = {e["node"] for e in read_log(log)}
    assert "after" not in ran
    # Not cached: a second run tries again.
    before = len([e for e in read_log(log) if e["node"] == "bad"])
    _run(plan, tmp_path / "store", jobs=1)
    assert len([e for e in read_log(log) if e["node"] == "bad"]) == before + 1
    assert not any(m.kind == "test-fail" for m in LocalStore(tmp_path / "store").manifests())


def test_keep_going_builds_what_does_not_depend_on_the_failure(tmp_path):
    log = tmp_path / "log"
    plan = _graph(log, [("bad", "test-fail", [], 1), ("after", "test-sleep", ["bad"], 1),
                        ("x", "test-sleep", [], 1), ("y", "test-sleep", ["x"], 1)], seconds=0.01)
    result, _ = _run(plan, tmp_path / "store", jobs=1, keep_going=True)
    names = {plan.nodes[n].name for n in result.built}
    assert names == {"x", "y"}
    assert {plan.nodes[n].name for n in result.skipped} == {"after"}


class _NoDevice(LocalExecutor):
    """A host without Neuron devices, whatever this one has: the executor is the seam that says what a host runs."""

    def capacity_check(self, node):
        return f"{node.name} needs a device" if node.needs_device else None


def test_skip_device_leaves_unbuilt_the_device_steps_and_what_only_they_need(tmp_path):
    """A recipe's verify runs on NeuronCores; its reference (here a chain r1 -> r2) exists only for it. --skip-device
    leaves all three unbuilt; the bundle and a step another step also uses (s) are built."""
    from qbuild.planning.plan import PlannedRecipe

    log = tmp_path / "log"
    nodes, ids = {}, {}
    for name, deps, cores in (("a", [], 0), ("b", ["a"], 0), ("r1", ["a"], 0), ("r2", ["r1"], 0), ("s", ["a"], 0),
                              ("v", ["b", "r2", "s"], 2), ("t", ["s"], 0)):
        ids[name] = add(nodes, KINDS["test-sleep"], name, {"name": name, "log": str(log), "seconds": 0.01},
                         {d: ids[d] for d in deps}, 1, GIB, resources={"neuron_cores": cores} if cores else None)
    plan = Plan(nodes, {"toy": PlannedRecipe(None, None, dict(ids), bundle=ids["b"], verify=ids["v"])})
    events = []

    def run(**opts):
        options = BuildOptions(jobs=2, **opts)
        return build(plan, LocalStore(tmp_path / "store"), StoreSpec(local=str(tmp_path / "store")),
                     lambda: _NoDevice(2), options, events.append)

    def names(node_ids) -> set[str]:
        return {plan.nodes[n].name for n in node_ids}

    result = run(skip_device=True)
    assert result.ok and names(result.built) == {"a", "b", "s", "t"}
    assert names(result.deferred) == {"v", "r1", "r2"}
    assert {e["node"] for e in read_log(log)} == {"a", "b", "s", "t"}
    why = {e.node.name: e.error for e in events if e.kind == "skipped"}
    assert why["v"] == "left unbuilt (--skip-device): v needs a device"
    assert why["r1"] == "left unbuilt (--skip-device): only v needs it"
    # Without --skip-device the device step fails, and nothing it alone needs is left out.
    events.clear()
    result = run(keep_going=True)
    assert names(result.failed) == {"v"} and names(result.built) == {"r1", "r2"}


def test_a_killed_worker_fails_its_step_only_and_the_next_step_gets_a_new_worker(tmp_path):
    log = tmp_path / "log"
    plan = _graph(log, [("killed", "test-die", [], 1), ("after", "test-sleep", ["killed"], 1),
                        ("x", "test-sleep", [], 1), ("y", "test-sleep", ["x"], 1)], seconds=0.01)
    result, _ = _run(plan, tmp_path / "store", jobs=1, keep_going=True)
    (error,) = result.failed.values()
    assert "killed: its worker process ended (killed by signal 9)" in error
    assert {plan.nodes[n].name for n in result.built} == {"x", "y"}
    assert {plan.nodes[n].name for n in result.skipped} == {"after"}
    pids = {e["node"]: e["pid"] for e in read_log(log)}
    assert pids["killed"] != pids["x"] == pids["y"]


def test_strict_fails_on_a_miss_naming_the_node(tmp_path):
    log = tmp_path / "log"
    plan = _graph(log, [("needed", "test-sleep", [], 1)])
    result, _ = _run(plan, tmp_path / "store", strict=True)
    (error,) = result.failed.values()
    assert "needed is not in the store" in error and not read_log(log)


_CONCURRENT = textwrap.dedent("""
    import sys
    from pathlib import Path
    from tests.test_engine import _graph, _run
    log, store = Path(sys.argv[1]), Path(sys.argv[2])
    plan = _graph(log, [("a", "test-sleep", [], 1), ("b", "test-sleep", ["a"], 1), ("c", "test-sleep", [], 1),
                        ("d", "test-sleep", ["b", "c"], 1)], seconds=0.3)
    result, _ = _run(plan, store, jobs=2)
    print(sorted((n, m.digest) for n, m in result.manifests.items()))
    sys.exit(0 if result.ok else 1)
""")


@pytest.mark.parametrize("processes", [2, 4])
def test_concurrent_processes_build_each_node_once(tmp_path, processes):
    log, store = tmp_path / "log", tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, "-c", _CONCURRENT, str(log), str(store)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(processes)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert len({o[0] for o in outs}) == 1, "processes saw different results"
    starts = [e["node"] for e in read_log(log) if e["event"] == "start"]
    assert sorted(starts) == ["a", "b", "c", "d"], f"nodes built more than once: {starts}"


_COUNT_LOCK_READS = textwrap.dedent("""
    import json, sys
    from tests.remote_actions import register_fake_actions
    register_fake_actions()
    from qbuild.planning import lock as lockmod
    seen = {"reads": 0, "merges": 0, "writes": 0}
    read, directory_locked, atomic_write = lockmod.read, lockmod.directory_locked, lockmod.atomic_write
    merging = []

    def counted_read(path):
        seen["merges" if merging else "reads"] += 1
        return read(path)

    def counted_lock(directory):
        merging.append(True)
        return directory_locked(directory)

    def counted_write(path, data):
        seen["writes"] += 1
        return atomic_write(path, data)

    lockmod.read, lockmod.directory_locked, lockmod.atomic_write = counted_read, counted_lock, counted_write
    from qbuild.cli import app
    try:
        app(["compile", "--all", "--mem", "1T", "--store", "store"], standalone_mode=False)
    finally:
        print(json.dumps(seen))
""")


def test_a_compile_reads_the_lockfile_once_and_one_that_changes_nothing_writes_nothing(tmp_path):
    """The workspace reads the lockfile once and hands the document down; each write merges into the file under its
    directory's lock (reading it there, as other processes write too), and a build whose entries are the lock's
    neither merges nor writes."""
    from tests.conftest import REPO
    from tests.test_remote_pipeline import make_project

    project = make_project(tmp_path / "p")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "XDG_CACHE_HOME": str(tmp_path / "xdg")}

    def compile_() -> dict:
        proc = subprocess.run([sys.executable, "-c", _COUNT_LOCK_READS], cwd=project, env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.splitlines()[-1])

    first = compile_()
    assert first["reads"] == 1 and first["writes"] >= 1 and first["merges"] >= first["writes"], first
    assert compile_() == {"reads": 1, "merges": 0, "writes": 0}
