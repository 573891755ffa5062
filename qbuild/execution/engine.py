"""The engine: walks the plan, runs what is not cached on an executor, and reports each step as an event.

What may start when is the scheduler's answer (qbuild.execution.scheduler: the dependency order, the number of jobs (-j),
and a memory budget: each node declares its estimated peak, and running nodes never sum past the budget; a node
larger than the whole budget is refused as bad input). The loop here does the work around it: a ready node is keyed
with its inputs' digests (qbuild.planning.keys.PlanKeys; for a node whose output is not portable, with this host's
platform tag), a hit in the store skips it, a miss runs on the executor. By default the first failure stops new work
(the steps already running finish and are kept); with keep_going, only the failed node's dependents are skipped. A
step whose input turns out corrupt or missing runs again after that input's producer is built again.

While a step runs, what it reports of its work (bytes, seconds: qbuild.core.progress) reaches `on_progress` with its
node, from the executor's threads; a timed step (Step.timed: compile) is told how long the last build of the
same kind and architecture took (qbuild.store.durations).

A node whose key is the one the lock holds for it must have the lock's output: a result under that key with another
digest (built from an input that changed outside the key, or cached in a store or remote that holds other bytes
under it) fails the node, naming both digests, before anything uses it; a worker refuses such a result before it
commits or pushes it (the job carries the locked digest). The caller passes no lock entries where it accepts other
bytes (`compile --update`) or compares the whole lock itself (`--frozen`).
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Callable, Literal, Mapping, Protocol

from qbuild.execution.job import Job
from qbuild.execution.scheduler import UNSTARTED, Scheduler
from qbuild.core.errors import BuildError, InfraError, QbuildError, UserError
from qbuild.core.progress import Tick
from qbuild.core.units import human_bytes
from qbuild.planning.dag import Node, Plan
from qbuild.planning.keys import LockedNode, PlanKeys, other_bytes
from qbuild.store.spec import StoreSpec
from qbuild.store.durations import Durations
from qbuild.store.local import CorruptBlobError
from qbuild.store.manifest import Manifest


class Executor(Protocol):
    def submit(self, job: Job, node: Node, on_progress: Callable[[Tick], None] | None = None) -> Future: ...
    def capacity_check(self, node: Node) -> str | None: ...
    def shutdown(self) -> None: ...


@dataclass
class Event:
    # "corrupt" / "missing": an input of the node was corrupt / gone from the store; its producer is built again
    kind: Literal["cached", "start", "built", "failed", "skipped", "corrupt", "missing"]
    node: Node
    manifest: Manifest | None = None
    error: str | None = None
    seconds: float = 0.0
    output: list[str] | None = None    # what the step's libraries printed (built or failed steps)
    worker: str | None = None          # who ran a failed step (a built one's is in its manifest's meta)


@dataclass
class BuildResult:
    manifests: dict[str, Manifest] = field(default_factory=dict)
    built: list[str] = field(default_factory=list)
    cached: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    failed_codes: dict[str, int] = field(default_factory=dict)   # failed node -> the exit code its error maps to
    skipped: list[str] = field(default_factory=list)
    deferred: list[str] = field(default_factory=list)   # device steps left unbuilt (--skip-device), and dependents

    @property
    def ok(self) -> bool:
        return not self.failed and not self.skipped

    def forget(self, nid: str) -> None:
        """Drop a finished node's result: it is built again."""
        self.manifests.pop(nid, None)
        for bucket in (self.cached, self.built):
            if nid in bucket:
                bucket.remove(nid)


@dataclass
class BuildOptions:
    jobs: int = 1
    mem_budget: int | None = None       # bytes; None = no limit
    mem_source: str = "--mem"           # where the budget came from, as a refusal names it ("--mem 20G")
    keep_going: bool = False
    strict: bool = False                # any node that would have to be built is an error
    skip_device: bool = False           # a device step no worker can run is left unbuilt instead of failing, and
                                        # so is any step built only for such steps


ProgressCallback = Callable[[Node, Tick], None]


def build(plan: Plan, store, spec: StoreSpec, executor_factory: Callable[[], Executor], options: BuildOptions,
          on_event: Callable[[Event], None] = lambda e: None, locked: Mapping[str, LockedNode] | None = None,
          on_progress: ProgressCallback | None = None) -> BuildResult:
    """Build every node of `plan`, keying each with its inputs' digests as they are cached or built. `locked` (node id
    -> the lock's entry for it): a result under a locked key must have the locked digest (see the module docstring).
    `on_progress` hears what running steps report (from the executor's threads)."""
    run = _Run(plan, store, spec, executor_factory, options, on_event, locked or {}, on_progress)
    try:
        run.loop()
    finally:
        if run.executor is not None:
            run.executor.shutdown()
    run.result.skipped.extend(run.sched.unstarted())     # what a stopped build did not get to
    return run.result


class _Run:
    """One build: the scheduler's answers turned into store lookups, jobs on the executor, and events."""

    def __init__(self, plan: Plan, store, spec: StoreSpec, executor_factory: Callable[[], Executor],
                 options: BuildOptions, on_event: Callable[[Event], None], locked: Mapping[str, LockedNode],
                 on_progress: ProgressCallback | None = None):
        self.plan, self.store, self.spec, self.options = plan, store, spec, options
        self.on_event, self.locked = on_event, locked
        self.on_progress = on_progress
        self.executor_factory = executor_factory
        self.executor: Executor | None = None            # started at the first step to run
        self.keys = PlanKeys(plan)
        self.sched = Scheduler(plan.graph(), {nid: node.est_peak_bytes for nid, node in plan.nodes.items()},
                               options.jobs, options.mem_budget, options.keep_going,
                               wanted={nid for pr in plan.recipes.values() for nid in (pr.bundle, pr.verify)})
        self.result = BuildResult()
        self.jobs: dict[str, Job] = {}                    # queued node -> its job
        self.running: dict[Future, tuple[str, float]] = {}   # -> (node id, when it started)
        self.durations = Durations(store.local)            # read once, at the first timed step to build

    def loop(self) -> None:
        while True:
            while (nid := self.sched.next_ready()) is not None:
                self.decide(nid)
            for nid in self.sched.admit():
                node = self.plan.nodes[nid]
                self.running[self.executor.submit(self.jobs.pop(nid), node, self.reporter(node))] = \
                    (nid, time.monotonic())
                self.on_event(Event("start", node))
            if not self.running:
                return
            done, _ = wait(list(self.running), return_when=FIRST_COMPLETED)
            for future in done:
                self.finish(future)

    def decide(self, nid: str) -> None:
        """Key a ready node; take its store entry, or refuse it, leave it unbuilt, or queue it to run."""
        node = self.plan.nodes[nid]
        nk = self.keys.key(nid, {dep: self.result.manifests[dep].digest for dep in node.deps.values()})
        hit = self.store.get_manifest(nk.key)
        if hit is not None:
            return self.accept(nid, hit, "cached")
        problem = self.refusal(node, nk.key)
        if problem is not None and node.needs_device and self.options.skip_device:
            return self.defer(nid, str(problem))
        if problem is not None:
            hint = ", or pass --skip-device to leave it unbuilt" if node.needs_device else ""
            return self.fail(nid, str(problem) + hint, problem.exit_code)
        if self.options.skip_device and (left := self.sched.needed_only_by(nid, self.cannot_run)):
            # A step whose every use is a device step this host leaves unbuilt (the reference of a neuron verify)
            # would be built for nothing: the device host that verifies builds it, for its platform.
            for dev, why in left.items():
                if self.sched.state[dev] in UNSTARTED:
                    self.defer(dev, why)
            return self.defer(nid, "only " + ", ".join(self.plan.nodes[d].name for d in left) + " needs it")
        self.jobs[nid] = Job(node_id=nid, step=node.step, name=node.name, key=nk.key, preimage=nk.preimage,
                             params=node.params, store_spec=self.spec,
                             inputs={name: self.result.manifests[d].outputs for name, d in node.deps.items()},
                             source=node.source, code=node.code, locked_digest=self.locked_digest(nid, nk.key),
                             expected_seconds=self.durations.expected(node.kind, nk.preimage)
                             if node.step.timed else None)
        self.sched.queue(nid)

    def reporter(self, node: Node) -> Callable[[Tick], None] | None:
        on_progress = self.on_progress
        return None if on_progress is None else (lambda report: on_progress(node, report))

    def finish(self, future: Future) -> None:
        nid, started = self.running.pop(future)
        try:
            manifest = future.result()
        except CorruptBlobError as e:
            return self.rerun(nid, e)
        except QbuildError as e:
            return self.fail(nid, str(e), e.exit_code, getattr(e, "output", None), getattr(e, "worker", None))
        except Exception as e:  # a worker that died (killed, out of memory) or an executor fault
            return self.fail(nid, f"{self.plan.nodes[nid].name}: worker failed: {type(e).__name__}: {e}",
                             worker=getattr(e, "worker", None))
        how = "cached" if manifest.meta.get("reused") else "built"
        self.accept(nid, manifest, how, time.monotonic() - started)

    def refusal(self, node: Node, key: str) -> QbuildError | None:
        """Why a miss is not built here: --strict, a step larger than the whole memory budget (bad input: the budget
        must grow), or the executor's answer (this host or cluster cannot run it)."""
        if self.options.strict:
            return BuildError(f"{node.name} is not in the store (key {key[:16]}) and --strict forbids building it")
        if self.sched.over_budget(node.id):
            return UserError(f"{node.name} needs ~{human_bytes(node.est_peak_bytes)} alone, more than the whole "
                             f"memory budget of {human_bytes(self.options.mem_budget)} ({self.options.mem_source}); "
                             "give at least that")
        if self.executor is None:
            self.store.check_writable()   # a read-only or unusable store fails here, before any step runs
            self.executor = self.executor_factory()
        why = self.executor.capacity_check(node)
        return None if why is None else BuildError(why)

    def cannot_run(self, nid: str) -> str | None:
        """Why a device step can never run on this executor; None for any other step."""
        node = self.plan.nodes[nid]
        return self.executor.capacity_check(node) if node.needs_device else None

    def locked_digest(self, nid: str, key: str) -> str | None:
        entry = self.locked.get(nid)
        return None if entry is None else entry.digest_under(key)

    def accept(self, nid: str, manifest: Manifest, how: Literal["cached", "built"], seconds: float = 0.0) -> None:
        node = self.plan.nodes[nid]
        refused = other_bytes(node.name, how, manifest, self.locked_digest(nid, manifest.key))
        if refused is not None:
            return self.fail(nid, refused)
        self.sched.done(nid)
        self.result.manifests[nid] = manifest
        (self.result.built if how == "built" else self.result.cached).append(nid)
        self.on_event(Event(how, node, manifest, seconds=seconds,
                            output=manifest.meta.get("output") if how == "built" else None))

    def fail(self, nid: str, error: str, code: int = BuildError.exit_code, output: list[str] | None = None,
             worker: str | None = None) -> None:
        self.result.failed[nid] = error
        self.result.failed_codes[nid] = code
        self.on_event(Event("failed", self.plan.nodes[nid], error=error, output=output, worker=worker))
        for dep in self.sched.fail(nid):
            self.result.skipped.append(dep)
            self.on_event(Event("skipped", self.plan.nodes[dep], error=f"input {self.plan.nodes[nid].name} failed"))

    def defer(self, nid: str, why: str) -> None:
        self.result.deferred.append(nid)
        self.on_event(Event("skipped", self.plan.nodes[nid], error=f"left unbuilt (--skip-device): {why}"))
        for dep in self.sched.defer(nid):
            self.result.deferred.append(dep)
            self.on_event(Event("skipped", self.plan.nodes[dep],
                                error=f"input {self.plan.nodes[nid].name} left unbuilt"))

    def rerun(self, nid: str, e: CorruptBlobError) -> None:
        """An input of `nid` was corrupt or gone: build whatever produced it again, then `nid`."""
        producers = [p for p in self.sched.producers(nid)
                     if any(o["digest"] == e.digest for o in self.result.manifests[p].outputs.values())]
        if not self.sched.rerun(nid, producers):
            return self.fail(nid, str(e), e.exit_code)
        self.on_event(Event("missing" if e.missing else "corrupt", self.plan.nodes[nid], error=str(e)))
        for producer in producers:
            self.result.forget(producer)


def raise_for(result: BuildResult, plan: Plan) -> None:
    """Raise the build's failures as one error: infrastructure (exit 3) if any step failed for want of a disk or a
    remote, bad input (exit 2) if every failure was one, else a failed build (exit 1)."""
    if result.failed:
        lines = [f"{plan.nodes[n].name}: {e}" if not e.startswith(plan.nodes[n].name) else e
                 for n, e in result.failed.items()]
        codes = set(result.failed_codes.values())
        error = InfraError if InfraError.exit_code in codes else UserError if codes == {UserError.exit_code} \
            else BuildError
        raise error("; ".join(lines))
