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
