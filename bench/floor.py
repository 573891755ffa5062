"""The floor under any planning command: a typer command that reads a recipe into a one-field pydantic model (its
`model`) and prints it as a rich tree. These are the libraries `qbuild plan` loads to parse its flags, read a recipe
and show the plan; this program does nothing else, so no planner built on them can start faster.

    python bench/floor.py RECIPE.yaml
"""

import typer

app = typer.Typer(add_completion=False)


# --json is never read: it is there because typer prepares every option of a command, and plan has options.
@app.command()
def main(recipe: str, json_: bool = typer.Option(False, "--json")) -> None:
    import yaml
    from pydantic import BaseModel, ConfigDict
    from rich.console import Console
    from rich.tree import Tree

    class Recipe(BaseModel):
        model_config = ConfigDict(extra="ignore")
        model: dict

    with open(recipe) as f:
        doc = Recipe.model_validate(yaml.safe_load(f))
    Console().print(Tree(f"{recipe}: {sorted(doc.model)}"))


if __name__ == "__main__":
    app()
