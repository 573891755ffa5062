"""The engine: walks the plan, runs what is not cached on an executor, and reports each step as an event.

Scheduling respects three limits at once: the dependency order, the number of jobs (-j), and a memory budget
(each node declares its estimated peak; running nodes never sum past the budget). A node's key is computed when
its inputs' digests are known (for a node whose output is not portable, with this host's platform tag); a hit in the
store skips it. By default the first failure stops new work (the
steps already running finish and are kept); with keep_going, only the failed node's dependents are skipped.

A node whose key is the one the lock holds for it must have the lock's output: a result under that key with another
digest (built from an input that changed outside the key, or cached in a store or remote that holds other bytes
under it) fails the node, naming both digests, before anything uses it. The caller passes no lock entries where it
accepts other bytes (`compile --update`) or compares the whole lock itself (`--frozen`).
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Literal, Mapping, Protocol

from qbuild.core.errors import BuildError, InfraError, QbuildError, UserError
from qbuild.build.job import Job
from qbuild.core.platform import host_tag
from qbuild.planning.keys import REGISTRY, Registry, key_node, portability
from qbuild.planning.plan import Node, Plan
from qbuild.store import StoreSpec
from qbuild.store.local import CorruptBlobError
from qbuild.store.manifest import Manifest

if TYPE_CHECKING:
    from qbuild.store.lock import LockedNode


class Executor(Protocol):
    def submit(self, job: Job, node: Node) -> Future: ...
    def capacity_check(self, node: Node) -> str | None: ...
    def shutdown(self) -> None: ...


@dataclass
class Event:
    kind: Literal["cached", "start", "built", "failed", "skipped", "corrupt"]
    node: Node
    manifest: Manifest | None = None
    error: str | None = None
    seconds: float = 0.0
    output: list[str] | None = None    # what the step's libraries printed (built or failed steps)


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


@dataclass
class BuildOptions:
    jobs: int = 1
    mem_budget: int | None = None       # bytes; None = no limit
    keep_going: bool = False
    strict: bool = False                # any node that would have to be built is an error
    skip_device: bool = False           # a device step no worker can run is left unbuilt instead of failing, and
                                        # so is any step built only for such steps


def build(plan: Plan, store, spec: StoreSpec, executor_factory: Callable[[], Executor], options: BuildOptions,
          on_event: Callable[[Event], None] = lambda e: None, registry: Registry = REGISTRY,
          locked: Mapping[str, LockedNode] | None = None) -> BuildResult:
    """Build every node of `plan`, keying each with its inputs' digests as they are cached or built. `locked` (node id
    -> the lock's entry for it): a result under a locked key must have the locked digest (see the module docstring)."""
    order = list(plan.nodes)
    waiting = list(order)                                       # not started yet, in topological order
    retries: dict[str, int] = {}
    result = BuildResult()
    running: dict[Future, tuple[str, float]] = {}
    mem_in_use = 0
    executor: Executor | None = None
    stop = False
    portable = portability(plan, registry)
    wanted = {nid for pr in plan.recipes.values() for nid in (pr.bundle, pr.verify)}
    users: dict[str, list[str]] = {nid: [] for nid in plan.nodes}
    for nid, node in plan.nodes.items():
        for dep in set(node.deps.values()):
            users[dep].append(nid)

    def fail(nid: str, error: str, code: int = BuildError.exit_code, output: list[str] | None = None) -> None:
        nonlocal stop
        result.failed[nid] = error
        result.failed_codes[nid] = code
        on_event(Event("failed", plan.nodes[nid], error=error, output=output))
        for dep in _dependents(plan, nid, waiting):
            waiting.remove(dep)
            result.skipped.append(dep)
            on_event(Event("skipped", plan.nodes[dep], error=f"input {plan.nodes[nid].name} failed"))
        if not options.keep_going:
            stop = True

    def _only_for_unbuilt(nid: str) -> dict[str, str]:
        """{device step: why it is left unbuilt} when those steps are the only reason to build `nid`, else {}.
        A recipe's bundle and its verify are what a build is for, so they always count as a reason."""
        if nid in wanted or not users[nid]:
            return {}
        left: dict[str, str] = {}
        for user in users[nid]:
            node = plan.nodes[user]
            why = executor.capacity_check(node) if node.needs_device else None
            if why is not None:
                left[user] = why
            elif user in result.deferred:
                left[user] = "left unbuilt"
            elif sub := _only_for_unbuilt(user):
                left.update(sub)
            else:
                return {}
        return left

    def defer(nid: str, why: str) -> None:
        result.deferred.append(nid)
        on_event(Event("skipped", plan.nodes[nid], error=f"left unbuilt (--skip-device): {why}"))
        for dep in _dependents(plan, nid, waiting):
            waiting.remove(dep)
            result.deferred.append(dep)
            on_event(Event("skipped", plan.nodes[dep], error=f"input {plan.nodes[nid].name} left unbuilt"))

    try:
        while True:
            progressed = False
            for nid in list(waiting):
                node = plan.nodes[nid]
                if stop or nid not in waiting or not all(d in result.manifests for d in node.deps.values()):
                    continue
                nk = key_node(node, {d: result.manifests[d].digest for d in node.deps.values()}, registry,
                              None if portable[nid] else host_tag())
                pre, key = nk.preimage, nk.key
                hit = store.get_manifest(key)
                if hit is not None:
                    waiting.remove(nid)
                    progressed = True
                    if drift := _drift(node, hit, "cached", locked):
                        fail(nid, drift)
                        continue
                    result.manifests[nid] = hit
                    result.cached.append(nid)
                    on_event(Event("cached", node, hit))
                    continue
                problem = None
                if options.strict:
                    problem = f"{node.name} is not in the store (key {key[:16]}) and --strict forbids building it"
                elif options.mem_budget is not None and node.est_peak_bytes > options.mem_budget:
                    problem = (f"{node.name} needs ~{node.est_peak_bytes / 2**30:.1f} GiB, over the memory budget "
                               f"of {options.mem_budget / 2**30:.1f} GiB (--mem)")
                else:
                    if executor is None:
                        store.check_writable()   # a read-only or unusable store fails here, before any step runs
                        executor = executor_factory()
                    problem = executor.capacity_check(node)
                if problem is not None and node.needs_device and options.skip_device:
                    waiting.remove(nid)
                    defer(nid, problem)
                    progressed = True
                    continue
                if problem is None and options.skip_device and (left := _only_for_unbuilt(nid)):
                    # A step whose every use is a device step this host leaves unbuilt (the reference of a neuron
                    # verify) would be built for nothing: the device host that verifies builds it, for its platform.
                    for dev, why in left.items():
                        if dev in waiting:
                            waiting.remove(dev)
                            defer(dev, why)
                    waiting.remove(nid)
                    defer(nid, "only " + ", ".join(plan.nodes[d].name for d in left) + " needs it")
                    progressed = True
                    continue
                if problem is not None:
                    waiting.remove(nid)
                    fail(nid, problem + (", or pass --skip-device to leave it unbuilt" if node.needs_device else ""))
                    progressed = True
                    continue
                if len(running) >= options.jobs:
                    break
                if options.mem_budget is not None and mem_in_use + node.est_peak_bytes > options.mem_budget:
                    continue
                job = Job(node_id=nid, kind=node.kind, name=node.name, key=key, preimage=pre, params=node.params,
                          inputs={name: result.manifests[d].outputs for name, d in node.deps.items()},
                          store_spec=spec, entry=registry[node.kind].entry, context=node.context,
                          backend=node.backend)
                waiting.remove(nid)
                running[executor.submit(job, node)] = (nid, time.monotonic())
                mem_in_use += node.est_peak_bytes
                on_event(Event("start", node))
                progressed = True
            if not running:
                if progressed and not stop:
                    continue
                break
            done, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for fut in done:
                nid, started = running.pop(fut)
                mem_in_use -= plan.nodes[nid].est_peak_bytes
                try:
                    manifest = fut.result()
                except CorruptBlobError as e:
                    # An input was corrupt on disk: rebuild whatever produced it, then this node again.
                    retries[nid] = retries.get(nid, 0) + 1
                    if retries[nid] > 2:
                        fail(nid, str(e), e.exit_code)
                        continue
                    on_event(Event("corrupt", plan.nodes[nid], error=str(e)))
                    for producer in _closure(plan, set(plan.nodes[nid].deps.values())):
                        m = result.manifests.get(producer)
                        if m is not None and any(o["digest"] == e.digest for o in m.outputs.values()):
                            _requeue(plan, producer, result, waiting)
                    waiting.append(nid)
                    waiting.sort(key=order.index)
                    continue
                except QbuildError as e:
                    fail(nid, str(e), e.exit_code, getattr(e, "output", None))
                    continue
                except Exception as e:  # a worker that died (killed, out of memory) or an executor fault
                    fail(nid, f"{plan.nodes[nid].name}: worker failed: {type(e).__name__}: {e}")
                    continue
                if drift := _drift(plan.nodes[nid], manifest, "cached" if manifest.meta.get("reused") else "built",
                                   locked):
                    fail(nid, drift)
                    continue
                result.manifests[nid] = manifest
                if manifest.meta.get("reused"):
                    result.cached.append(nid)
                    on_event(Event("cached", plan.nodes[nid], manifest))
                else:
                    result.built.append(nid)
                    on_event(Event("built", plan.nodes[nid], manifest, seconds=time.monotonic() - started,
                                   output=manifest.meta.get("output")))
    finally:
        if executor is not None:
            executor.shutdown()
    result.skipped.extend(n for n in waiting if n not in result.skipped)
    return result


def _drift(node: Node, manifest: Manifest, how: str, locked: Mapping[str, LockedNode] | None) -> str | None:
    """Why `manifest` (the node's result, `how`: "built" or "cached") must not be accepted: its key is the one the lock
    holds for the node, its output digest is not. None when it may be."""
    entry = (locked or {}).get(node.id)
    if entry is None or entry.key != manifest.key or entry.digest == manifest.digest:
        return None
    return (f"{node.name}: the {how} output {manifest.digest[:12]} differs from the locked {entry.digest[:12]} under "
            f"the same key {manifest.key[:16]}: an input changed outside the key, or the store or remote holds other "
            "bytes under it; refusing it (run `qbuild compile --update` to accept it)")


def _requeue(plan: Plan, nid: str, result: BuildResult, waiting: list[str]) -> None:
    """Forget a finished node's result so the scheduler evaluates it again (its entry is now a miss)."""
    result.manifests.pop(nid, None)
    for bucket in (result.cached, result.built):
        if nid in bucket:
            bucket.remove(nid)
    if nid not in waiting:
        waiting.append(nid)
        order = list(plan.nodes)
        waiting.sort(key=order.index)


def _closure(plan: Plan, only: set[str]) -> set[str]:
    out: set[str] = set()
    stack = list(only)
    while stack:
        nid = stack.pop()
        if nid not in out:
            out.add(nid)
            stack.extend(plan.nodes[nid].deps.values())
    return out


def _dependents(plan: Plan, nid: str, candidates: list[str]) -> list[str]:
    out: list[str] = []
    frontier = {nid}
    changed = True
    while changed:
        changed = False
        for other in candidates:
            if other not in out and frontier & set(plan.nodes[other].deps.values()):
                out.append(other)
                frontier.add(other)
                changed = True
    return out


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
