"""Stops a build at one named point so a test can SIGKILL it exactly there (installed by tests/startup/sitecustomize.py).

QBUILD_CRASH_AT is "<action kind>:<phase>". A step of that kind that reaches the phase writes its key to the marker
file QBUILD_CRASH_MARKER and then waits to be killed, so every run of the test kills at the same point of the same
step whatever the machine's speed. Phases, in the order a step passes them:

    start      its inputs are materialized, the action has not run
    written    the action wrote its outputs into its staging directory, nothing is in the store yet
    ingested   its output blobs are in the store, its manifest is not
    committed  its manifest is in the store, the driver has not heard of it (the lockfile lacks it)
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Literal

Phase = Literal["start", "written", "ingested", "committed"]
PHASES: tuple[Phase, ...] = ("start", "written", "ingested", "committed")
ACTION_KINDS = ("fetch", "convert", "shard", "compile", "package", "reference", "verify")
HOLD_S = 600.0     # how long a stopped step waits for the kill before it gives up and the build goes on


# The points lie inside an action's run and the store's commit, where no public hook reaches: they are wrapped.
def install(point: str, marker: str, after_import) -> None:
    kind, phase = point.split(":")
    assert kind in ACTION_KINDS and phase in PHASES, point

    def stop(key: str) -> None:
        Path(marker + ".tmp").write_text(key)
        os.replace(marker + ".tmp", marker)   # the test never reads half a key
        time.sleep(HOLD_S)

    if phase in ("start", "written"):
        after_import(f"qbuild.steps.{kind}", lambda module: _wrap_step(module, kind, phase, stop))
    else:
        after_import("qbuild.store.local", lambda module: _wrap_commit(module.LocalStore, kind, phase, stop))


def _wrap_step(module, kind: str, phase: Phase, stop) -> None:
    """The step class of `kind` in its module (qbuild/steps/<kind>.py) stops at the phase around its run."""
    step = next(v for v in vars(module).values() if isinstance(v, type) and getattr(v, "kind", None) == kind)
    action = step.run

    def run(ctx) -> None:
        key = Path(ctx.out).parent.name.split(".")[0]   # the step's staging directory is <key>.<nonce>
        if phase == "start":
            stop(key)
        action(ctx)
        if phase == "written":
            stop(key)

    step.run = staticmethod(run)


def _wrap_commit(store_class, kind: str, phase: Phase, stop) -> None:
    """Only a step's worker commits its manifest, once its blobs are ingested."""
    commit = store_class.commit

    def stopping_commit(self, manifest) -> None:
        if manifest.kind == kind and phase == "ingested":
            stop(manifest.key)
        commit(self, manifest)
        if manifest.kind == kind and phase == "committed":
            stop(manifest.key)

    store_class.commit = stopping_commit
