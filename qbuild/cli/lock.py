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
    from qbuild.store import lock as lockmod

    ws = workspace(store, lock)
    if not lock.exists():
        raise UserError(f"{lock}: no lockfile; run `qbuild compile` first")
    doc = lockmod.read(lock)
    names = [lockmod.resolve_recipe(doc, lock, r) for r in recipes] if recipes else None
    changed = [note for name in (names or sorted(doc["recipes"]))
               if (note := name_a_changed_recipe(ws, doc, lock, name, strict)) is not None]
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
    from qbuild.render import print_pin_moves
    from qbuild.recipe.schema import load_recipe
    from qbuild.store import lock as lockmod

    ws = workspace(None, lock)   # it plans nothing and opens no store: it only asks the Hub
    doc = lockmod.read(lock)
    if recipes:
        loaded = [_locked_or_file(doc, lock, r, load_recipe) for r in recipes]
    else:
        if not doc["recipes"]:
            raise UserError(f"{lock}: no locked recipes; name the recipe files to pin")
        # A recipe whose file is gone keeps its pin (a name given on the command line is refused instead): one
        # deleted recipe must not stop the others' pins from moving.
        present = [name for name in sorted(doc["recipes"]) if lockmod.recipe_file(doc["recipes"][name], lock).is_file()]
        for name in sorted(set(doc["recipes"]) - set(present)):
            err(f"note: {name}: locked from {lockmod.recipe_file(doc['recipes'][name], lock)}, which no longer "
                "exists; its pin stays as it is")
        if not present:
            raise UserError(f"{lock}: the file of every locked recipe is gone; name the recipe files to pin")
        loaded = [_locked_recipe(doc, lock, name, load_recipe) for name in present]
    print_pin_moves(ws.update_pins(loaded), json_)


def _locked_or_file(doc: dict, lock: Path, arg: str, load_recipe):
    """A recipe a command-line argument names: a locked recipe (by name or file), else a recipe file."""
    from qbuild.store import lock as lockmod

    try:
        return _locked_recipe(doc, lock, lockmod.resolve_recipe(doc, lock, arg), load_recipe)
    except UserError:
        if not Path(arg).is_file():
            raise
        return load_recipe(Path(arg))


def _locked_recipe(doc: dict, lock: Path, name: str, load_recipe):
    """A locked recipe, loaded from the file the lock records, under its locked name (`<name>@<backend>` for a build
    on another backend, which shares the recipe's model)."""
    from qbuild.store import lock as lockmod

    path = lockmod.recipe_file(doc["recipes"][name], lock)
    if not path.is_file():
        raise UserError(f"{lock}: recipe {name!r} was locked from {path}, which no longer exists")
    loaded = load_recipe(path)
    backend = name.partition("@")[2]
    return loaded.with_backend(backend) if backend else loaded
