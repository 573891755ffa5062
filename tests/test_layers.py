"""The layers of pyproject.toml's import-linter contracts hold: every import (lazy ones too) points down the layers,
and no package's modules import each other in a circle."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_import_contracts_are_kept():
    lint = Path(sys.executable).parent / "lint-imports"
    proc = subprocess.run([str(lint), "--no-cache"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "Contracts: 3 kept, 0 broken." in proc.stdout


def test_every_layer_package_says_what_it_may_import():
    for package in ("core", "store", "model", "recipe", "hub", "backends", "planning", "execution"):
        doc = (REPO / "qbuild" / package / "__init__.py").read_text()
        assert "import" in doc.split('"""')[1], f"qbuild/{package}/__init__.py: its docstring names no import rule"


def _readme_layout() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1]
    return section.split("```", 2)[1]


def test_the_readme_layout_names_every_package_module_and_doc():
    """The README's layout block is the map a newcomer reads: each package (its sub-packages too), each module at the
    top of qbuild/, and each document under docs/ must be on it."""
    layout = _readme_layout()
    for init in sorted((REPO / "qbuild").glob("*/**/__init__.py")):
        parts = init.parent.relative_to(REPO / "qbuild").parts
        assert f"qbuild/{parts[0]}/" in layout, f"README layout: no qbuild/{parts[0]}/"
        if len(parts) > 1:
            assert f"{parts[-1]}/" in layout, f"README layout: no {'/'.join(parts)}/"
    for module in sorted((REPO / "qbuild").glob("*.py")):
        if module.name != "__init__.py":
            assert module.name in layout, f"README layout: no qbuild/{module.name}"
    for doc in sorted((REPO / "docs").glob("*.md")):
        assert doc.name in layout, f"README layout: no docs/{doc.name}"
