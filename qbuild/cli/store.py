"""`qbuild gc` and `qbuild store verify`: the store's garbage collection, and its check and repair."""

from pathlib import Path
from typing import Optional

import typer

from qbuild.cli.exits import err
from qbuild.cli.options import JsonOpt, StoreOpt, workspace
from qbuild.core import jsonio

app = typer.Typer(no_args_is_help=True, help="Inspect and repair the local store.")


def gc_cmd(dry_run: bool = typer.Option(False, "--dry-run", help="print what would be removed; remove nothing"),
           keep_size: str = typer.Option("10G", "--keep-size", metavar="SIZE",
                                         help="unlocked entries and Neuron compile cache kept locally, most "
                                              "recently used first; the cache's budget also on the remote (e.g. 20G, "
                                              "0)"),
           grace: str = typer.Option("1h", "--grace", metavar="AGE",
                                     help="entries written this recently are kept, as is everything a running "
                                          "build holds (e.g. 30m, 2h, 0)"),
           remote: Optional[str] = typer.Option(None, "--remote", metavar="s3://BUCKET/PREFIX",
                                                help="also remove remote entries no given lockfile references "
                                                     "(only when passed here, never from config)"),
           locks: list[Path] = typer.Option(None, "--lock", help="lockfiles whose artifacts are kept (repeatable) "
                                                                 "[default: artifacts.lock]"),
           json_: bool = JsonOpt, store: Optional[Path] = StoreOpt) -> None:
    """Remove store entries no lockfile references (beyond --keep-size locally; all of them on --remote)."""
    from qbuild import backends
    from qbuild.core.units import parse_duration, parse_size
    from qbuild.planning.lock import referenced_keys
    from qbuild.render import print_gc
    from qbuild.store.spec import default_store_path
    from qbuild.store.gc import collect

    budget, grace_s = parse_size(keep_size, "--keep-size"), parse_duration(grace, "--grace")
    paths = locks or [Path("artifacts.lock")]
    reports = collect(store or default_store_path(), lambda: referenced_keys(paths), budget, dry_run=dry_run,
                      grace_s=grace_s, remote_url=remote, caches=backends.side_caches())
    print_gc(reports, ["local store", remote], json_)


@app.command("verify")
def store_verify(repair: bool = typer.Option(False, "--repair", help="drop corrupt entries, orphaned staging and "
                                                                     "incomplete compile cache entries"),
                 store: Optional[Path] = StoreOpt, json_: bool = JsonOpt) -> None:
    """Check every blob's digest and every manifest; with --repair, remove what is broken so it gets rebuilt."""
    from qbuild import backends

    ws = workspace(store, Path("artifacts.lock"))
    # The backends' side caches are checked here, not by LocalStore.verify, whose module every build step imports:
    # a cache's remote code (and boto3) stays out of their keys.
    problems = ws.store.local.verify(repair=repair)
    problems += [p for cache in backends.side_caches() for p in cache.verify(ws.store.local, repair)]
    if json_:
        print(jsonio.dumps({"ok": not problems, "problems": problems, "repaired": repair}))
    for p in problems:
        err(("repaired: " if repair else "") + p)
    if problems and not repair:
        raise typer.Exit(1)
