"""The scheduler: which steps of a build are ready, which may start now, and what a failure or a deferral takes along.

Pure bookkeeping over the plan's graph (qbuild.planning.graph), each step's state and its estimated peak memory: no
store, no executor, no clock. The engine (qbuild.execution.engine) asks it and does the work: it keys a ready step, looks
it up in the store, and tells the scheduler what became of it.

A step's life:

    waiting --(its inputs all done)--> ready: the engine decides it
        -> done (cached), failed, deferred, or queued (a miss to run)
    queued --admit: a free job and room in the memory budget--> running -> done | failed | waiting again (rerun)

Failing a step skips the steps not started yet that are built from it; without keep_going it also stops the build:
nothing more is ready or admitted, and the running steps finish. Deferring a step (a device step this host leaves
unbuilt) defers those steps too. A running step whose input turned out corrupt or missing runs again after the steps
that produced that input are run again (rerun).
"""

from __future__ import annotations

from typing import Callable, Collection, Literal, Mapping

from qbuild.planning.graph import Graph, upstream, users

State = Literal["waiting", "queued", "running", "done", "failed", "skipped", "deferred"]
UNSTARTED = ("waiting", "queued")
MAX_RERUNS = 2      # how often a step whose input was bad runs again before its failure stands


class Scheduler:
    def __init__(self, graph: Graph, peaks: Mapping[str, int], jobs: int = 1, mem_budget: int | None = None,
                 keep_going: bool = False, wanted: Collection[str] = ()):
        """`graph`: node id -> its inputs, in topological order; `peaks`: node id -> its estimated peak bytes;
        `mem_budget`: bytes the running steps may sum to (None: no limit); `wanted`: the steps a build is for (a
        recipe's bundle and verify), which are never left out as needed by nothing."""
        self.graph = graph
        self.peaks = peaks
        self.jobs = max(1, jobs)
        self.mem_budget = mem_budget
        self.keep_going = keep_going
        self.wanted = set(wanted)
        self.users = users(graph)
        self.state: dict[str, State] = dict.fromkeys(graph, "waiting")
        self.reruns: dict[str, int] = {}
        self.stopped = False
        self.mem_in_use = 0

    # --- questions -------------------------------------------------------------------------------------------------
    def next_ready(self) -> str | None:
        """The first waiting step, in plan order, whose inputs are all done; None when there is none or the build
        stopped."""
        if self.stopped:
            return None
        for nid, state in self.state.items():
            if state == "waiting" and all(self.state[dep] == "done" for dep in self.graph[nid]):
                return nid
        return None

    def running(self) -> list[str]:
        return [nid for nid, state in self.state.items() if state == "running"]

    def unstarted(self) -> list[str]:
        """The steps neither started nor decided: what a stopped build leaves out."""
        return [nid for nid, state in self.state.items() if state in UNSTARTED]

    def over_budget(self, nid: str) -> bool:
        """Whether the step alone needs more than the whole memory budget: it can never start."""
        return self.mem_budget is not None and self.peaks[nid] > self.mem_budget

    def dependents(self, nid: str) -> list[str]:
        """The steps not started yet that are built from `nid`, through other such steps, in plan order."""
        reached = {nid}
        out = []
        for other, inputs in self.graph.items():
            if self.state[other] in UNSTARTED and other != nid and reached.intersection(inputs):
                reached.add(other)
                out.append(other)
        return out

    def producers(self, nid: str) -> list[str]:
        """The done steps `nid` is built from, at any depth, in plan order: where a bad input of it may come from."""
        above = upstream(self.graph, self.graph[nid])
        return [other for other in self.graph if other in above and self.state[other] == "done"]

    def needed_only_by(self, nid: str, cannot_run: Callable[[str], str | None]) -> dict[str, str]:
        """{step: why it is left unbuilt} when such steps are the only reason to build `nid`, else {}. `cannot_run`
        says why a step can never run here (a device step on a host without the device), or None. A step the build
        is for always counts as a reason, and so does a step with no users."""
        memo: dict[str, dict[str, str] | None] = {}

        def only_for(step: str) -> dict[str, str] | None:
            if step not in memo:
                memo[step] = None if step in self.wanted or not self.users[step] else _left(step)
            return memo[step]

        def _left(step: str) -> dict[str, str] | None:
            left: dict[str, str] = {}
            for user in self.users[step]:
                if (why := cannot_run(user)) is not None:
                    left[user] = why
                elif self.state[user] == "deferred":
                    left[user] = "left unbuilt"
                elif (sub := only_for(user)) is not None:
                    left.update(sub)
                else:
                    return None
            return left

        return only_for(nid) or {}

    # --- what became of a step -------------------------------------------------------------------------------------
    def queue(self, nid: str) -> None:
        """A ready step that must run: it waits for admit."""
        assert self.state[nid] == "waiting", (nid, self.state[nid])
        self.state[nid] = "queued"

    def admit(self) -> list[str]:
        """The queued steps that start now, in plan order, marked running: while a job is free, each one whose peak
        fits beside the running steps' in the memory budget (a smaller step after one that does not fit may start)."""
        started = []
        busy = len(self.running())
        for nid in [n for n, state in self.state.items() if state == "queued"]:
            if self.stopped or busy >= self.jobs:
                break
            if self.mem_budget is not None and self.mem_in_use + self.peaks[nid] > self.mem_budget:
                continue
            self.state[nid] = "running"
            self.mem_in_use += self.peaks[nid]
            busy += 1
            started.append(nid)
        return started

    def done(self, nid: str) -> None:
        """The step's output is known (cached or built)."""
        self._leave(nid)
        self.state[nid] = "done"

    def fail(self, nid: str) -> list[str]:
        """The step failed: the steps not started that are built from it are skipped (returned), and without
        keep_going the build stops."""
        self._leave(nid)
        self.state[nid] = "failed"
        skipped = self.dependents(nid)
        for dep in skipped:
            self.state[dep] = "skipped"
        if not self.keep_going:
            self.stopped = True
        return skipped

    def defer(self, nid: str) -> list[str]:
        """Leave the step unbuilt, and the steps not started that are built from it (returned)."""
        self._leave(nid)
        self.state[nid] = "deferred"
        deferred = self.dependents(nid)
        for dep in deferred:
            self.state[dep] = "deferred"
        return deferred

    def rerun(self, nid: str, producers: Collection[str]) -> bool:
        """Run the running step `nid` again, after `producers` (done steps whose output was its bad input) run again:
        they wait again, and so does every queued step that takes one of them (it was keyed with the old output).
        False, changing nothing, once `nid` ran again MAX_RERUNS times."""
        if self.reruns.get(nid, 0) >= MAX_RERUNS:
            return False
        self.reruns[nid] = self.reruns.get(nid, 0) + 1
        self._leave(nid)
        self.state[nid] = "waiting"
        for producer in producers:
            assert self.state[producer] == "done", (producer, self.state[producer])
            self.state[producer] = "waiting"
        for other, state in self.state.items():   # a queued step's inputs are all done
            if state == "queued" and any(self.state[dep] != "done" for dep in self.graph[other]):
                self.state[other] = "waiting"
        return True

    def _leave(self, nid: str) -> None:
        """Free what a running step held."""
        if self.state[nid] == "running":
            self.mem_in_use -= self.peaks[nid]
