"""The local executor: a pool of worker processes on this machine.

Actions run in separate processes so a crash (or an out-of-memory kill) of one step cannot take the driver down,
and so heavy imports (torch) happen once per worker, never in the planning process. Each worker is a fresh
interpreter (never a fork of a driver holding threads or locks) that reads jobs from one pipe and answers on another,
one job at a time; a thread of the driver feeds each worker. Before its answer, a worker sends on the same pipe the
progress its step reports (("progress", report) messages, throttled where they are measured: qbuild.core.progress),
which the feeding thread hands to the engine as they come.

The pool uses no multiprocessing objects: a multiprocessing queue or lock is a named POSIX semaphore, registered with
multiprocessing's resource tracker, which prints a "leaked semaphore" warning when the process that made it is
killed without cleanup (the pool of concurrent.futures makes five).

Workers die with the driver: the driver holds the only write end of each worker's job pipe, so when it exits (even
by SIGKILL, which runs no cleanup) the worker reads end-of-file and exits, also in the middle of a step.
"""

from __future__ import annotations

import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
from concurrent.futures import Future
from dataclasses import replace
from typing import BinaryIO, Callable

from qbuild import backends
from qbuild.execution.job import Job, run_job
from qbuild.core.errors import BuildError
from qbuild.core.progress import Tick, guarded
from qbuild.planning.dag import Node

_HEADER = struct.Struct(">Q")     # the length of the pickle that follows
_SERVE = "import sys; from qbuild.execution.executors.local import serve; serve(int(sys.argv[1]), int(sys.argv[2]))"
_PROGRESS = "progress"            # a worker's message carrying a Tick, before the job's answer


class WorkerLost(RuntimeError):
    """A worker process ended while it held a job (killed, out of memory, or crashed in native code)."""


class LocalExecutor:
    def __init__(self, jobs: int):
        self._jobs = max(1, jobs)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()     # (job, future) pairs; None stops a feeder
        self._feeders: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        self._waiting = 0    # jobs in the queue that no feeder has taken yet
        self._idle = 0       # feeders (and so workers) waiting for a job

    def submit(self, job: Job, node: Node, on_progress: Callable[[Tick], None] | None = None) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the local executor is shut down")
            self._queue.put((job, future, guarded(on_progress or _ignore)))
            self._waiting += 1
            # A worker starts only when every started one is busy, up to -j of them: each one imports torch (seconds
            # and hundreds of MiB), which a build of few steps at a time, such as most rebuilds, never needs twice.
            if self._waiting > self._idle and len(self._feeders) < self._jobs:
                feeder = threading.Thread(target=self._feed, name=f"qbuild-worker-{len(self._feeders)}", daemon=True)
                self._feeders.append(feeder)
                feeder.start()
        return future

    def capacity_check(self, node: Node) -> str | None:
        """A step that runs on devices runs here where the backend that asks for them finds them on this host."""
        if not node.needs_device:
            return None
        lacks = backends.get(node.backend).host_lacks(node.resources)
        return None if lacks is None else f"{node.name} {lacks}"

    def shutdown(self) -> None:
        """Cancel the jobs no worker has started, wait for the running ones, and end every worker."""
        with self._lock:
            self._closed = True
            feeders = list(self._feeders)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[1].cancel()
        for _ in feeders:
            self._queue.put(None)
        for feeder in feeders:
            feeder.join()

    def _take(self) -> tuple[Job, Future, Callable[[Tick], None]] | None:
        """The next job for an idle feeder, waiting for one (None: shut down); the feeder is busy from here on."""
        item = self._queue.get()
        with self._lock:
            self._idle -= 1
            if item is not None:
                self._waiting -= 1
        return item

    def _free(self) -> None:
        with self._lock:
            self._idle += 1

    def _feed(self) -> None:
        """One worker's thread: hand it the next job, wait for its answer, settle the job's future; start a new worker
        when the last one died."""
        worker: _Worker | None = None
        self._free()
        try:
            while (item := self._take()) is not None:
                job, future, on_progress = item
                if not future.set_running_or_notify_cancel():
                    self._free()
                    continue
                name = None
                try:
                    if worker is None or not worker.alive():
                        worker = _Worker()
                    name = _name(worker)
                    ok, value = worker.run(job, on_progress)
                except WorkerLost as e:
                    worker = None
                    ok, value = False, e
                except BaseException as e:   # the driver could not start a worker or read its answer
                    ok, value = False, e
                # Free before the engine hears the result: the step it submits next then goes to this worker.
                self._free()
                if ok:
                    future.set_result(replace(value, meta={**value.meta, "worker": name}))
                else:
                    value.worker = name   # a failed step's record names its worker too (engine.Event.worker)
                    future.set_exception(value)
        finally:
            if worker is not None:
                worker.close()


def _name(worker: _Worker) -> str:
    """Who runs a step, as the engine gets it among a built manifest's facts (meta, never in a key) or on a failure:
    `qbuild report` draws each step on its worker's lane."""
    return f"{threading.current_thread().name} (pid {worker.pid})"


class _Worker:
    """One worker process and the driver's ends of its two pipes."""

    def __init__(self) -> None:
        jobs_r, jobs_w = os.pipe()          # both ends are non-inheritable; the child gets its ends by pass_fds
        results_r, results_w = os.pipe()
        try:
            self._proc = subprocess.Popen([sys.executable, "-c", _SERVE, str(jobs_r), str(results_w)],
                                          pass_fds=(jobs_r, results_w), stdin=subprocess.DEVNULL)
        except BaseException:
            for fd in (jobs_r, jobs_w, results_r, results_w):
                os.close(fd)
            raise
        os.close(jobs_r)
        os.close(results_w)
        self._jobs = open(jobs_w, "wb")
        self._results = open(results_r, "rb")

    @property
    def pid(self) -> int:
        return self._proc.pid

    def alive(self) -> bool:
        return self._proc.poll() is None

    def run(self, job: Job, on_progress: Callable[[Tick], None]) -> tuple[bool, object]:
        """(True, the manifest) or (False, the exception the job raised); WorkerLost if the worker ended first. The
        progress the step reports meanwhile goes to `on_progress`."""
        try:
            _send(self._jobs, job)
            while True:
                message = _receive(self._results)
                if isinstance(message, tuple) and message[0] == _PROGRESS:
                    on_progress(message[1])
                    continue
                return message
        except (EOFError, BrokenPipeError):
            self.close()
            raise WorkerLost(f"{job.name}: its worker process ended ({_how_it_ended(self._proc.returncode)})") \
                from None

    def close(self) -> None:
        """Close the job pipe (the worker exits when it reads its end) and reap the process."""
        for f in (self._jobs, self._results):
            try:
                f.close()
            except OSError:
                pass
        self._proc.wait()


def _ignore(report: Tick) -> None:
    pass


def _how_it_ended(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by signal {-code}"
    return f"exit status {code}"


def _send(f: BinaryIO, obj: object) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(_HEADER.pack(len(data)) + data)
    f.flush()


def _receive(f: BinaryIO) -> object:
    """The next message on `f`: bytes the other end pickled a moment ago, never a file's. EOFError at the end."""
    header = f.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError
    (size,) = _HEADER.unpack(header)
    data = f.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


def serve(jobs_fd: int, results_fd: int) -> None:
    """A worker's main loop: run each job read from `jobs_fd` and answer (ok, manifest or exception) on
    `results_fd`. A thread reads the jobs, so that end-of-file (the driver is gone) ends the process at once."""
    # A step's own subprocesses must not hold these pipes: the driver would not see this worker end.
    os.set_inheritable(jobs_fd, False)
    os.set_inheritable(results_fd, False)
    jobs, results = open(jobs_fd, "rb"), open(results_fd, "wb")
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    sending = threading.Lock()     # a step's threads report progress while the main thread may answer

    def send(message: object) -> None:
        with sending:
            _send(results, message)

    def read() -> None:
        try:
            while True:
                inbox.put(_receive(jobs))
        except (EOFError, OSError):
            pass
        os._exit(0)

    threading.Thread(target=read, name="qbuild-jobs", daemon=True).start()
    try:
        while True:
            job: Job = inbox.get()
            try:
                reply: tuple[bool, object] = (True, run_job(job, lambda report: send((_PROGRESS, report))))
            except BaseException as e:   # an interrupted step too: the driver decides what the build does next
                reply = (False, e)
            try:
                send(reply)
            except (pickle.PicklingError, TypeError, AttributeError) as e:
                send((False, BuildError(f"{job.name}: {type(reply[1]).__name__}: {reply[1]} (its worker could not "
                                        f"send it back: {e})")))
    except KeyboardInterrupt:   # Ctrl-C between steps: the driver got it too and is shutting down
        os._exit(130)
