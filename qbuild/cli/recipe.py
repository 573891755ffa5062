"""`qbuild recipe validate` and `qbuild recipe schema`: recipes checked, and the schema editors read."""

from pathlib import Path

import typer

from qbuild.cli.exits import err
from qbuild.cli.options import JsonOpt
from qbuild.core import jsonio
from qbuild.core.errors import QbuildError

app = typer.Typer(no_args_is_help=True, help="Validate recipes and print their schema.")


@app.command("validate")
def recipe_validate(files: list[Path] = typer.Argument(..., help="recipe files"), json_: bool = JsonOpt) -> None:
    """Validate recipes against the schema and against their model's architecture."""
    from qbuild import backends
    from qbuild.planning.plan import validate_recipe
    from qbuild.hub.source import load_arch
    from qbuild.recipe.schema import load_recipe

    results, failed = [], []
    for f in files:
        try:
            loaded = load_recipe(f)
            arch = load_arch(loaded)
            validate_recipe(loaded, arch, backends)
        except QbuildError as e:
            failed.append(e)
            results.append({"file": str(f), "ok": False, "error": str(e)})
            continue
        results.append({"file": str(f), "ok": True, "name": loaded.name, "family": arch.family})
        if not json_:
            err(f"{f}: ok")
    if json_:   # the document for every file, also when some are bad (then the exit code is theirs)
        print(jsonio.dumps({"ok": not failed, "recipes": results}))
    for e in failed:
        err(f"error: {e}")
    if failed:
        raise typer.Exit(max(e.exit_code for e in failed))


@app.command("schema")
def recipe_schema() -> None:
    """Print the recipe JSON Schema (for editors)."""
    from qbuild.backends import NAMES
    from qbuild.recipe.schema import recipe_json_schema

    print(jsonio.dumps(recipe_json_schema(NAMES), indent=1, sort_keys=True))
