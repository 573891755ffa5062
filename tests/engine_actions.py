"""Test-defined actions for the engine's tests: they record when they ran, so tests can check scheduling."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from qbuild.actions import ActionSpec, RunContext, register

SLEEP = register(ActionSpec("test-sleep", "tests.engine_actions:sleep", ("tests.engine_actions",)))
FAIL = register(ActionSpec("test-fail", "tests.engine_actions:fail", ("tests.engine_actions",)))


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


def read_log(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


BIG = register(ActionSpec("test-big", "tests.engine_actions:big", ("tests.engine_actions",)))


def big(ctx: RunContext) -> None:
    """Writes more bytes than a small filesystem holds."""
    with open(ctx.out / "big.bin", "wb") as f:
        f.write(os.urandom(ctx.params["bytes"]))
