"""The Ray executor: each node that must be built runs as one Ray task, on whichever cluster node fits it.

What runs where. The driver (the `qbuild compile` process) plans, schedules and writes the lockfile exactly
as with the local executor; the engine does not know which executor it drives. A Ray worker runs one step
(`build_job`) against a local cache of its own, reading inputs through the remote store and pushing the
result there (blobs first, manifest last) before the task returns. Driver and workers share no disk: the
remote store is the only shared state, so it is required.

Each task asks Ray for what its node declares: 1 CPU, `memory=node.est_peak_bytes`, and its devices as Ray custom
resources under the names its backend gives them (`node.resources`: a neuron verify asks for `neuron_cores`). Ray
queues a task until some node has that much free, so a node whose estimate exceeds every worker would wait forever;
`capacity_check` turns that into an error up front.

Progress. A task reports what its step measures (qbuild.core.progress) to a small actor of the driver's, the
ProgressInbox, with calls that do not wait for an answer; a thread of the driver takes what it holds every POLL_S, and
once more when a task ends, before its result is handed on, so the engine hears a step's last count before the step
is done. Progress is best-effort: an inbox that fails loses reports, never a build.

Failures. A worker lost mid-task (killed, out of memory, its host gone) is retried by Ray on a fresh worker
process, at most MAX_RETRIES times. Application errors are not retried, except InfraError (a remote or a
disk that failed us, which another attempt or another host may not hit). A killed attempt leaves at most
unreferenced blobs in the remote, never a manifest, so the store never shows half a result.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable

from qbuild.core.platform import host_tag
from qbuild.planning.keys import code_hash, toolchain_versions
from qbuild.core.errors import InfraError, QbuildError, UserError
from qbuild.core.progress import Tick, StepProgress, guarded, silent
from qbuild.execution.job import Job, build_job
from qbuild.planning.dag import Node
from qbuild.planning.closures import Sources
from qbuild.store.spec import StoreSpec, default_store_path
from qbuild.store.remote import open_store
from qbuild.store.manifest import Manifest
from qbuild.store.remote import RemoteStore, push_manifests, upload_blobs

MAX_RETRIES = 2
NODES_TTL_S = 5.0           # how long a snapshot of the cluster's nodes serves capacity checks
CONNECT_TIMEOUT_S = 10.0   # to reach the cluster's head before handing over to ray.init
DRIVER_THREADS = 4         # driver threads that seed inputs and read results back through the remote
GIB = 1 << 30
TASK_CPUS = 1              # every step runs on one core (its threads overlap I/O, not compute)
POLL_S = 0.5               # how often the driver takes the progress its tasks reported
INBOX_TIMEOUT_S = 10.0     # the longest the driver waits for the progress inbox to answer


# --- what a task asks for, and who could give it (pure; tested without a cluster) ------------------------------

@dataclass(frozen=True)
class TaskResources:
    num_cpus: int
    memory: int                                     # bytes, Ray's `memory` resource
    custom: dict[str, float] = field(default_factory=dict)

    def ray_options(self) -> dict:
        return {"num_cpus": self.num_cpus, "memory": self.memory, "resources": dict(self.custom)}


def task_resources(node: Node) -> TaskResources:
    """The Ray resources of one node's task, from the node's own estimates."""
    # Only the steps that run on devices (verifying a bundle on them) ask for them; a compile for them needs none.
    custom = {name: float(count) for name, count in node.resources.items() if count}
    return TaskResources(TASK_CPUS, node.est_peak_bytes, custom)


@dataclass(frozen=True)
class WorkerNode:
    """One alive Ray node, as capacity checks see it (its totals, not what is free right now)."""

    address: str
    node_id: str
    cpus: float
    memory: int
    custom: dict[str, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.address} ({self.node_id[:8]})"

    def fits(self, need: TaskResources) -> bool:
        return (self.cpus >= need.num_cpus and self.memory >= need.memory
                and all(self.custom.get(k, 0.0) >= v for k, v in need.custom.items()))


def workers_from_ray_nodes(nodes: list[dict]) -> list[WorkerNode]:
    """Alive nodes from `ray.nodes()` records."""
    out = []
    for n in nodes:
        if not n.get("Alive"):
            continue
        res = n.get("Resources", {})
        custom = {k: v for k, v in res.items() if k not in ("CPU", "memory", "object_store_memory", "GPU")
                  and not k.startswith("node:")}
        out.append(WorkerNode(n.get("NodeManagerAddress", "?"), n.get("NodeID", "?"), res.get("CPU", 0.0),
                              int(res.get("memory", 0)), custom))
    return out


def capacity_problem(node: Node, need: TaskResources, workers: list[WorkerNode]) -> str | None:
    """None if some alive node could ever run `node`'s task; else one line naming the node and the limit."""
    if any(w.fits(need) for w in workers):
        return None
    if not workers:
        return f"{node.name}: the Ray cluster has no alive node to run it on; start one with `ray start`"
    biggest = max(workers, key=lambda w: w.memory)
    if biggest.memory < need.memory:
        return (f"{node.name} needs ~{need.memory / GIB:.1f} GiB of memory, more than any Ray worker has: the "
                f"largest is {biggest.label} with {biggest.memory / GIB:.1f} GiB; add a bigger worker "
                "(`ray start --memory <bytes>` declares what a host may use)")
    if max(w.cpus for w in workers) < need.num_cpus:
        most = max(workers, key=lambda w: w.cpus)
        return (f"{node.name} needs {need.num_cpus} CPUs, more than any Ray worker has: the largest is "
                f"{most.label} with {most.cpus:g}")
    for res, amount in need.custom.items():
        if max(w.custom.get(res, 0.0) for w in workers) < amount:
            return (f"{node.name} needs {amount:g} {res} but no alive Ray worker declares that many; start device "
                    f"hosts with `ray start --resources '{{\"{res}\": <count>}}'`")
    return (f"{node.name} needs {need.num_cpus} CPU, ~{need.memory / GIB:.1f} GiB and {need.custom or 'no devices'} "
            "at once, and no single Ray worker has all of them")


def require_remote(spec: StoreSpec) -> None:
    """Ray workers share no disk with the driver: results travel only through the remote store."""
    if not spec.remote:
        raise UserError("--executor ray needs a remote store: pass --remote s3://bucket/prefix, set QBUILD_REMOTE, "
                        "or add remote: to ./qbuild.yaml (Ray workers share no disk with this machine; the remote is "
                        "where they read inputs and put results)")


# --- the worker's side -----------------------------------------------------------------------------------------

def worker_spec(driver: StoreSpec, local: str) -> StoreSpec:
    """The store a worker builds into: its own local cache, the driver's remote, and always a push."""
    return StoreSpec(local=local, remote=driver.remote, push=True)


def run_task(job: Job, inbox=None) -> dict:
    """The body of every Ray task: check this worker computes the same key, build (the store downloads and checks
    the inputs as it lays them out), publish.

    `inbox` is the driver's ProgressInbox (None: nobody listens). Returns the manifest as JSON; by then the remote
    holds its blobs and, last, the manifest itself.
    """
    # Who ran it is a fact of this run (meta, never in a key), on a failure too: `qbuild report` draws each step on
    # its worker's lane.
    worker = f"{socket.gethostname()} (pid {os.getpid()})"
    try:
        _check_same_code(job)
        spec = worker_spec(job.store_spec, str(default_store_path()))
        progress = silent() if inbox is None else StepProgress(lambda r: inbox.put.remote([(job.node_id, r)]))
        store = open_store(spec, progress.transfers())
        manifest = build_job(replace(job, store_spec=spec), store, progress)
        # A key this worker had cached locally is not pushed by build_job; the remote must hold it all the same.
        push_manifests(store.local, store.remote, [manifest], store.progress)
        if inbox is not None:
            _flush(inbox)
    except Exception as e:
        e.worker = worker     # travels with the exception (its __dict__ pickles) to the driver
        raise
    return replace(manifest, meta={**manifest.meta, "worker": worker}).to_json()


def _flush(inbox) -> None:
    """Wait until the inbox holds every report this task sent: an actor runs one caller's calls in the order they
    were made, so an answered call is behind all of them."""
    import ray

    try:
        ray.get(inbox.put.remote([]), timeout=INBOX_TIMEOUT_S)
    except Exception:   # best-effort: a lost report never fails the step
        pass


class ProgressInbox:
    """A Ray actor holding what running tasks reported, (node id, Tick) pairs, until the driver takes them."""

    def __init__(self) -> None:
        self._reports: list[tuple[str, Tick]] = []

    def put(self, reports: list[tuple[str, Tick]]) -> None:
        self._reports.extend(reports)

    def take(self) -> list[tuple[str, Tick]]:
        reports, self._reports = self._reports, []
        return reports


def _check_same_code(job: Job) -> None:
    """A worker whose step code, toolchain or (for a node that is not portable) platform differs from the driver's
    would file its output under a key that does not describe it; refuse rather than publish a wrong artifact."""
    differs = []
    wanted = job.preimage.get("platform")
    if wanted is not None and wanted != host_tag():
        differs.append(f"platform {host_tag()} (driver: {wanted})")
    # The code as it is now: a worker outlives many tasks and its checkout may change between them, and one Sources
    # sees one state of the tree.
    sources = Sources()
    ours = code_hash(job.step, job.code, sources)
    if ours != job.preimage.get("code_hash"):
        differs.append(f"{job.kind} step code {ours[:12]} (driver: {str(job.preimage.get('code_hash'))[:12]})")
    theirs, mine = job.preimage.get("toolchain", {}), toolchain_versions(job.step, job.code, sources)
    differs += [f"{d} {mine.get(d, 'absent')} (driver: {theirs.get(d, 'absent')})"
                for d in sorted(set(theirs) | set(mine)) if mine.get(d) != theirs.get(d)]
    if differs:
        raise InfraError(f"{job.name}: Ray worker {socket.gethostname()} is not set up like the driver: "
                         f"{'; '.join(differs)}; install the same qbuild and toolchain on every worker")


# --- the driver's side -----------------------------------------------------------------------------------------

def _import_ray():
    try:
        import ray
    except ImportError:
        raise UserError("--executor ray needs Ray on this machine: pip install 'qbuild[ray]'") from None
    return ray


class RayExecutor:
    """Submits jobs as Ray tasks to the cluster at `address` ("auto", "host:port" or "ray://host:port").

    submit() returns at once; a small thread pool does the slow parts off the engine's loop: making sure the
    remote holds the job's inputs (a driver-local cache hit may not be there yet), launching the task, and,
    once it finishes, reading its manifest through the driver's store (which checks it on the remote).
    """

    def __init__(self, store: RemoteStore, address: str = "auto"):
        address = address or "auto"          # never None: ray.init(None) would start a private local cluster
        ray = self._ray = _import_ray()
        self._owns_connection = not ray.is_initialized()
        if self._owns_connection:
            _check_reachable(address)
            _cluster_messages_to_stderr()
            try:
                # log_to_driver=False: stdout carries data only; a step's lines travel in its manifest.
                ray.init(address=address, log_to_driver=False, logging_level="WARNING", configure_logging=False)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise InfraError(f"cannot connect to the Ray cluster at {address}: {str(e).splitlines()[0]}; start "
                                 "one with `ray start --head` or pass --address") from None
        self._store = store
        self._task = ray.remote(max_retries=MAX_RETRIES, retry_exceptions=[InfraError])(run_task)
        self._pool = ThreadPoolExecutor(DRIVER_THREADS, thread_name_prefix="qbuild-ray")
        self._lock = threading.Lock()
        self._refs: dict = {}
        self._on_remote: set[str] = set()     # blob digests known to be on the remote
        self._nodes: tuple[float, list[WorkerNode]] = (float("-inf"), [])
        self._listeners: dict[str, Callable[[Tick], None]] = {}    # node id -> who hears its progress
        self._inbox = None                   # the ProgressInbox, made for the first step with a listener
        self._polling = threading.Event()    # set: stop polling
        self._poller: threading.Thread | None = None
        self._delivering = threading.Lock()

    def submit(self, job: Job, node: Node, on_progress: Callable[[Tick], None] | None = None) -> Future:
        out: Future = Future()
        inbox = None
        if on_progress is not None:
            with self._lock:
                self._listeners[job.node_id] = guarded(on_progress)
                inbox = self._progress_inbox()
        self._pool.submit(self._launch, job, node, out, inbox)
        return out

    def _progress_inbox(self):
        """The inbox of this build's progress, and the thread that polls it, started on first use (with the lock)."""
        if self._inbox is None:
            self._inbox = self._ray.remote(num_cpus=0)(ProgressInbox).remote()
            self._poller = threading.Thread(target=self._poll, name="qbuild-ray-progress", daemon=True)
            self._poller.start()
        return self._inbox

    def _poll(self) -> None:
        while not self._polling.wait(POLL_S):
            self._deliver()

    def _deliver(self) -> None:
        """Hand what the inbox holds to each step's listener, in the order the inbox got it."""
        if self._inbox is None:
            return
        with self._delivering:
            try:
                reports = self._ray.get(self._inbox.take.remote(), timeout=INBOX_TIMEOUT_S)
            except Exception:   # best-effort: progress never fails a build
                return
            for nid, report in reports:
                listener = self._listeners.get(nid)
                if listener is not None:
                    listener(report)

    def _launch(self, job: Job, node: Node, out: Future, inbox=None) -> None:
        try:
            self._seed_inputs(job)
            ref = self._task.options(name=f"qbuild {node.name}", **task_resources(node).ray_options()) \
                .remote(job, inbox)
        except Exception as e:
            out.set_exception(_translate(e, node.name))
            return
        with self._lock:
            self._refs[ref] = node
        ref.future().add_done_callback(lambda f: self._after(ref, f, job, node, out))

    def _after(self, ref, ray_future: Future, job: Job, node: Node, out: Future) -> None:
        with self._lock:
            self._refs.pop(ref, None)
        try:
            self._pool.submit(self._finish, ray_future, job, node, out)
        except RuntimeError:            # the pool is shut down: the build was abandoned
            out.cancel()

    def _finish(self, ray_future: Future, job: Job, node: Node, out: Future) -> None:
        self._deliver()    # the step's last reports before its result
        try:
            built = Manifest.from_json(ray_future.result())
            # Read it back through the driver's store: the remote must really hold it, blobs and manifest.
            manifest = self._store.get_manifest(job.key)
            if manifest is None or manifest.digest != built.digest:
                raise InfraError(f"{node.name}: the Ray worker reported key {job.key[:16]} built, but the remote "
                                 f"{self._store.remote.url} " + ("has no manifest for it" if manifest is None else
                                                             "holds a different output tree for it"))
            with self._lock:
                self._on_remote.update(meta["digest"] for meta in manifest.outputs.values())
            out.set_result(replace(manifest, meta=built.meta))
        except Exception as e:
            out.set_exception(_translate(e, node.name))

    def _seed_inputs(self, job: Job) -> None:
        """Upload input blobs the remote lacks (cached on this machine, never pushed) before a worker needs them,
        each checked against its digest as every push checks it."""
        with self._lock:
            wanted = {meta["digest"]: (rel, meta["size"]) for outputs in job.inputs.values()
                      for rel, meta in sorted(outputs.items()) if meta["digest"] not in self._on_remote}
        on_remote = self._store.remote.has_blobs(wanted)
        upload_blobs(self._store.local, self._store.remote, {d: v for d, v in wanted.items() if d not in on_remote})
        with self._lock:
            self._on_remote |= set(wanted)

    def capacity_check(self, node: Node) -> str | None:
        return capacity_problem(node, task_resources(node), self._workers())

    def _workers(self) -> list[WorkerNode]:
        taken, nodes = self._nodes
        if time.monotonic() - taken > NODES_TTL_S:
            nodes = workers_from_ray_nodes(self._ray.nodes())
            self._nodes = (time.monotonic(), nodes)
        return nodes

    def shutdown(self) -> None:
        # The engine waits for running steps before it stops; anything still here was abandoned (Ctrl-C).
        with self._lock:
            abandoned = list(self._refs)
            self._refs.clear()
        for ref in abandoned:
            self._ray.cancel(ref, force=True)
        self._pool.shutdown(wait=not abandoned, cancel_futures=True)
        self._polling.set()
        if self._poller is not None:
            self._poller.join()
            try:
                self._ray.kill(self._inbox)
            except Exception:   # the cluster went away: the actor with it
                pass
        if self._owns_connection:
            self._ray.shutdown()


def _check_reachable(address: str) -> None:
    """ray.init waits minutes for a cluster that is not there (or a stale `auto` address); fail fast instead."""
    from ray._private.services import canonicalize_bootstrap_address

    hint = "start one with `ray start --head`, or pass --address"
    if address and address.startswith("ray://"):
        hostport = address.removeprefix("ray://")
    else:
        try:
            hostport = canonicalize_bootstrap_address(address)
        except (ConnectionError, ValueError) as e:
            raise InfraError(f"--address {address}: {str(e).splitlines()[0]}; {hint}") from None
        if hostport is None:
            raise InfraError(f"--address {address}: no Ray cluster is running on this machine and $RAY_ADDRESS is "
                             f"unset; {hint}")
    host, _, port = hostport.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except (OSError, ValueError) as e:
        where = address if address == hostport else f"{address} ({hostport})"
        raise InfraError(f"cannot reach the Ray cluster at {where}: {getattr(e, 'strerror', None) or e}; {hint}") \
            from None


def _cluster_messages_to_stderr() -> None:
    """Ray's driver prints cluster messages (a worker died, a task will be retried) on stdout, even with
    log_to_driver=False; stdout carries data only (--json), so send them to stderr. Ray is pinned to 2.60."""
    import ray._private.worker as ray_worker

    original = ray_worker.print_to_stdstream
    if getattr(original, "qbuild_stderr", False):
        return

    def to_stderr(data, ignore_prefix: bool):
        return original({**data, "is_err": True}, ignore_prefix)

    to_stderr.qbuild_stderr = True
    ray_worker.print_to_stdstream = to_stderr


def _translate(e: BaseException, name: str) -> BaseException:
    """An exception from a task, or from launching it, as the one-line domain error the engine reports."""
    from ray.exceptions import RayError, RayTaskError, TaskCancelledError

    if isinstance(e, RayTaskError):
        e = e.cause
    if isinstance(e, QbuildError):
        return e
    first = (str(e).strip().splitlines() or [""])[0]
    if isinstance(e, TaskCancelledError):
        return InfraError(f"{name}: the Ray task was cancelled")
    if isinstance(e, RayError):   # the worker process or its node died, or was killed for memory
        return InfraError(f"{name}: the Ray worker was lost {MAX_RETRIES + 1} times ({type(e).__name__}: {first})")
    return InfraError(f"{name}: {type(e).__name__}: {first}")
