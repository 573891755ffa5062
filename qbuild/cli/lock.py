"""`qbuild lock check` and `qbuild lock update`: the lockfile against the store, and its Hub pins moved."""

from pathlib import Path
from typing import Optional

import typer

from qbuild.cli.exits import err
from qbuild.cli.options import JsonOpt, LockOpt, StoreOpt, StrictOpt, name_a_changed_recipe, workspace
from qbuild.core import jsonio
from qbuild.core.errors import UserError

app = typer.Typer(no_args_is_help=True, help="Check the lockfile against the store; move its Hub pins.")


@app.command("check")
def lock_check(recipes: list[str] = typer.Argument(None, help="recipe names or files (default: every locked one)"),
               store: Optional[Path] = StoreOpt, lock: Path = LockOpt, json_: bool = JsonOpt,
               strict: bool = StrictOpt) -> None:
    """Verify that the lockfile agrees with itself, and that every artifact it names is in the store with the right
    digest; name each recipe whose file changed since it was locked."""
    from qbuild.planning.lock import resolve_recipe

    ws = workspace(store, lock)
    if not lock.exists():
        raise UserError(f"{lock}: no lockfile; run `qbuild compile` first")
    names = [resolve_recipe(ws.lock, lock, r) for r in recipes] if recipes else None
    changed = [note for name in (names or sorted(ws.lock.recipes))
               if (note := name_a_changed_recipe(ws, name, strict)) is not None]
    problems = ws.check_lock(names)
    if json_:
        print(jsonio.dumps({"ok": not problems, "problems": problems, "changed": changed}))
    for p in problems:
        err(p)
    if problems:
        raise typer.Exit(1)
    if not json_:
        err(f"{lock}: every locked artifact is in the store with the right digest")


@app.command("update")
def lock_update(recipes: list[str] = typer.Argument(None, help="recipe names or files (default: every locked one)"),
                lock: Path = LockOpt, json_: bool = JsonOpt) -> None:
    """Resolve the recipes' Hub revisions (branches, tags) again and move their pins; nothing else changes."""
    from qbuild.planning.lock import gone_recipes, locked_recipe, recipe_or_file
    from qbuild.render import print_pin_moves

    ws = workspace(None, lock)   # it plans nothing and opens no store: it only asks the Hub
    doc = ws.lock
    if recipes:
        loaded = [recipe_or_file(doc, lock, r) for r in recipes]
    else:
        if not doc.recipes:
            raise UserError(f"{lock}: no locked recipes; name the recipe files to pin")
        # A recipe whose file is gone keeps its pin (a name given on the command line is refused instead): one
        # deleted recipe must not stop the others' pins from moving.
        gone = gone_recipes(doc, lock)
        for name, path in gone.items():
            err(f"note: {name}: locked from {path}, which no longer exists; its pin stays as it is")
        if len(gone) == len(doc.recipes):
            raise UserError(f"{lock}: the file of every locked recipe is gone; name the recipe files to pin")
        loaded = [locked_recipe(doc, lock, name) for name in sorted(doc.recipes) if name not in gone]
    print_pin_moves(ws.update_pins(loaded), json_)
