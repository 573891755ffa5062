"""Test-defined step kinds for the engine's tests: they record when they ran, so tests can check scheduling; and
`add`, which puts a node of one of them into a toy plan."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from qbuild.core.hashing import digest_json
from qbuild.planning.dag import Node
from qbuild.planning.step import Context, Step


def add(nodes: dict[str, Node], step: type[Step], name: str, params: dict, deps: dict[str, str] | None = None,
        out: int = 1, peak: int = 1, recipe: str = "toy", **fields) -> str:
    """The id of a node of `step` (its id made as the planner makes one), added to `nodes` unless there."""
    deps = deps or {}
    fields["resources"] = dict(fields.get("resources") or {})
    nid = digest_json({"kind": step.kind, "params": params, "deps": deps, "backend": None})[:16]
    node = nodes.setdefault(nid, Node(nid, step, name, params, deps, None, out, peak, **fields))
    if recipe not in node.recipes:
        node.recipes.append(recipe)
    return nid


def _record(ctx: Context, event: str) -> None:
    log = Path(ctx.params["log"])
    with open(log, "a") as f:
        f.write(json.dumps({"node": ctx.params["name"], "event": event, "t": time.time(), "pid": os.getpid()}) + "\n")


def sleep(ctx: Context) -> None:
    _record(ctx, "start")
    time.sleep(ctx.params.get("seconds", 0.2))
    inputs = sorted((ctx.inputs[n] / "value.txt").read_text() for n in ctx.inputs)
    (ctx.out / "value.txt").write_text(ctx.params["name"] + "(" + ",".join(inputs) + ")")
    _record(ctx, "end")


def fail(ctx: Context) -> None:
    _record(ctx, "start")
    raise RuntimeError(f"{ctx.params['name']} failed on purpose")


def die(ctx: Context) -> None:
    """The worker process running the step is killed, as the kernel's OOM killer would."""
    import signal

    _record(ctx, "start")
    os.kill(os.getpid(), signal.SIGKILL)


def rendezvous(ctx: Context) -> None:
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


def big(ctx: Context) -> None:
    """Writes more bytes than a small filesystem holds."""
    with open(ctx.out / "big.bin", "wb") as f:
        f.write(os.urandom(ctx.params["bytes"]))


def metered(ctx: Context) -> None:
    """Writes `bytes` bytes in 64 KiB pieces, counting each into the step's progress."""
    size, piece = ctx.params["bytes"], 64 << 10
    meter = ctx.progress.meter("write", "B", size)
    with open(ctx.out / "data.bin", "wb") as f:
        for start in range(0, size, piece):
            n = min(piece, size - start)
            f.write(ctx.params["name"].encode()[:1] * n)
            meter.advance(n)


class Sleep(Step):
    kind, params = "test-sleep", dict
    run = staticmethod(sleep)


class Fail(Step):
    kind, params = "test-fail", dict
    run = staticmethod(fail)


class Big(Step):
    kind, params = "test-big", dict
    run = staticmethod(big)


class Rendezvous(Step):
    kind, params = "test-rendezvous", dict
    run = staticmethod(rendezvous)


class Die(Step):
    kind, params = "test-die", dict
    run = staticmethod(die)


class Metered(Step):
    kind, params = "test-meter", dict
    run = staticmethod(metered)


class TimedMetered(Metered):
    timed = True


# kind -> step, for the tests that name their toy nodes' kinds
KINDS = {step.kind: step for step in (Sleep, Fail, Big, Rendezvous, Die, Metered)}
