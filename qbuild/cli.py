"""The qbuild command line: parse flags, call the library, render. stdout carries data; stderr the rest."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from .errors import QbuildError, UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Build, verify and publish compiled Qwen3.5 / Qwen3-Next artifacts from YAML recipes.")
recipe_app = typer.Typer(no_args_is_help=True, help="Validate recipes and print their schema.")
lock_app = typer.Typer(no_args_is_help=True, help="Check the lockfile against the store.")
store_app = typer.Typer(no_args_is_help=True, help="Inspect and repair the local store.")
app.add_typer(recipe_app, name="recipe")
app.add_typer(lock_app, name="lock")
app.add_typer(store_app, name="store")

StoreOpt = typer.Option(None, "--store", help="local store directory [default: $QBUILD_STORE or ~/.cache/qbuild/store]")
LockOpt = typer.Option(Path("artifacts.lock"), "--lock", help="lockfile path")
JsonOpt = typer.Option(False, "--json", help="machine-readable output on stdout")
AllOpt = typer.Option(False, "--all", help="every recipe in ./recipes")


def _workspace(store: Optional[Path], lock: Path):
    from .store import StoreSpec, default_store_path
    from .workspace import Workspace

    root = store or default_store_path()
    return Workspace(StoreSpec(local=str(root.resolve())), lock_path=lock)


def _err(msg: str) -> None:
    from .render import console_err

    console_err().print(msg, markup=False, highlight=False, soft_wrap=True)


# --- plan ------------------------------------------------------------------------------------------------------

@app.command()
def plan(recipes: list[str] = typer.Argument(None, help="recipe files"), all_: bool = AllOpt,
         json_: bool = JsonOpt, store: Optional[Path] = StoreOpt, lock: Path = LockOpt) -> None:
    """Show what would be built and why, as a tree per recipe (offline; downloads nothing)."""
    from .render import plan_json, plan_tree

    ws = _workspace(store, lock)
    the_plan, status = ws.plan(ws.load(recipes or [], all_))
    if json_:
        print(json.dumps(plan_json(the_plan, status), indent=1, sort_keys=True))
    else:
        plan_tree(the_plan, status)


# --- compile ---------------------------------------------------------------------------------------------------

@app.command()
def compile(recipes: list[str] = typer.Argument(None, help="recipe files"), all_: bool = AllOpt,
            jobs: int = typer.Option(1, "-j", "--jobs", min=1, help="steps run at once"),
            mem: Optional[str] = typer.Option(None, "--mem", help="memory budget for concurrent steps, e.g. 20G"),
            keep_going: bool = typer.Option(False, "--keep-going", help="build what does not depend on a failure"),
            frozen: bool = typer.Option(False, "--frozen", help="fail instead of changing the lockfile (CI)"),
            json_: bool = JsonOpt, store: Optional[Path] = StoreOpt, lock: Path = LockOpt) -> None:
    """Build what is not cached: fetch, convert, shard, compile per bucket, package, reference, verify."""
    from .engine import BuildOptions, check_mem_budget, raise_for
    from .executors.local import LocalExecutor
    from .render import BuildProgress, result_json

    ws = _workspace(store, lock)
    loaded = ws.load(recipes or [], all_)
    budget = check_mem_budget(mem) if mem else _default_mem()
    options = BuildOptions(jobs=jobs, mem_budget=budget, keep_going=keep_going)
    with BuildProgress() as progress:
        the_plan, result = ws.compile(loaded, options, lambda: LocalExecutor(jobs), progress.on_event, frozen=frozen)
    if json_:
        print(json.dumps(result_json(the_plan, result), indent=1, sort_keys=True))
    else:
        progress.summary(the_plan, result)
    raise_for(result, the_plan)


def _default_mem() -> int:
    """90% of physical memory: the budget concurrent steps share unless --mem says otherwise."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.9)


# --- explain ---------------------------------------------------------------------------------------------------

@app.command()
def explain(target: str = typer.Argument(..., help="a recipe file, or a node id (prefix) / name from `qbuild plan`"),
            recipes: list[str] = typer.Option(None, "--recipe", help="recipes to search for a node (default: --all)"),
            json_: bool = JsonOpt, store: Optional[Path] = StoreOpt, lock: Path = LockOpt) -> None:
    """Say why a node (or each node of a recipe) would rebuild: the key fields that changed, or "cached"."""
    ws = _workspace(store, lock)
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
    rows = [{"id": nid, "name": the_plan.nodes[nid].name, "status": status[nid].status, "why": status[nid].why}
            for nid in dict.fromkeys(chosen)]
    if json_:
        print(json.dumps(rows, indent=1))
        return
    for row in rows:
        print(f"{row['name']} [{row['id'][:8]}]: {row['why']}")


# --- lock, store, recipe ---------------------------------------------------------------------------------------

@lock_app.command("check")
def lock_check(recipes: list[str] = typer.Argument(None, help="recipe names (default: every locked recipe)"),
               store: Optional[Path] = StoreOpt, lock: Path = LockOpt, json_: bool = JsonOpt) -> None:
    """Verify that every artifact the lockfile names is in the store with the right digest."""
    ws = _workspace(store, lock)
    if not lock.exists():
        raise UserError(f"{lock}: no lockfile; run `qbuild compile` first")
    problems = ws.check_lock(recipes or None)
    if json_:
        print(json.dumps({"ok": not problems, "problems": problems}))
    for p in problems:
        _err(p)
    if problems:
        raise typer.Exit(1)
    if not json_:
        _err(f"{lock}: every locked artifact is in the store with the right digest")


@store_app.command("verify")
def store_verify(repair: bool = typer.Option(False, "--repair", help="drop corrupt entries and orphaned staging"),
                 store: Optional[Path] = StoreOpt, json_: bool = JsonOpt) -> None:
    """Check every blob's digest and every manifest; with --repair, remove what is broken so it gets rebuilt."""
    ws = _workspace(store, Path("artifacts.lock"))
    problems = ws.store.verify(repair=repair)
    if json_:
        print(json.dumps({"ok": not problems, "problems": problems, "repaired": repair}))
    for p in problems:
        _err(("repaired: " if repair else "") + p)
    if problems and not repair:
        raise typer.Exit(1)


@recipe_app.command("validate")
def recipe_validate(files: list[Path] = typer.Argument(..., help="recipe files")) -> None:
    """Validate recipes against the schema and against their model's architecture."""
    from .arch import load_arch, validate
    from .recipe import load_recipe

    for f in files:
        loaded = load_recipe(f)
        validate(loaded, load_arch(loaded))
        _err(f"{f}: ok")


@recipe_app.command("schema")
def recipe_schema() -> None:
    """Print the recipe JSON Schema (for editors)."""
    from .recipe import recipe_json_schema

    print(json.dumps(recipe_json_schema(), indent=1, sort_keys=True))


@app.command()
def tiny(family: str = typer.Argument(..., help="qwen3_5 | qwen3_5_moe | qwen3_next"),
         out: Path = typer.Argument(..., help="directory to write the checkpoint into"),
         seed: int = typer.Option(0, help="random seed"),
         fused_experts: bool = typer.Option(False, help="MoE experts in the fused 3D form")) -> None:
    """Write a tiny random checkpoint of a family (seeded, with a tokenizer) for tests and demos."""
    from .tinymodel import FAMILIES, write_tiny_checkpoint

    if family not in FAMILIES:
        raise UserError(f"family: {family!r} is not one of {', '.join(FAMILIES)}")
    write_tiny_checkpoint(out, family, seed=seed, fused_experts=fused_experts)
    _err(f"wrote a tiny {family} checkpoint to {out}")


def main() -> None:
    try:
        app(standalone_mode=False)
    except QbuildError as e:
        if os.environ.get("QBUILD_DEBUG"):
            raise
        _err(f"error: {e}")
        sys.exit(e.exit_code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        _err("aborted")
        sys.exit(130)
    except Exception as e:  # click usage errors
        import click

        if isinstance(e, click.exceptions.ClickException):
            e.show()
            sys.exit(2)
        raise


if __name__ == "__main__":
    main()
