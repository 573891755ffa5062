"""Running independent calls in a thread pool: transfers, HEAD requests, conversion steps (I/O, BLAKE3 and torch ops
release the GIL, so threads overlap)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
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


def run_grouped(groups: Sequence[tuple[int, Callable[[], Iterable[Callable[[], None]]]]], threads: int,
                budget: int) -> None:
    """Run groups of independent jobs on `threads` threads, holding at most `budget` of the groups' costs at once.

    A group is (cost, open): `open()` makes its jobs, and what they share (mapped inputs, say) lives until the last of
    them is done, when its cost is released. A thread takes the next job of the open groups, in the order opened;
    with none to take, it opens the first group, in the order given, that fits beside the open ones (a group opens
    alone whatever its cost). So memory-heavy groups never overlap past the budget, while the jobs of a group too big
    to share it still run side by side on every thread. Once a job or an `open` fails nothing further starts, and the
    first error is raised when the running jobs have finished."""
    if threads <= 1:
        for _, open_ in groups:
            for job in open_():
                job()
        return
    pool = _Groups(groups, budget)
    workers = [threading.Thread(target=pool.work, daemon=True) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if pool.error is not None:
        raise pool.error


class _Groups:
    """run_grouped's shared state: the groups not yet open, the jobs of the open ones, the cost they hold."""

    def __init__(self, groups: Sequence[tuple[int, Callable[[], Iterable[Callable[[], None]]]]], budget: int):
        self.pending = list(groups)
        self.ready: deque[tuple[list[int], Callable[[], None]]] = deque()   # ([cost, jobs left], job)
        self.budget, self.used, self.opening = budget, 0, 0
        self.error: BaseException | None = None
        self.cond = threading.Condition()

    def work(self) -> None:
        while (taken := self._take()) is not None:
            group, job = taken
            del taken
            try:
                job()
            except BaseException as e:
                self._fail(e)
            finally:
                del job
                with self.cond:
                    group[1] -= 1
                    if group[1] == 0:
                        self.used -= group[0]
                    self.cond.notify_all()

    def _take(self) -> tuple[list[int], Callable[[], None]] | None:
        """The next job; opens groups (outside the lock: opening maps inputs) until there is one or none is left."""
        while True:
            with self.cond:
                while True:
                    if self.error is not None:
                        return None
                    if self.ready:
                        return self.ready.popleft()
                    pick = next((i for i, (cost, _) in enumerate(self.pending)
                                 if self.used == 0 or self.used + cost <= self.budget), None)
                    if pick is not None:
                        cost, open_ = self.pending.pop(pick)
                        self.used += cost
                        self.opening += 1
                        break
                    if not self.pending and not self.opening:
                        return None
                    self.cond.wait()
            self._open(cost, open_)
            del open_

    def _open(self, cost: int, open_: Callable[[], Iterable[Callable[[], None]]]) -> None:
        try:
            jobs = list(open_())
        except BaseException as e:
            jobs = []
            self._fail(e)
        with self.cond:
            self.opening -= 1
            if jobs:
                group = [cost, len(jobs)]
                self.ready.extend((group, job) for job in jobs)
            else:
                self.used -= cost
            self.cond.notify_all()

    def _fail(self, e: BaseException) -> None:
        with self.cond:
            self.error = self.error or e
            self.cond.notify_all()
