"""Progress of long steps: how much of a step's work is done, measured where the work happens and carried to the
driver as plain data (docs/progress.md).

A step measures with a Meter: bytes (unit "B") of a download, an upload or the shards written, or seconds (unit "s")
of a compile against how long the last one took. A meter reports through a Throttle, so feeding it stays cheap however
often it is fed (every network chunk, every tensor): at most every MIN_INTERVAL_S and every MIN_FRACTION of the total,
whichever is less often, besides its first report and the one where the work is done. A report is a Tick, plain
data that pickles, so it crosses the local pool's pipe and Ray alike; the driver renders it (qbuild.render).

A step never imports this module (it gets its StepProgress as `ctx.progress`), so nothing here is in a key: how
progress is measured or shown never rebuilds anything.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Literal

Unit = Literal["B", "s"]
Clock = Callable[[], float]

MIN_INTERVAL_S = 0.5      # a meter reports at most this often ...
MIN_FRACTION = 0.01       # ... and only once this much more of its total is done (when the total is known)
TICK_S = 1.0              # how often a step's timer looks at the clock when it knows how long the step should take
ELAPSED_ONLY_TICK_S = 10.0   # ... and when it does not (nothing to compare with: elapsed seconds only)
LINE_EVERY_S = 30.0       # without a terminal: at most one progress line per step this often


@dataclass(frozen=True)
class Tick:
    """One measurement of one thing a step does."""

    what: str                 # "download", "upload", "check", "write", "compile", "compile cache download", ...
    done: float               # bytes, or seconds elapsed
    total: float | None       # bytes in all, or seconds the last such step took; None: not known
    unit: Unit
    rate: float | None        # bytes per second since the meter started; None for seconds, or before any time passed

    def to_json(self) -> dict:
        return {"what": self.what, "done": _rounded(self.done), "total": _rounded(self.total), "unit": self.unit,
                "rate": _rounded(self.rate)}


def _rounded(x: float | None) -> float | None:
    """Whole numbers as integers (bytes), other numbers to the millisecond or byte per second."""
    if x is None or float(x).is_integer():
        return None if x is None else int(x)
    return round(x, 3)


Emit = Callable[[Tick], None]


def guarded(emit: Emit) -> Emit:
    """`emit`, dropping a report it fails to deliver (a pipe or an actor gone, a display that broke): progress never
    fails a step or a build."""
    def deliver(report: Tick) -> None:
        try:
            emit(report)
        except Exception:
            pass
    return deliver


class Throttle:
    """Decides which measurements become reports: the first; the one that reaches the total; and otherwise one only
    when both `interval` seconds and `fraction` of the total (if known) have passed since the last report."""

    def __init__(self, clock: Clock, interval: float = MIN_INTERVAL_S, fraction: float = MIN_FRACTION):
        self._clock, self._interval, self._fraction = clock, interval, fraction
        self._last: tuple[float, float] | None = None     # (when, done) of the last report

    def take(self, done: float, total: float | None) -> bool:
        """Whether `done` (of `total`) is reported now; a report taken counts from here."""
        now = self._clock()
        if self._last is not None and not self._due(now, done, total):
            return False
        self._last = (now, done)
        return True

    def _due(self, now: float, done: float, total: float | None) -> bool:
        when, last_done = self._last
        if total is not None and done >= total > last_done:
            return True
        if now - when < self._interval:
            return False
        return total is None or done - last_done >= self._fraction * total

    @property
    def last_done(self) -> float | None:
        return None if self._last is None else self._last[1]


class Meter:
    """Work done on one thing, reported through a Throttle to `emit`. Thread-safe: a transfer's threads feed it."""

    def __init__(self, what: str, unit: Unit, total: float | None, emit: Emit, clock: Clock):
        self.what, self.unit, self.total = what, unit, total
        self.done: float = 0
        self._emit, self._clock = emit, clock
        self._throttle = Throttle(clock)
        self._started = clock()
        self._lock = threading.Lock()
        self._closed = False

    def set_total(self, total: float | None) -> None:
        with self._lock:
            self.total = total

    def advance(self, n: float) -> None:
        with self._lock:
            self.done += n
            self._maybe_report()

    def set(self, done: float) -> None:
        with self._lock:
            self.done = done
            self._maybe_report()

    def close(self) -> None:
        """The last report, unless the last one taken already said as much; nothing is reported after it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._throttle.last_done != self.done:
                self._emit(self._report())

    def _maybe_report(self) -> None:
        if not self._closed and self._throttle.take(self.done, self.total):
            self._emit(self._report())

    def _report(self) -> Tick:
        took = self._clock() - self._started
        rate = self.done / took if self.unit == "B" and took > 0 else None
        return Tick(self.what, self.done, self.total, self.unit, rate)


class Transfers:
    """A store's batches of transfers as they report (qbuild.store.remote.Progress: begin, advance from its threads,
    file_done, end), one Meter per batch."""

    def __init__(self, progress: StepProgress, prefix: str = ""):
        self._progress, self._prefix = progress, prefix
        self._meter: Meter | None = None

    def begin(self, verb: str, files: int, total_bytes: int) -> None:
        self._meter = self._progress.meter(self._prefix + verb, "B", total_bytes) if files else None

    def advance(self, nbytes: int) -> None:
        meter = self._meter
        if meter is not None:
            meter.advance(nbytes)

    def file_done(self, name: str) -> None:
        pass

    def end(self) -> None:
        meter, self._meter = self._meter, None
        if meter is not None:
            meter.close()


class StepProgress:
    """What a running step reports to (`ctx.progress`): meters it opens itself, its store's transfers, its timer.
    Every meter still open when the step ends is closed then (qbuild.execution.job), so the driver hears each one's
    last count."""

    def __init__(self, emit: Emit, clock: Clock = time.monotonic):
        self._emit, self.clock = guarded(emit), clock
        self._meters: list[Meter] = []
        self._lock = threading.Lock()

    def meter(self, what: str, unit: Unit = "B", total: float | None = None) -> Meter:
        meter = Meter(what, unit, total, self._emit, self.clock)
        with self._lock:
            self._meters.append(meter)
        return meter

    def transfers(self, prefix: str = "") -> Transfers:
        return Transfers(self, prefix)

    def close(self) -> None:
        with self._lock:
            meters, self._meters = self._meters, []
        for meter in meters:
            meter.close()


def silent() -> StepProgress:
    """A StepProgress nobody listens to."""
    return StepProgress(lambda report: None)


@contextmanager
def elapsed(progress: StepProgress, what: str, expected: float | None, tick: float | None = None) -> Iterator[Meter]:
    """Report the seconds the block takes against `expected` (None: elapsed only), from a thread that looks at the
    clock every `tick` seconds (TICK_S, or ELAPSED_ONLY_TICK_S without `expected`); the meter's throttle decides
    which looks become reports."""
    tick = tick or (TICK_S if expected else ELAPSED_ONLY_TICK_S)
    meter = progress.meter(what, "s", expected)
    start = progress.clock()
    stop = threading.Event()

    def ticking() -> None:
        meter.set(0.0)
        while not stop.wait(tick):
            meter.set(progress.clock() - start)

    thread = threading.Thread(target=ticking, name="qbuild-progress-timer", daemon=True)
    thread.start()
    try:
        yield meter
    finally:
        stop.set()
        thread.join()
        meter.set(progress.clock() - start)
        meter.close()


class LineThrottle:
    """Without a terminal, one progress line per step at most every `every` seconds, counted from the step's start:
    a step shorter than that prints none."""

    def __init__(self, clock: Clock = time.monotonic, every: float = LINE_EVERY_S):
        self._clock, self._every = clock, every
        self._last: dict[str, float] = {}

    def started(self, step: str) -> None:
        self._last[step] = self._clock()

    def due(self, step: str) -> bool:
        now = self._clock()
        if now - self._last.setdefault(step, now) < self._every:
            return False
        self._last[step] = now
        return True

    def ended(self, step: str) -> None:
        self._last.pop(step, None)
