"""`qbuild report`: one self-contained HTML page about a lockfile's or recipes' build (qbuild.report)."""

from pathlib import Path
from typing import Optional

import typer

from qbuild.cli.options import AllOpt, BackendName, BackendOpt, JsonOpt, LockOpt, RemoteOpt, StoreOpt, workspace
from qbuild.core.errors import UserError


def report(recipes: list[str] = typer.Argument(None, help="recipe files [default: every recipe of the lockfile]"),
           all_: bool = AllOpt,
           out: Path = typer.Option(Path(".qbuild/report.html"), "--out", help="the HTML file to write"),
           bench: list[Path] = typer.Option(None, "--bench", metavar="FILE",
                                            help="a `qbuild bench --json` (or --out) document to chart; repeatable"),
           serve: list[Path] = typer.Option(None, "--serve", metavar="FILE",
                                            help="requests to `qbuild serve` to show (a long prompt cold and warm, "
                                                 "an image chat): `demo/serve_client.py --out`; repeatable"),
           json_: bool = JsonOpt, store: Optional[Path] = StoreOpt, lock: Path = LockOpt,
           remote: Optional[str] = RemoteOpt, backend: Optional[BackendName] = BackendOpt) -> None:
    """Write one self-contained HTML page: the DAG with each node's status, key and size, the last build's
    timeline, the verify reports against their thresholds, TTFT / TPOT charts of bench results, and requests to
    `qbuild serve`."""
    from qbuild import report as reportmod
    from qbuild.planning.lock import every_locked_recipe
    from qbuild.render import report_written
    from qbuild.core.files import atomic_write

    benches = [reportmod.read_bench(f) for f in bench or []]   # a bad document is refused before any work
    serves = [reportmod.read_serve(f) for f in serve or []]
    if out.is_dir():
        raise UserError(f"--out {out}: is a directory; name the HTML file to write")
    ws = workspace(store, lock, remote, backend=backend)
    if recipes or all_:
        loaded = ws.load(recipes or [], all_)
    elif not lock.exists():
        raise UserError(f"{lock}: no lockfile; name recipe files, pass --all, or point --lock at a lockfile")
    else:
        loaded = every_locked_recipe(ws.lock, lock, ws.backend)
    the_plan, status = ws.plan(loaded)
    html, data, notes = reportmod.make(the_plan, status, ws.store, ws.lock, lock, benches, serves)
    atomic_write(out, html.encode())
    report_written(out, data.shown(), notes, json_)
