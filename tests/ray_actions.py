"""Test-defined step kinds for the Ray executor's tests (a module, not tests: pytest collects nothing here).

They run in Ray workers. Each records where it ran (pid, Ray node) in a JSON-lines log so a test can see which
process to kill and where a retry landed; the log is instrumentation only, never an input of the build.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from qbuild.planning.step import Context, Step

HANG_S = 120.0      # how long a first attempt of crash_once waits to be killed before giving up


def _record(ctx: Context, event: str) -> None:
    node = None
    try:
        import ray

        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except ImportError:
        pass
    line = json.dumps({"node": ctx.params["name"], "event": event, "pid": os.getpid(), "ray_node": node,
                       "store": os.environ.get("QBUILD_STORE"), "t": time.time()})
    with open(ctx.params["log"], "a") as f:
        f.write(line + "\n")


def _write_outputs(ctx: Context) -> None:
    """value.txt names the node and its inputs; data.bin is a deterministic blob big enough to matter."""
    inputs = sorted((ctx.inputs[n] / "value.txt").read_text() for n in ctx.inputs)
    (ctx.out / "value.txt").write_text(ctx.params["name"] + "(" + ",".join(inputs) + ")")
    seed = ctx.params["name"].encode()
    (ctx.out / "nested").mkdir()
    data = (seed * (256 * 1024 // len(seed) + 1))[:256 * 1024]
    meter = ctx.progress.meter("write", "B", len(data)) if ctx.progress is not None else None
    with open(ctx.out / "nested" / "data.bin", "wb") as f:
        for start in range(0, len(data), 64 * 1024):
            f.write(data[start:start + 64 * 1024])
            if meter is not None:
                meter.advance(len(data[start:start + 64 * 1024]))


def text(ctx: Context) -> None:
    _record(ctx, "start")
    time.sleep(ctx.params.get("seconds", 0.0))
    _write_outputs(ctx)
    _record(ctx, "end")


def crash_once(ctx: Context) -> None:
    """The first attempt announces itself (attempt file with its pid), then waits to be killed; later ones build."""
    marker = Path(ctx.params["marker"])
    if not marker.exists():
        _record(ctx, "first-attempt")
        tmp = marker.with_name(marker.name + ".tmp")
        tmp.write_text(str(os.getpid()))
        os.replace(tmp, marker)
        # Half of the outputs exist when the worker dies: nothing of them may become visible in the store.
        (ctx.out / "value.txt").write_text("half a result")
        time.sleep(HANG_S)
        raise RuntimeError("the first attempt was not killed in time")
    _record(ctx, "start")
    _write_outputs(ctx)
    _record(ctx, "end")


def fail(ctx: Context) -> None:
    _record(ctx, "start")
    raise RuntimeError(f"{ctx.params['name']} failed on purpose")


class Text(Step):
    kind, params = "ray-text", dict
    run = staticmethod(text)


class CrashOnce(Step):
    kind, params = "ray-crash-once", dict
    run = staticmethod(crash_once)


class Fail(Step):
    kind, params = "ray-fail", dict
    run = staticmethod(fail)


KINDS = {step.kind: step for step in (Text, CrashOnce, Fail)}
