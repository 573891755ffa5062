"""Test-defined actions for the engine's tests: they record when they ran, so tests can check scheduling."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from qbuild.execution.actions import RunContext
from qbuild.planning.keys import ActionSpec

SLEEP = ActionSpec("test-sleep", "tests.engine_actions:sleep")
FAIL = ActionSpec("test-fail", "tests.engine_actions:fail")
BIG = ActionSpec("test-big", "tests.engine_actions:big")
RENDEZVOUS = ActionSpec("test-rendezvous", "tests.engine_actions:rendezvous")
DIE = ActionSpec("test-die", "tests.engine_actions:die")
# What the engine's tests build with, passed to the engine: the production registry stays as shipped.
TEST_REGISTRY = {spec.kind: spec for spec in (SLEEP, FAIL, BIG, RENDEZVOUS, DIE)}


def _record(ctx: RunContext, event: str) -> None:
    log = Path(ctx.params["log"])
    with open(log, "a") as f:
        f.write(json.dumps({"node": ctx.params["name"], "event": event, "t": time.time(), "pid": os.getpid()}) + "\n")


def sleep(ctx: RunContext) -> None:
    _record(ctx, "start")
    time.sleep(ctx.params.get("seconds", 0.2))
    inputs = sorted((ctx.inputs[n] / "value.txt").read_text() for n in ctx.inputs)
    (ctx.out / "value.txt").write_text(ctx.params["name"] + "(" + ",".join(inputs) + ")")
    _record(ctx, "end")


def fail(ctx: RunContext) -> None:
    _record(ctx, "start")
    raise RuntimeError(f"{ctx.params['name']} failed on purpose")


def die(ctx: RunContext) -> None:
    """The worker process running the step is killed, as the kernel's OOM killer would."""
    import signal

    _record(ctx, "start")
    os.kill(os.getpid(), signal.SIGKILL)


def rendezvous(ctx: RunContext) -> None:
    """Arrive (a file named for this step), then wait for the partner step to arrive: it succeeds only when the two
    run at the same time, and fails once `timeout` seconds pass without the partner."""
    meeting, p = Path(ctx.params["dir"]), ctx.params
    (meeting / p["name"]).touch()
    deadline = time.monotonic() + p["timeout"]
    while not (meeting / p["partner"]).exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{p['name']}: {p['partner']} did not run at the same time (waited {p['timeout']} s)")
        time.sleep(0.01)
    (ctx.out / "value.txt").write_text(p["name"])


def read_log(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def big(ctx: RunContext) -> None:
    """Writes more bytes than a small filesystem holds."""
    with open(ctx.out / "big.bin", "wb") as f:
        f.write(os.urandom(ctx.params["bytes"]))


def metered(ctx: RunContext) -> None:
    """Writes `bytes` bytes in 64 KiB pieces, counting each into the step's progress."""
    size, piece = ctx.params["bytes"], 64 << 10
    meter = ctx.progress.meter("write", "B", size)
    with open(ctx.out / "data.bin", "wb") as f:
        for start in range(0, size, piece):
            n = min(piece, size - start)
            f.write(ctx.params["name"].encode()[:1] * n)
            meter.advance(n)
