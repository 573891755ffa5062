"""Progress of long steps, its pure parts: the worker's throttle and meters, and the driver's line throttle, driven by
a fake clock (no sleeps); the duration a compile is measured against; and reports crossing the local pool's process
boundary before the step's result."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from qbuild.core.progress import LineThrottle, Meter, Tick, StepProgress, Throttle, elapsed
from qbuild.store.durations import Durations


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _meter(clock: FakeClock, total: float | None, unit: str = "B") -> tuple[Meter, list[Tick]]:
    reports: list[Tick] = []
    return Meter("download", unit, total, reports.append, clock), reports


# --- the worker's throttle ---------------------------------------------------------------------------------------

def test_a_meter_reports_at_most_every_half_second_and_one_percent_whichever_is_less_often():
    clock = FakeClock()
    meter, reports = _meter(clock, total=10_000)
    meter.advance(10)                      # the first measurement is reported
    clock.t += 5.0
    meter.advance(50)                      # 5 s later but only 0.5% more: held back
    clock.t += 0.1
    meter.advance(100)                     # 5.1 s and 1.5% since the last report: reported
    clock.t += 0.2
    meter.advance(200)                     # 2% more, but 0.2 s after the last report: held back
    clock.t += 0.3
    meter.advance(1)                       # 0.5 s and 2% since the last report: reported
    assert [r.done for r in reports] == [10, 160, 361]
    assert all(r.total == 10_000 and r.unit == "B" for r in reports)


def test_reaching_the_total_is_reported_at_once_and_close_adds_nothing_said_already():
    clock = FakeClock()
    meter, reports = _meter(clock, total=1000)
    meter.advance(400)
    meter.advance(600)                     # no time passed, but the work is done
    meter.close()
    meter.advance(5)                       # nothing after close
    assert [r.done for r in reports] == [400, 1000]


def test_close_reports_the_count_the_throttle_held_back():
    clock = FakeClock()
    meter, reports = _meter(clock, total=None)
    meter.advance(1)
    meter.advance(2)                       # held back: no time passed
    meter.close()
    assert [(r.done, r.total) for r in reports] == [(1, None), (3, None)]


def test_the_rate_is_bytes_per_second_since_the_meter_started_and_none_for_seconds():
    clock = FakeClock()
    meter, reports = _meter(clock, total=4096)
    clock.t += 2.0
    meter.advance(4096)
    assert reports[-1].rate == 2048.0
    timer, reports = _meter(clock, total=60.0, unit="s")
    clock.t += 2.0
    timer.set(2.0)
    assert reports[-1].rate is None and reports[-1].to_json() == {"what": "download", "done": 2, "total": 60,
                                                                  "unit": "s", "rate": None}


def test_an_unknown_total_is_reported_every_half_second():
    throttle = Throttle(clock := FakeClock())
    taken = []
    for step in range(8):
        clock.t += 0.25
        taken.append(throttle.take(step, None))
    assert taken == [True, False, True, False, True, False, True, False]


def test_store_transfers_become_one_meter_per_batch():
    """qbuild.store.remote.Progress, as a store reports its transfers, onto the step's meters."""
    clock = FakeClock()
    reports: list[Tick] = []
    transfers = StepProgress(reports.append, clock).transfers("cache ")
    transfers.begin("download", 2, 300)
    transfers.advance(100)
    transfers.file_done("a")
    transfers.advance(200)
    transfers.end()
    transfers.begin("upload", 0, 0)          # an empty batch reports nothing
    transfers.advance(0)
    transfers.end()
    assert [(r.what, r.done, r.total) for r in reports] == [("cache download", 100, 300), ("cache download", 300, 300)]


def test_the_timer_reports_elapsed_seconds_against_the_expected_ones():
    clock = FakeClock()
    reports: list[Tick] = []
    progress = StepProgress(reports.append, clock)
    with elapsed(progress, "compile", 100.0, tick=60.0):
        clock.t += 50.0
    # First look at 0 s, last when the block ends (a tick in between, if any, saw the same 50 s).
    assert [(r.done, r.total, r.unit) for r in reports] == [(0, 100.0, "s"), (50.0, 100.0, "s")]


# --- the driver's lines without a terminal --------------------------------------------------------------------

def test_a_step_prints_no_progress_line_before_30_s_then_at_most_one_every_30_s():
    clock = FakeClock()
    lines = LineThrottle(clock, every=30.0)
    lines.started("shard")
    assert not lines.due("shard")
    clock.t += 29.9
    assert not lines.due("shard")
    clock.t += 0.1
    assert lines.due("shard")
    assert not lines.due("shard")
    lines.started("fetch")                 # another step counts from its own start
    clock.t += 30.0
    assert lines.due("shard") and lines.due("fetch")
    lines.ended("shard")
    lines.started("shard")                 # run again (an input was corrupt): counts from the new start
    assert not lines.due("shard")


def test_plain_progress_prints_a_line_per_step_only_when_due(capsys):
    from qbuild.execution.engine import Event
    from qbuild.planning.dag import Node
    from qbuild.render import BuildProgress
    from qbuild.steps.shard import Shard

    clock = FakeClock()
    node = Node(id="n1", step=Shard, name="shard tp2", params={}, deps={}, backend=None, est_out_bytes=1,
                est_peak_bytes=1)
    view = BuildProgress(mode="plain", clock=clock)
    view.on_event(Event("start", node))
    view.on_progress(node, Tick("write", 1 << 20, 4 << 20, "B", float(1 << 20)))
    clock.t += 31.0
    view.on_progress(node, Tick("write", 2 << 20, 4 << 20, "B", float(1 << 20)))
    clock.t += 1.0
    view.on_progress(node, Tick("write", 3 << 20, 4 << 20, "B", float(1 << 20)))
    assert capsys.readouterr().err.splitlines() == [
        "start  shard tp2", "  shard tp2: write 2.0 MiB/4.0 MiB, 1.0 MiB/s, ETA 0:02"]


# --- what a compile is measured against -------------------------------------------------------------------------

def _stored(store_root: Path, key: str, kind: str, params: dict, seconds: float, mtime: float) -> None:
    from qbuild.store.local import LocalStore
    from qbuild.store.manifest import Manifest
    from qbuild.core.files import atomic_write

    path = LocalStore(store_root).manifest_path(key)
    atomic_write(path, Manifest(key=key, kind=kind, preimage={"action": kind, "params": params}, outputs={},
                                meta={"seconds": seconds}).to_bytes())
    os.utime(path, (mtime, mtime))


def test_a_compile_is_measured_against_the_last_one_of_its_params_else_of_its_architecture(tmp_path):
    from qbuild.store.local import LocalStore

    arch = {"hidden_size": 64, "num_layers": 2}
    cte32 = {"graph": "cte", "bucket": 32, "backend": "export", "text": arch}
    cte64 = {**cte32, "bucket": 64}
    other = {**cte32, "text": {**arch, "num_layers": 4}}
    _stored(tmp_path, "a" * 64, "compile", cte32, 12.5, mtime=100)
    _stored(tmp_path, "b" * 64, "compile", cte32, 20.0, mtime=200)     # the same params, built later
    _stored(tmp_path, "c" * 64, "compile", cte64, 40.0, mtime=300)     # the same architecture, another bucket
    _stored(tmp_path, "d" * 64, "compile", other, 99.0, mtime=400)     # another architecture
    _stored(tmp_path, "e" * 64, "shard", cte32, 7.0, mtime=500)        # another kind
    durations = Durations(LocalStore(tmp_path))
    assert durations.expected("compile", {"params": cte32}) == 20.0
    assert durations.expected("compile", {"params": {**cte32, "bucket": 128}}) == 40.0
    assert durations.expected("compile", {"params": {**cte32, "graph": "tkg"}}) is None
    assert durations.expected("compile", {"params": {**other, "text": {**arch, "num_layers": 8}}}) is None
    assert Durations(LocalStore(tmp_path / "empty")).expected("compile", {"params": cte32}) is None


# --- across the local pool's process boundary -------------------------------------------------------------------

def test_a_step_in_a_worker_process_reports_to_the_driver_before_its_result(tmp_path):
    """A timed test step, once built and then rebuilt after its output blob was lost: the second run is measured
    against the first's recorded duration; every report crosses the worker's pipe before the step's built event."""
    from qbuild.execution.engine import BuildOptions, build
    from qbuild.execution.executors.local import LocalExecutor
    from qbuild.planning.dag import Plan
    from qbuild.store.local import LocalStore
    from qbuild.store.spec import StoreSpec
    from tests.engine_actions import TimedMetered, add

    nodes: dict = {}
    nid = add(nodes, TimedMetered, "metered", {"name": "metered", "log": str(tmp_path / "log"), "bytes": 3 << 20})
    plan = Plan(nodes, {})
    root = tmp_path / "store"
    heard: list = []

    def run():
        heard.clear()
        return build(plan, LocalStore(root), StoreSpec(local=str(root)), lambda: LocalExecutor(1), BuildOptions(),
                     lambda e: heard.append(("event", e.kind)),
                     on_progress=lambda node, r: heard.append(("progress", node.id, r)))

    first = run()
    assert first.ok, first.failed
    bytes_reports = [h[2] for h in heard if h[0] == "progress" and h[2].unit == "B"]
    assert bytes_reports[-1].done == bytes_reports[-1].total == 3 << 20 and bytes_reports[-1].what == "write"
    assert all(h[1] == nid for h in heard if h[0] == "progress")
    assert heard.index(("event", "built")) > max(i for i, h in enumerate(heard) if h[0] == "progress")
    assert [h[2].total for h in heard if h[0] == "progress" and h[2].unit == "s"][0] is None   # nothing to compare

    manifest = first.manifests[nid]
    for out in manifest.outputs.values():            # the blob is lost: the step is built again
        LocalStore(root).blob_path(out["digest"]).unlink()
    second = run()
    assert second.ok and second.built == [nid]
    timed = [h[2] for h in heard if h[0] == "progress" and h[2].unit == "s"]
    assert timed and {r.total for r in timed} == {manifest.meta["seconds"]}


def test_a_report_that_cannot_be_delivered_fails_neither_the_step_nor_the_build(tmp_path):
    from qbuild.execution.engine import BuildOptions, build
    from qbuild.execution.executors.local import LocalExecutor
    from qbuild.planning.dag import Plan
    from qbuild.store.local import LocalStore
    from qbuild.store.spec import StoreSpec
    from tests.engine_actions import Metered, add

    def broken(*args) -> None:
        raise BrokenPipeError("the display went away")

    meter = StepProgress(broken, FakeClock()).meter("write", "B", 10)
    meter.advance(10)                      # the worker's side: the report is dropped
    meter.close()

    nodes: dict = {}
    add(nodes, Metered, "metered", {"name": "metered", "bytes": 1 << 20})
    root = tmp_path / "store"
    result = build(Plan(nodes, {}), LocalStore(root), StoreSpec(local=str(root)), lambda: LocalExecutor(1),
                   BuildOptions(), on_progress=broken)   # the driver's side
    assert result.ok and len(result.built) == 1, result.failed
