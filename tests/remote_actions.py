"""Test-defined actions for the remote-store tests, and a `qbuild` entry point that registers them.

`python -m tests.remote_actions ARGS` is the real CLI with every step after fetch replaced by a small action
here, so a recipe builds in about a second yet yields a multi-file bundle that depends on every upstream step.
The registration happens only in that process (and its workers read the entries from their jobs), never in the
pytest process, so other tests keep the real actions. Nothing here imports pytest: workers import this module.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

MODULE = "tests.remote_actions"
FAKE_KINDS = ("convert", "shard", "compile", "package", "reference", "verify")


def blob_bytes(seed: str, n: int) -> bytes:
    import blake3

    return blake3.blake3(seed.encode()).digest(length=n)


def _tree_seed(root: Path) -> str:
    from qbuild.core.hashing import digest_file

    return ",".join(f"{p.relative_to(root)}={digest_file(p)}" for p in sorted(root.rglob("*")) if p.is_file())


def _params_json(ctx) -> str:
    """The step's typed params (as the planner built them) in the canonical JSON its key holds."""
    from qbuild.core.hashing import canonical_json
    from qbuild.recipe.params import to_json

    return canonical_json(to_json(ctx.params)).decode()


def convert_action(ctx) -> None:
    import os

    # An input no key holds, for the tests of a step whose output changes under its locked key.
    seed = _tree_seed(ctx.inputs["snapshot"]) + _params_json(ctx) + os.environ.get("QBUILD_TEST_UNKEYED_INPUT", "")
    (ctx.out / "weights.safetensors").write_bytes(blob_bytes(seed, 96 << 10))
    (ctx.out / "config.json").write_text(json.dumps({"family": ctx.params.family}))


def shard_action(ctx) -> None:
    seed = _tree_seed(ctx.inputs["converted"])
    for rank in range(ctx.params.ranks.world):
        (ctx.out / f"tp{rank}_sharded_checkpoint.safetensors").write_bytes(blob_bytes(f"{seed}/{rank}", 64 << 10))


def compile_action(ctx) -> None:
    (ctx.out / "graph.pt2").write_bytes(blob_bytes(_params_json(ctx), 24 << 10))


def package_action(ctx) -> None:
    for name, src in sorted(ctx.inputs.items()):
        if name.startswith("compile:"):
            dst = ctx.out / "graphs" / f"{name.split(':', 1)[1]}.pt2"
            dst.parent.mkdir(exist_ok=True)
            shutil.copyfile(src / "graph.pt2", dst)
    for shard in sorted(ctx.inputs["shard"].iterdir()):
        (ctx.out / "weights").mkdir(exist_ok=True)
        shutil.copyfile(shard, ctx.out / "weights" / shard.name)
    shutil.copyfile(ctx.inputs["converted"] / "config.json", ctx.out / "config.json")
    (ctx.out / "neuron_config.json").write_text(_params_json(ctx))


def reference_action(ctx) -> None:
    (ctx.out / "reference.json").write_text(json.dumps({"seed": _tree_seed(ctx.inputs["snapshot"])}))


def verify_action(ctx) -> None:
    files = sorted(p.name for p in ctx.inputs["bundle"].rglob("*") if p.is_file())
    (ctx.out / "report.json").write_text(json.dumps({"ok": True, "files": files}))


def _fake(step):
    """A step kind planned as `step` is, run by this module's action of its kind."""
    action = globals()[f"{step.kind}_action"]
    return type(f"Fake{step.__name__}", (step,), {"run": staticmethod(action), "__module__": MODULE,
                                                   "__qualname__": f"Fake{step.__name__}", "reads_checkpoint": False, "data": ()})


def fake_steps() -> list:
    """The registry with every step kind after fetch run by this module's actions."""
    from qbuild.steps.registry import STEPS

    return [_fake(step) if step.kind in FAKE_KINDS else step for step in STEPS]


def register_fake_actions() -> None:
    import qbuild.execution.workspace
    from qbuild.steps import registry

    registry.STEPS[:] = FAKES
    # The projects here pair a real config with placeholder weights and no tokenizer, read only by the fake steps:
    # the check a real checkpoint gets before a build does not apply to them, and nothing public turns it off.
    qbuild.execution.workspace.check_source = lambda directory: None



# Made once, at import, so that a worker unpickling a job finds each class under the name it was pickled by.
FAKES = fake_steps()
for _step in FAKES:
    if _step.__module__ == MODULE:
        globals()[_step.__qualname__] = _step


if __name__ == "__main__":
    # The classes must be this module's under its import name (a worker imports them by it), not __main__'s.
    from tests.remote_actions import register_fake_actions as register

    register()
    from qbuild.cli import main

    main()
