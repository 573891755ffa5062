"""The scheduler on toy graphs: readiness in plan order, job and memory-budget admission, keep-going propagation,
deferral closure, and a bad input's producer run again. Pure: no store, no executor, no clock."""

from __future__ import annotations

from qbuild.execution.scheduler import MAX_RERUNS, Scheduler
from qbuild.planning.dag import Plan
from qbuild.planning.graph import upstream, users
from tests.engine_actions import Sleep, add

GIB = 1 << 30


def _sched(edges: dict[str, list[str]], peaks: dict[str, int] | None = None, **opts) -> Scheduler:
    """`edges`: node -> its inputs, in topological order; every peak 1 GiB unless given."""
    return Scheduler(edges, {n: (peaks or {}).get(n, 1) * GIB for n in edges}, **opts)


def _drain(s: Scheduler) -> list[str]:
    """Queue every ready step (each a miss to run), as the engine's decisions would."""
    out = []
    while (nid := s.next_ready()) is not None:
        s.queue(nid)
        out.append(nid)
    return out


DIAMOND = {"a": [], "b": ["a"], "c": ["a"], "d": ["b", "c"]}


def test_a_step_is_ready_once_all_its_inputs_are_done_in_plan_order():
    s = _sched(DIAMOND, jobs=4)
    assert _drain(s) == ["a"]
    assert s.admit() == ["a"]
    assert s.next_ready() is None                   # a runs: nothing else is ready
    s.done("a")
    assert _drain(s) == ["b", "c"]
    assert s.admit() == ["b", "c"]
    s.done("c")
    assert s.next_ready() is None                   # d waits for b as well
    s.done("b")
    assert s.next_ready() == "d"


def test_a_cached_step_makes_its_users_ready_without_running():
    s = _sched(DIAMOND)
    s.done(s.next_ready())                          # a found in the store: never queued
    assert s.next_ready() == "b" and s.running() == []


def test_admission_stops_at_the_number_of_jobs():
    s = _sched({"a": [], "b": [], "c": []}, jobs=2)
    _drain(s)
    assert s.admit() == ["a", "b"]
    assert s.admit() == []
    s.done("b")
    assert s.admit() == ["c"]


def test_the_memory_budget_admits_what_fits_beside_the_running_steps():
    s = _sched({"a": [], "b": [], "c": [], "d": []}, {"a": 6, "b": 6, "c": 2, "d": 3}, jobs=4, mem_budget=10 * GIB)
    _drain(s)
    # b does not fit beside a; c, a smaller one after it, does; d does not fit beside a and c.
    assert s.admit() == ["a", "c"] and s.mem_in_use == 8 * GIB
    s.done("c")
    assert s.admit() == ["d"] and s.mem_in_use == 9 * GIB
    s.done("a")
    assert s.admit() == ["b"] and s.mem_in_use == 9 * GIB
    s.fail("d")
    assert s.mem_in_use == 6 * GIB                  # a failed step frees its share too


def test_a_step_larger_than_the_whole_budget_is_over_it_and_no_budget_holds_everything():
    s = _sched({"huge": [], "small": []}, {"huge": 64, "small": 1}, mem_budget=8 * GIB)
    assert s.over_budget("huge") and not s.over_budget("small")
    assert not _sched({"huge": []}, {"huge": 64}).over_budget("huge")


CHAINS = {"bad": [], "after": ["bad"], "after2": ["after"], "x": [], "y": ["x"]}


def test_keep_going_skips_only_what_is_built_from_the_failure():
    s = _sched(CHAINS, keep_going=True)
    assert s.fail(s.next_ready()) == ["after", "after2"]
    assert s.state["after2"] == "skipped" and not s.stopped
    assert _drain(s) == ["x"]


def test_without_keep_going_a_failure_stops_new_work_and_the_running_steps_finish():
    s = _sched({"bad": [], "x": [], "y": ["x"], "z": []}, jobs=2)
    _drain(s)
    assert s.admit() == ["bad", "x"]
    s.fail("bad")
    assert s.stopped and s.admit() == []            # z stays queued
    s.done("x")                                      # a running step still finishes
    assert s.next_ready() is None                    # y is ready, but the build stopped
    assert s.unstarted() == ["y", "z"]


def test_a_failure_skips_no_step_that_already_runs():
    s = _sched({"p": [], "q": ["p"], "r": ["p"]}, jobs=2, keep_going=True)
    s.done(s.next_ready())
    _drain(s)
    assert s.admit() == ["q", "r"]
    assert s.fail("q") == [] and s.state["r"] == "running"


# The test_engine skip-device graph: v runs on a device; r1 -> r2 (a reference) exist only for it; s also feeds t.
DEVICE = {"a": [], "b": ["a"], "r1": ["a"], "r2": ["r1"], "s": ["a"], "v": ["b", "r2", "s"], "t": ["s"]}


def test_a_step_only_a_device_step_needs_is_left_out_with_it_and_its_dependents_follow_a_deferral():
    s = _sched(DEVICE, wanted={"b", "v"})
    no_device = {"v": "v needs a device"}.get
    assert s.needed_only_by("r1", no_device) == {"v": "v needs a device"}
    assert s.needed_only_by("r2", no_device) == {"v": "v needs a device"}
    assert s.needed_only_by("s", no_device) == {}      # t needs it too
    assert s.needed_only_by("b", no_device) == {}      # a bundle is what the build is for
    assert s.needed_only_by("a", no_device) == {}
    assert s.defer("r1") == ["r2", "v"]                # the deferral takes what is built from it
    assert s.state["v"] == "deferred"
    # Once v is left unbuilt, a step only v needs is left out whatever the device check says.
    assert s.needed_only_by("r2", lambda nid: None) == {"v": "left unbuilt"}


def test_a_deferral_leaves_the_rest_of_the_build_going():
    s = _sched(DEVICE, wanted={"b", "v"})
    s.done(s.next_ready())
    s.defer("r1")
    assert _drain(s) == ["b", "s"] and not s.stopped


PRODUCED = {"p": [], "mid": ["p"], "c": ["mid"], "q": ["p"], "r": ["mid"], "other": []}


def test_a_bad_input_runs_its_producers_again_then_the_step_and_requeues_what_was_keyed_on_them():
    """c's input is mid's output, a file mid linked from p's (both name the bad blob); q and r take p's and mid's."""
    s = _sched(PRODUCED, jobs=1)
    s.done(s.next_ready())                          # p cached
    s.done(s.next_ready())                          # mid cached
    _drain(s)
    assert s.admit() == ["c"]                        # q, r and other wait for the job c holds
    assert s.producers("c") == ["p", "mid"]
    assert s.rerun("c", ["p", "mid"]) is True
    # q and r were keyed on the old outputs: they wait for the new ones; other was not.
    assert {n: s.state[n] for n in PRODUCED} == {"p": "waiting", "mid": "waiting", "c": "waiting", "q": "waiting",
                                                 "r": "waiting", "other": "queued"}
    assert s.mem_in_use == 0
    assert _drain(s) == ["p"]
    s.done("p")
    assert _drain(s) == ["mid", "q"]
    s.done("mid")
    assert _drain(s) == ["c", "r"]


def test_a_step_whose_input_stays_bad_fails_after_max_reruns():
    s = _sched({"p": [], "c": ["p"]})
    for _ in range(MAX_RERUNS):
        s.done(s.next_ready())
        _drain(s)
        assert s.admit() == ["c"]
        assert s.rerun("c", ["p"])
    s.done(s.next_ready())
    _drain(s)
    s.admit()
    assert s.rerun("c", ["p"]) is False and s.state == {"p": "done", "c": "running"}


def test_graph_walks():
    nodes: dict = {}
    a = add(nodes, Sleep, "a", {"name": "a"})
    b = add(nodes, Sleep, "b", {"name": "b"}, {"in0": a, "in1": a})
    c = add(nodes, Sleep, "c", {"name": "c"}, {"in0": b})
    d = add(nodes, Sleep, "d", {"name": "d"})
    graph = Plan(nodes, {}).graph()
    assert graph == {a: (), b: (a,), c: (b,), d: ()}
    graph = {"a": (), "b": ("a",), "c": ("b",), "d": ()}
    assert upstream(graph, ["c"]) == {"a", "b", "c"} and upstream(graph, ["d"]) == {"d"}
    assert users(graph) == {"a": ["b"], "b": ["c"], "c": [], "d": []}
