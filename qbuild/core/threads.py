"""Running independent calls in a thread pool: transfers, HEAD requests, conversion steps (I/O, BLAKE3 and torch ops
release the GIL, so threads overlap)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def map_all(fn: Callable[[T], R], items: Sequence[T], threads: int) -> list[R]:
    """[fn(item) for item in items], up to `threads` at a time. Once one call fails no further call starts, and the
    first error (in item order) is raised when the running ones have finished."""
    if threads <= 1 or len(items) <= 1:
        return [fn(item) for item in items]
    from concurrent.futures import ThreadPoolExecutor

    failed = threading.Event()

    def guarded(item: T) -> R | None:
        if failed.is_set():
            return None
        try:
            return fn(item)
        except BaseException:
            failed.set()
            raise

    with ThreadPoolExecutor(min(threads, len(items))) as pool:
        futures = [pool.submit(guarded, item) for item in items]
    return [f.result() for f in futures]


def run_all(tasks: Sequence[Callable[[], None]], threads: int) -> None:
    """Run independent tasks, `threads` at a time (see map_all)."""
    map_all(lambda task: task(), tasks, threads)


def run_bounded(tasks: Sequence[tuple[int, Callable[[], None]]], threads: int, budget: int) -> None:
    """Run independent (cost, task) pairs, `threads` at a time, while the costs of the running ones fit in `budget`:
    a waiting thread takes the first task, in the order given, that fits beside those running (a task runs alone
    when nothing else does, whatever its cost). So memory-heavy tasks never overlap past the budget while light ones
    fill the threads. Once one fails no further task starts, and the first error is raised when the running ones
    have finished."""
    if threads <= 1 or len(tasks) <= 1:
        for _, task in tasks:
            task()
        return
    pending = list(tasks)
    cond = threading.Condition()
    state: dict = {"used": 0, "error": None}

    def take() -> tuple[int, Callable[[], None]] | None:
        with cond:
            while pending and state["error"] is None:
                pick = next((i for i, (cost, _) in enumerate(pending)
                             if state["used"] == 0 or state["used"] + cost <= budget), None)
                if pick is not None:
                    state["used"] += pending[pick][0]
                    return pending.pop(pick)
                cond.wait()
            return None

    def worker() -> None:
        while (job := take()) is not None:
            cost, task = job
            try:
                task()
            except BaseException as e:
                with cond:
                    state["error"] = state["error"] or e
            finally:
                with cond:
                    state["used"] -= cost
                    cond.notify_all()

    workers = [threading.Thread(target=worker, daemon=True) for _ in range(min(threads, len(tasks)))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if state["error"] is not None:
        raise state["error"]
