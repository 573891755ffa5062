"""The recipes a lockfile holds, loaded from the files it records: what `lock update`, `report`, and the check of a
recipe changed since it was locked (qbuild.planning.drift) start from.

A recipe built with --backend is locked as `<name>@<backend>` and shares the recipe file (and model) of `<name>`;
loading it gives the recipe on that backend, under that name.
"""

from __future__ import annotations

from pathlib import Path

from qbuild.core.errors import UserError
from qbuild.recipe.schema import LoadedRecipe, load_recipe
from qbuild.store import lock as lockmod


def locked_recipe(doc: dict, lock_path: Path, name: str, backend: str | None = None) -> LoadedRecipe:
    """The locked recipe `name`, loaded from the file the lock records, on `backend` if given, else on the backend
    it was locked for. UserError naming the lockfile where that file is gone."""
    path = lockmod.recipe_file(doc["recipes"][name], lock_path)
    if not path.is_file():
        raise UserError(f"{lock_path}: recipe {name!r} was locked from {path}, which no longer exists")
    return load_recipe(path).with_backend(backend or name.partition("@")[2] or None)


def recipe_or_file(doc: dict, lock_path: Path, arg: str) -> LoadedRecipe:
    """The recipe a command-line argument names: a locked recipe (by name or file, as lock.resolve_recipe takes it),
    else a recipe file."""
    try:
        return locked_recipe(doc, lock_path, lockmod.resolve_recipe(doc, lock_path, arg))
    except UserError:
        if not Path(arg).is_file():
            raise
        return load_recipe(Path(arg))


def every_locked_recipe(doc: dict, lock_path: Path, backend: str | None = None) -> list[LoadedRecipe]:
    """Every recipe the lockfile holds (see locked_recipe), sorted by name; UserError where it holds none or one's
    file is gone."""
    if not doc["recipes"]:
        raise UserError(f"{lock_path}: the lockfile holds no recipe; name recipe files, or pass --all")
    return [locked_recipe(doc, lock_path, name, backend) for name in sorted(doc["recipes"])]


def gone_recipes(doc: dict, lock_path: Path) -> dict[str, Path]:
    """name -> recorded file, of each locked recipe whose file is no longer there."""
    files = {name: lockmod.recipe_file(entry, lock_path) for name, entry in sorted(doc["recipes"].items())}
    return {name: path for name, path in files.items() if not path.is_file()}
