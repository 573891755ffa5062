"""The local executor: a pool of worker processes on this machine.

Actions run in separate processes so a crash (or an out-of-memory kill) of one step cannot take the driver
down, and so heavy imports (torch) happen once per worker, never in the planning process. Workers die with the
driver: a `qbuild compile` killed by SIGKILL (which runs no cleanup) leaves no step running.
"""

from __future__ import annotations

import glob
import multiprocessing
import os
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor

from qbuild.build.job import Job, run_job
from qbuild.planning.plan import Node

DRIVER_POLL_S = 0.25     # how often a worker checks that its driver is alive


class LocalExecutor:
    def __init__(self, jobs: int):
        # forkserver: workers start from a clean interpreter, never from a driver holding threads or locks.
        self._pool = ProcessPoolExecutor(max_workers=max(1, jobs),
                                         mp_context=multiprocessing.get_context("forkserver"),
                                         initializer=watch_driver, initargs=(os.getpid(),))

    def submit(self, job: Job, node: Node) -> Future:
        return self._pool.submit(run_job, job)

    def capacity_check(self, node: Node) -> str | None:
        if node.needs_device and not neuron_devices():
            return (f"{node.name} runs on {node.neuron_cores} NeuronCores and this host has no Neuron device; "
                    "run it on a trn host, or pass --skip-device to leave it unbuilt")
        return None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def neuron_devices() -> list[str]:
    """The Neuron devices of this host (the driver's /dev/neuron<N> nodes)."""
    return sorted(glob.glob("/dev/neuron[0-9]*"))
def watch_driver(driver: int) -> None:
    """Worker initializer: exit as soon as the driver (process `driver`) is gone.

    A forkserver's workers are the forkserver's children, and each holds the pipe that would tell the forkserver
    the driver died, so neither a parent-death signal nor that pipe ends them: a thread watches the driver itself.
    """
    identity = _process_identity(driver)
    if identity is None:   # the driver died while this worker was starting
        os._exit(1)
    threading.Thread(target=_watch, args=(driver, identity), name="qbuild-driver-watch", daemon=True).start()


def _watch(driver: int, identity: str) -> None:
    while _process_identity(driver) == identity:
        time.sleep(DRIVER_POLL_S)
    os._exit(1)


def _process_identity(pid: int) -> str | None:
    """Something that stays the same while process `pid` lives and differs once it is gone: its start time on
    Linux (a reused pid starts later; a killed process awaiting its parent's wait is a zombie, state Z, and counts
    as gone), else just its existence. None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()   # the name before ")" may hold spaces
        return None if fields[0] == b"Z" else fields[19].decode()    # field 3 is the state, field 22 the start time
    except FileNotFoundError:
        return None
    except OSError:   # no /proc here
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return "alive"
