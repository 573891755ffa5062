"""`qbuild plan` and `qbuild explain`: what would be built, and why a node would rebuild. Neither builds anything."""

from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from qbuild.cli.options import (AllOpt, BackendName, BackendOpt, JsonOpt, KeepOpt, LockOpt, RemoteOpt, StoreOpt,
                                workspace)
from qbuild.core.errors import UserError

PlanFormat = Enum("PlanFormat", {name: name for name in ("tree", "json", "dot", "mermaid")}, type=str)


def plan(recipes: list[str] = typer.Argument(None, help="recipe files"), all_: bool = AllOpt,
         fmt: Optional[PlanFormat] = typer.Option(None, "--format",
                                                  help="tree (default), json, or the DAG as Graphviz dot or Mermaid "
                                                       "text [default: tree]"),
         json_: bool = typer.Option(False, "--json", help="the same as --format json"),
         keep_intermediates: bool = KeepOpt, store: Optional[Path] = StoreOpt, lock: Path = LockOpt,
         remote: Optional[str] = RemoteOpt, backend: Optional[BackendName] = BackendOpt) -> None:
    """Show what would be built and why, as a tree per recipe (downloads nothing; a remote is only asked)."""
    from qbuild.render import print_plan

    if json_ and fmt not in (None, PlanFormat.json):
        raise UserError(f"--json and --format {fmt.value}: --json is --format json; give one of them")
    ws = workspace(store, lock, remote, backend=backend)
    ws.keep_intermediates = keep_intermediates
    the_plan, status = ws.plan(ws.load(recipes or [], all_))
    print_plan(the_plan, status, "json" if json_ else (fmt or PlanFormat.tree).value)


def explain(target: str = typer.Argument(..., help="a recipe file, or a node id (prefix) / name from `qbuild plan`"),
            recipes: list[str] = typer.Option(None, "--recipe", help="recipes to search for a node (default: --all)"),
            json_: bool = JsonOpt, store: Optional[Path] = StoreOpt, lock: Path = LockOpt,
            remote: Optional[str] = RemoteOpt, backend: Optional[BackendName] = BackendOpt) -> None:
    """Say why a node (or each node of a recipe) would rebuild: the key fields that changed, or "cached"."""
    ws = workspace(store, lock, remote, backend=backend)
    if target.endswith((".yaml", ".yml")) or Path(target).is_file():
        loaded = ws.load([target])
        the_plan, status = ws.plan(loaded)
        chosen = list(the_plan.recipes[loaded[0].name].nodes.values())
    else:
        the_plan, status = ws.plan(ws.load(recipes or [], all_=not recipes))
        chosen = [nid for nid, n in the_plan.nodes.items() if nid.startswith(target) or n.name == target
                  or (status[nid].key or "").startswith(target)]
        if not chosen:
            raise UserError(f"{target}: no node of the planned recipes has this id, key or name; see `qbuild plan`")
    from qbuild.render import print_explain

    print_explain(the_plan, status, ws.explain(the_plan, status), chosen, json_)
