"""`qbuild compile`: build what is not cached, on a local process pool or a Ray cluster, and lock what was built."""

from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from qbuild.cli.exits import err
from qbuild.cli.options import (AllOpt, BackendName, BackendOpt, JsonOpt, KeepOpt, LockOpt, ProgressMode,
                                ProgressOpt, RemoteOpt, StoreOpt, workspace)
from qbuild.core.errors import UserError
from qbuild.execution import executors

ExecutorName = Enum("ExecutorName", {name: name for name in executors.NAMES}, type=str)


def compile(ctx: typer.Context, recipes: list[str] = typer.Argument(None, help="recipe files"), all_: bool = AllOpt,
            jobs: Optional[int] = typer.Option(None, "-j", "--jobs", min=1,
                                               help="steps run at once (default: 1 locally, 256 in flight on Ray)"),
            mem: Optional[str] = typer.Option(None, "--mem", help="memory budget for concurrent steps, e.g. 20G"),
            keep_going: bool = typer.Option(False, "--keep-going", help="build what does not depend on a failure"),
            frozen: bool = typer.Option(False, "--frozen", help="fail instead of changing the lockfile (CI)"),
            update: bool = typer.Option(False, "--update",
                                        help="first resolve these recipes' Hub revisions again and move their pins "
                                             "(as `qbuild lock update`), then accept outputs (and a pinned commit's "
                                             "files) that differ from the lock's under its keys"),
            strict: bool = typer.Option(False, "--strict", help="fail, naming the step, instead of building anything"),
            push: bool = typer.Option(False, "--push", help="upload what was built (and anything the remote lacks)"),
            skip_device: bool = typer.Option(False, "--skip-device",
                                             help="leave steps that need a Neuron device (verifying a neuron bundle) "
                                                  "unbuilt on a host without one, instead of failing, and the "
                                                  "steps only they need (its reference)"),
            keep_intermediates: bool = KeepOpt, json_: bool = JsonOpt, store: Optional[Path] = StoreOpt,
            lock: Path = LockOpt,
            remote: Optional[str] = RemoteOpt, backend: Optional[BackendName] = BackendOpt,
            verbose: bool = typer.Option(False, "-v", "--verbose",
                                         help="also show what each step's libraries printed (warnings, progress)"),
            executor: ExecutorName = typer.Option(ExecutorName.local, "--executor",
                                                  help="where steps run: a local process pool, or a Ray cluster "
                                                       "(needs a remote; see docs/ray.md)"),
            address: Optional[str] = typer.Option(
                None, "--address", metavar="auto|HOST:PORT|ray://HOST:PORT", envvar="RAY_ADDRESS",
                help="Ray cluster for --executor ray [default: auto: the cluster `ray start` runs on this "
                     "machine]"),
            progress_mode: ProgressMode = ProgressOpt) -> None:
    """Build what is not cached: fetch, convert, shard, compile per bucket, package, reference, verify."""
    from qbuild.execution.engine import BuildOptions, raise_for
    from qbuild.render import BuildProgress, print_build_result, pushed_text, transfer_display
    from qbuild.core.units import parse_size

    if update and frozen:
        raise UserError("--update and --frozen: --update changes the lockfile's pins, --frozen forbids any change")
    explicit_budget = None if mem is None else parse_size(mem, "--mem", allow_zero=False)
    ws = workspace(store, lock, remote, push=push, backend=backend, transfers=transfer_display(progress_mode.value, "compile", bars=False))
    ws.keep_intermediates = keep_intermediates
    # $RAY_ADDRESS is meant for Ray: a local build ignores it; only an --address given here must go with Ray.
    source = ctx.get_parameter_source("address")
    address_given = source is not None and source.name == "COMMANDLINE"
    chosen = executors.choose(executor.value, jobs, address, address_given, ws)
    loaded = ws.load(recipes or [], all_)
    budget = explicit_budget if mem is not None else chosen.mem_budget
    options = BuildOptions(jobs=chosen.jobs, mem_budget=budget, keep_going=keep_going, strict=strict,
                           skip_device=skip_device,
                           mem_source=f"--mem {mem}" if mem is not None else "90% of this host's memory; --mem sets it")
    if update:
        from qbuild.render import print_pin_moves

        print_pin_moves(ws.update_pins(loaded), False, progress_mode.value)
    with BuildProgress(verbose=verbose, lock=lock, mode=progress_mode.value) as progress:
        the_plan, result, rebuilt = ws.compile(loaded, options, chosen.factory, progress.on_event, frozen=frozen,
                                               update=update, on_progress=progress.on_progress)
    extra = {}
    if push:
        pushed = ws.push(result)
        pushed_text(pushed, ws.store.remote.url, progress_mode.value)
        extra["pushed"] = pushed.to_json()
    if rebuilt is not None:
        extra["rebuilt_for_platform"] = rebuilt.to_json()
    print_build_result(the_plan, result, progress, json_, extra or None)
    if rebuilt is not None:
        err(rebuilt.line())
    raise_for(result, the_plan)
