"""The recipes the documents explain are the shipped ones: the README's commented example is recipes/2b-vl-tp8.yaml,
and the user guide's example of every field is recipes/35b-a3b-vl-tp8.yaml, field for field once loaded (base merged,
defaults filled in). A field renamed, a default changed or a shipped recipe edited shows here."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from qbuild.recipe.schema import load_recipe

REPO = Path(__file__).resolve().parent.parent


def yaml_blocks(text: str) -> list[str]:
    return [part.split("```", 1)[0] for part in text.split("```yaml\n")[1:]]


def loaded_as_shipped(block: str, tmp_path: Path) -> dict:
    """The block loaded as a file of recipes/ (so that its `extends: bases/...` finds the shipped base), without its
    name (a file's name is its recipe's)."""
    recipes = tmp_path / "recipes"
    shutil.copytree(REPO / "recipes" / "bases", recipes / "bases")
    (recipes / "example.yaml").write_text(block)
    return load_recipe(recipes / "example.yaml").recipe.model_dump(exclude={"name"})


@pytest.mark.parametrize("doc, section, shipped", [
    ("README.md", "\n## Recipes\n", "2b-vl-tp8.yaml"),
    ("docs/user-guide.md", "\n## Recipes\n", "35b-a3b-vl-tp8.yaml"),
])
def test_the_documented_example_is_the_shipped_recipe(tmp_path, doc, section, shipped):
    blocks = yaml_blocks((REPO / doc).read_text().split(section, 1)[1])
    assert blocks, f"{doc}: no yaml block under {section.strip()}"
    expected = load_recipe(REPO / "recipes" / shipped).recipe.model_dump(exclude={"name"})
    assert loaded_as_shipped(blocks[0], tmp_path) == expected
