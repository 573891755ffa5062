"""The local executor: a pool of worker processes on this machine.

Actions run in separate processes so a crash (or an out-of-memory kill) of one step cannot take the driver
down, and so heavy imports (torch) happen once per worker, never in the planning process. Workers die with the
driver: a `qbuild compile` killed by SIGKILL (which runs no cleanup) leaves no step running.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor

from ..job import Job, run_job
from ..plan import Node

PR_SET_PDEATHSIG = 1            # linux/prctl.h
PARENT_POLL_S = 0.5             # where there is no parent-death signal: how often a worker checks its parent


class LocalExecutor:
    def __init__(self, jobs: int):
        # spawn: workers start from a clean interpreter, never from a driver holding threads or locks, and are the
        # driver's own children, so they can die with it (a forkserver's workers hold the forkserver open).
        self._pool = ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=multiprocessing.get_context("spawn"),
                                         initializer=die_with_parent, initargs=(os.getpid(),))

    def submit(self, job: Job, node: Node) -> Future:
        return self._pool.submit(run_job, job)

    def capacity_check(self, node: Node) -> str | None:
        return None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def die_with_parent(parent: int) -> None:
    """End this process as soon as its parent, the driver of pid `parent`, ends: Linux delivers SIGKILL on the
    parent's death (prctl PR_SET_PDEATHSIG); elsewhere a thread polls for the parent. A worker whose driver died
    while it was starting exits here."""
    if os.getppid() != parent:
        os._exit(1)
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
            if os.getppid() != parent:   # the parent died before the signal was armed
                os._exit(1)
            return
    threading.Thread(target=_watch_parent, args=(parent,), name="qbuild-parent-watch", daemon=True).start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)
