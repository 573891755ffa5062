"""`qbuild compile`: build what is not cached, on a local process pool or a Ray cluster, and lock what was built."""

import os
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from qbuild.cli.exits import err
from qbuild.cli.options import (AllOpt, BackendName, BackendOpt, JsonOpt, KeepOpt, LockOpt, RemoteOpt, StoreOpt,
                                workspace)
from qbuild.core.errors import UserError

ExecutorName = Enum("ExecutorName", {name: name for name in ("local", "ray")}, type=str)


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
            keep_intermediates: bool = KeepOpt, json_: bool = JsonOpt, store: Optional[Path] = StoreOpt, lock: Path = LockOpt,
            remote: Optional[str] = RemoteOpt, backend: Optional[BackendName] = BackendOpt,
            verbose: bool = typer.Option(False, "-v", "--verbose",
                                         help="also show what each step's libraries printed (warnings, progress)"),
            executor: ExecutorName = typer.Option(ExecutorName.local, "--executor",
                                                  help="where steps run: a local process pool, or a Ray cluster "
                                                       "(needs a remote; see docs/ray.md)"),
            address: Optional[str] = typer.Option(
                None, "--address", metavar="auto|HOST:PORT|ray://HOST:PORT", envvar="RAY_ADDRESS",
                help="Ray cluster for --executor ray [default: auto: the cluster `ray start` runs on this "
                     "machine]")) -> None:
    """Build what is not cached: fetch, convert, shard, compile per bucket, package, reference, verify."""
    from qbuild.execution.engine import BuildOptions, raise_for
    from qbuild.render import BuildProgress, TransferDisplay, print_build_result
    from qbuild.core.units import parse_size

    if update and frozen:
        raise UserError("--update and --frozen: --update changes the lockfile's pins, --frozen forbids any change")
    explicit_budget = None if mem is None else parse_size(mem, "--mem", allow_zero=False)
    ws = workspace(store, lock, remote, push=push, backend=backend, transfers=TransferDisplay(bars=False))
    ws.keep_intermediates = keep_intermediates
    # $RAY_ADDRESS is meant for Ray: a local build ignores it; only an --address given here must go with Ray.
    source = ctx.get_parameter_source("address")
    address_given = source is not None and source.name == "COMMANDLINE"
    factory, jobs, default_mem = _executor(executor.value, address, address_given, jobs, ws)
    loaded = ws.load(recipes or [], all_)
    budget = explicit_budget if mem is not None else default_mem
    options = BuildOptions(jobs=jobs, mem_budget=budget, keep_going=keep_going, strict=strict,
                           skip_device=skip_device,
                           mem_source=f"--mem {mem}" if mem is not None else "90% of this host's memory; --mem sets it")
    if update:
        from qbuild.render import print_pin_moves

        print_pin_moves(ws.update_pins(loaded), False)
    with BuildProgress(verbose=verbose, lock=lock) as progress:
        the_plan, result, rebuilt = ws.compile(loaded, options, factory, progress.on_event, frozen=frozen,
                                               update=update)
    pushed = _push_results(ws, result) if push else None
    extra = {"pushed": pushed.to_json()} if pushed is not None else {}
    if rebuilt is not None:
        extra["rebuilt_for_platform"] = rebuilt.to_json()
    print_build_result(the_plan, result, progress, json_, extra or None)
    if rebuilt is not None:
        err(rebuilt.line())
    raise_for(result, the_plan)


RAY_JOBS = 256      # steps in flight on a Ray cluster by default; Ray queues them by their declared resources


def _executor(name: str, address: Optional[str], address_given: bool, jobs: Optional[int], ws):
    """(executor factory, jobs, default memory budget) for --executor. Ray is imported only when a step runs."""
    if name == "local":
        if address_given:
            raise UserError("--address: only used with --executor ray")
        from qbuild.execution.executors.local import LocalExecutor

        jobs = jobs or 1
        return (lambda: LocalExecutor(jobs)), jobs, _default_mem()
    if name == "ray":
        from qbuild.execution.executors.ray import RayExecutor, require_remote

        require_remote(ws.store_spec)
        address = address or "auto"
        # No default budget: each Ray task reserves its own memory estimate on the worker that runs it.
        return (lambda: RayExecutor(ws.store, address, ws.registry)), jobs or RAY_JOBS, None
    raise AssertionError(f"--executor {name}: click lets only the ExecutorName choices through")


def _push_results(ws, result):
    """After a --push build: everything the build produced or found must be on the remote (the workers pushed what
    they built; this uploads cached entries the remote lacks, and fails with exit 3 if the remote is gone)."""
    from qbuild.render import pushed_text
    from qbuild.store.remote import push_manifests

    store = ws.store
    report = push_manifests(store.local, store.remote, list(result.manifests.values()), store.progress)
    pushed_text(report, store.remote.url)
    return report


def _default_mem() -> int:
    """90% of physical memory: the budget concurrent steps share unless --mem says otherwise."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.9)
