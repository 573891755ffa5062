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
    assert "Contracts: 2 kept, 0 broken." in proc.stdout


def test_every_layer_package_says_what_it_may_import():
    for package in ("core", "store", "model", "recipe", "backends", "planning", "build"):
        doc = (REPO / "qbuild" / package / "__init__.py").read_text()
        assert "import" in doc.split('"""')[1], f"qbuild/{package}/__init__.py: its docstring names no import rule"
