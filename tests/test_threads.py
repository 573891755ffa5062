"""The one thread pool: results in item order, and after a failure nothing new starts; grouped jobs within a budget."""

from __future__ import annotations

import threading

import pytest

import qbuild.core.threads
from qbuild.core.threads import map_all, run_all, run_grouped


def test_results_come_back_in_item_order():
    assert map_all(lambda x: x * x, list(range(20)), 4) == [x * x for x in range(20)]
    assert map_all(lambda x: x + 1, [1, 2], 1) == [2, 3]


def test_after_the_first_failure_no_further_call_starts(monkeypatch):
    events: list[threading.Event] = []

    class Recorded(threading.Event):
        def __init__(self):
            super().__init__()
            events.append(self)

    # No public seam: only the pool's own "failed" flag orders item 1's end after item 0's failure (anything the
    # test could wait on instead leaves a window in which the pool may legitimately start item 2).
    monkeypatch.setattr(qbuild.core.threads.threading, "Event", Recorded)
    started: list[int] = []

    def fn(i: int) -> None:
        started.append(i)
        if i == 0:
            raise ValueError("boom")
        events[0].wait(5)   # the pool's "failed" flag: every other call runs until item 0 has failed

    with pytest.raises(ValueError, match="boom"):
        map_all(fn, list(range(50)), 2)
    assert set(started) <= {0, 1}


def test_run_all_runs_every_task():
    done: list[int] = []
    run_all([lambda i=i: done.append(i) for i in range(10)], 3)
    assert sorted(done) == list(range(10))


class Ledger:
    """Which groups are open (opened, some job not yet finished), and the most cost ever held at once."""

    def __init__(self, sizes: dict[str, tuple[int, int]]):
        self.sizes = sizes                       # name -> (cost, jobs)
        self.left: dict[str, int] = {}
        self.peak = 0
        self.done: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def group(self, name: str, job=None):
        cost, n = self.sizes[name]

        def open_():
            with self.lock:
                self.left[name] = n
                self.peak = max(self.peak, sum(self.sizes[g][0] for g in self.left))
            return [lambda k=k: self.finish(name, k, job) for k in range(n)]
        return cost, open_

    def finish(self, name: str, k: int, job) -> None:
        if job is not None:
            job(name, k)
        with self.lock:
            self.done.append((name, k))
            self.left[name] -= 1
            if not self.left[name]:
                del self.left[name]


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_grouped_jobs_all_run_and_never_hold_more_than_the_budget(threads):
    sizes = {"big": (10, 8), "also-big": (9, 3), "mid": (5, 4), **{f"small{i}": (1, 2) for i in range(6)}}
    ledger = Ledger(sizes)
    run_grouped([ledger.group(name) for name in sizes], threads, budget=15)
    assert sorted(ledger.done) == sorted((g, k) for g, (_, n) in sizes.items() for k in range(n))
    assert ledger.peak <= 15


def test_a_group_over_the_budget_runs_alone_and_its_jobs_side_by_side():
    both = threading.Barrier(2, timeout=30)    # passes only when two jobs of the one group run at once
    ledger = Ledger({"huge": (100, 2), "small": (1, 1)})
    run_grouped([ledger.group("huge", lambda g, k: both.wait()), ledger.group("small")], 2, budget=50)
    assert sorted(ledger.done) == [("huge", 0), ("huge", 1), ("small", 0)]
    assert ledger.peak == 100                 # the small group never opened beside it (101 > 50)


def test_a_failing_job_stops_further_groups_and_is_raised():
    ledger = Ledger({"a": (1, 1), "b": (1, 1), "c": (1, 1)})

    def boom(g, k):
        raise ValueError(f"bad {g}")
    with pytest.raises(ValueError, match="bad a"):
        run_grouped([ledger.group("a", boom), ledger.group("b"), ledger.group("c")], 2, budget=1)
    assert ledger.done == []                  # the budget holds one group at a time: b waited for a, which failed


def test_a_failing_open_is_raised():
    def open_():
        raise OSError("cannot map")
    with pytest.raises(OSError, match="cannot map"):
        run_grouped([(1, open_), (1, lambda: [])], 2, budget=5)
