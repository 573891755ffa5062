"""The local executor: a pool of worker processes on this machine.

Actions run in separate processes so a crash (or an out-of-memory kill) of one step cannot take the driver
down, and so heavy imports (torch) happen once per worker, never in the planning process.
"""

from __future__ import annotations

import glob
import multiprocessing
from concurrent.futures import Future, ProcessPoolExecutor

from ..job import Job, run_job
from ..plan import Node


class LocalExecutor:
    def __init__(self, jobs: int):
        # forkserver: workers start from a clean interpreter, never from a driver holding threads or locks.
        self._pool = ProcessPoolExecutor(max_workers=max(1, jobs),
                                         mp_context=multiprocessing.get_context("forkserver"))

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
