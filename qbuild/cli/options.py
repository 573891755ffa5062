"""The options and arguments several commands share, and what they mean: the Workspace that --store, --lock, --remote
and --backend name, the check of a directory a command would fill, what --strict does to a recipe changed since it
was locked, and the bundle a TARGET argument of run, bench and serve names."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from qbuild.backends import NAMES as BACKEND_NAMES
from qbuild.cli.exits import err
from qbuild.core.errors import UserError

# Enums make click check the value and name the choices in --help and in its usage error.
BackendName = Enum("BackendName", {name: name for name in BACKEND_NAMES}, type=str)

StoreOpt = typer.Option(None, "--store", envvar="QBUILD_STORE",
                        help="local store directory [default: $XDG_CACHE_HOME/qbuild/store, or ~/.cache/qbuild/store]")
LockOpt = typer.Option(Path("artifacts.lock"), "--lock", help="lockfile path")
JsonOpt = typer.Option(False, "--json", help="machine-readable output on stdout")
AllOpt = typer.Option(False, "--all", help="every recipe in ./recipes")
BackendOpt = typer.Option(None, "--backend",
                          help="build on this backend instead of the recipe's (e.g. a CPU proof of a neuron recipe; "
                               "locked as <name>@<backend>)")
RemoteOpt = typer.Option(None, "--remote", metavar="s3://BUCKET/PREFIX", envvar="QBUILD_REMOTE",
                         help="remote store to read through [default: remote: in ./qbuild.yaml]")
AllowUnverifiedOpt = typer.Option(False, "--allow-unverified", help="use a locked bundle whose verify did not pass")
ProgressMode = Enum("ProgressMode", {name: name for name in ("auto", "plain", "json")}, type=str)
ProgressOpt = typer.Option(ProgressMode.auto, "--progress",
                           help="how progress shows on stderr: auto (live on a terminal, else plain), plain (lines, "
                                "at most one per running step every 30 s), json (one JSON event per line; "
                                "docs/progress.md)")
StrictOpt = typer.Option(False, "--strict",
                         help="refuse a locked recipe whose recipe file changed since it was locked (or whose change "
                              "cannot be told here) instead of naming the change")
KeepOpt = typer.Option(False, "--keep-intermediates",
                       help="also write out each recipe's converted (unsharded) weights into the store, for debugging; "
                            "a build otherwise only describes them (docs/bytes.md)")


def workspace(store: Optional[Path], lock: Path, remote: Optional[str] = None, push: bool = False,
              backend: Optional[BackendName] = None, transfers=None):
    """The command's Workspace; `transfers` (a render.TransferDisplay) shows what its remote-backed store moves."""
    from qbuild.store.spec import StoreSpec, default_store_path, resolve_remote
    from qbuild.execution.workspace import Workspace

    root = store or default_store_path()
    url = resolve_remote(remote)
    if push and url is None:
        raise UserError("--push needs a remote: pass --remote s3://bucket/prefix, set QBUILD_REMOTE, "
                        "or add remote: to ./qbuild.yaml")
    if url is not None:
        from qbuild.store.s3 import parse_remote

        parse_remote(url)  # a malformed URL is a one-line error before any work starts
    spec = StoreSpec(local=str(root.resolve()), remote=url, push=push)
    return Workspace(spec, lock_path=lock, backend=None if backend is None else backend.value, progress=transfers)


def check_new_dir(path: Path, what: str, if_not_empty: str | None) -> None:
    """Refuse, before any work, a directory a command would create or fill when it cannot be one: it or a parent is
    a file, or it already holds something (then `if_not_empty` says what to do; None allows it)."""
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"{path}: {what} would be under {parent}, which is not a directory")
            break
    if path.exists() and not path.is_dir():
        raise UserError(f"{path}: {what} exists and is not a directory")
    if if_not_empty is not None and path.is_dir() and any(path.iterdir()):
        raise UserError(f"{path}: {what} is not empty; {if_not_empty}")


def name_a_changed_recipe(ws, name: str, strict: bool, say: Callable[[str], None] | None = None) -> str | None:
    """Name, in a note on stderr (`say`, where given, writes it), how a locked recipe's file changed since it was
    locked, or that it is gone (qbuild.planning.drift), or with --strict refuse it; returns the note (None: unchanged,
    or a lockfile with none of its recipe files beside it, as a serving host holds it, which only --strict refuses)."""
    from qbuild.planning.drift import recipe_change

    change = recipe_change(ws.lock, ws.lock_path, name, ws.stat_cache, ws.backends, ws.steps)
    if change is None:
        return None
    if strict:
        raise UserError(f"{change.line()}; --strict refuses the locked one")
    if change.quiet:
        return None
    if say is None:
        err(f"note: {change.line()}")
    else:
        say(change.line())
    return change.line()


@contextmanager
def open_bundle(target: str, store: Optional[Path], lock: Path, remote: Optional[str], allow_unverified: bool,
                strict: bool, share: bool) -> Iterator:
    """The bundle a TARGET argument names (a qbuild.execution.transfer.OpenBundle): a bundle directory as it is, or a
    locked recipe's bundle laid out in a temporary directory for as long as the block runs, refused like `pull`
    refuses it (unverified, or with --strict a recipe changed since it was locked)."""
    from qbuild.execution.transfer import OpenBundle, open_locked_bundle

    if Path(target).is_dir():
        yield OpenBundle(Path(target), Path(target).resolve().name)
        return
    if not lock.exists():
        raise UserError(f"{target}: neither a bundle directory nor, without a lockfile ({lock}), a locked recipe")
    from qbuild.planning.lock import resolve_recipe

    ws = workspace(store, lock, remote)
    name_a_changed_recipe(ws, resolve_recipe(ws.lock, lock, target), strict)
    with open_locked_bundle(ws.store, ws.lock, lock, target, share=share,
                            allow_unverified=allow_unverified) as bundle:
        yield bundle
