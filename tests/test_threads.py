"""The one thread pool: results in item order, and after a failure nothing new starts."""

from __future__ import annotations

import threading

import pytest

import qbuild.core.threads
from qbuild.core.threads import map_all, run_all


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
