"""Executors run jobs: a local process pool here, a Ray cluster in qbuild.execution.executors.ray. `choose` picks one
for a build, with its number of jobs and its default memory budget; neither Ray nor the pool is imported until a
build asks for its executor."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from qbuild.core.errors import UserError

if TYPE_CHECKING:
    from qbuild.execution.engine import Executor
    from qbuild.execution.workspace import Workspace

NAMES = ("local", "ray")
RAY_JOBS = 256      # steps in flight on a Ray cluster by default; Ray queues them by their declared resources
HOST_MEMORY_SHARE = 0.9


@dataclass(frozen=True)
class ExecutorChoice:
    factory: Callable[[], Executor]     # the engine calls it when the first step is to run
    jobs: int
    mem_budget: int | None              # the default budget of concurrent steps; None: each step reserves its own


def choose(name: str, jobs: int | None, address: str | None, address_given: bool, ws: Workspace) -> ExecutorChoice:
    """The executor `name` (one of NAMES) for a build of `ws`: the local pool runs `jobs` (default 1) steps at once
    within 90% of this host's memory; a Ray cluster at `address` (default: auto) keeps `jobs` (default RAY_JOBS) in
    flight and needs a remote store. `address_given`: the address came from the command line, not $RAY_ADDRESS,
    which only Ray reads."""
    if name == "local":
        if address_given:
            raise UserError("--address: only used with --executor ray")
        from qbuild.execution.executors.local import LocalExecutor

        jobs = jobs or 1
        return ExecutorChoice(lambda: LocalExecutor(jobs), jobs, host_memory_budget())
    if name == "ray":
        from qbuild.execution.executors.ray import RayExecutor, require_remote

        require_remote(ws.store_spec)
        address = address or "auto"
        # No default budget: each Ray task reserves its own memory estimate on the worker that runs it.
        return ExecutorChoice(lambda: RayExecutor(ws.store, address), jobs or RAY_JOBS, None)
    raise AssertionError(f"executor {name!r}: not one of {NAMES}")


def host_memory_budget() -> int:
    """90% of physical memory: the budget concurrent local steps share unless the build sets one."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * HOST_MEMORY_SHARE)
