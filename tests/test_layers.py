"""The layers of pyproject.toml's import-linter contracts hold: every import (lazy ones too) points down the layers,
and no package's modules import each other in a circle. Functions stay small: none is over MAX_FUNCTION_LINES."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAX_FUNCTION_LINES = 80    # from its `def` line to its last, docstring and comments included


def test_import_contracts_are_kept():
    lint = Path(sys.executable).parent / "lint-imports"
    proc = subprocess.run([str(lint), "--no-cache"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "Contracts: 3 kept, 0 broken." in proc.stdout


def test_every_layer_package_says_what_it_may_import():
    for package in ("core", "store", "model", "recipe", "hub", "backends", "planning", "execution", "report", "cli"):
        doc = (REPO / "qbuild" / package / "__init__.py").read_text()
        assert "import" in doc.split('"""')[1], f"qbuild/{package}/__init__.py: its docstring names no import rule"


def _long_functions(source: str, where: str) -> list[str]:
    """"<where>:<function> (<n> lines, from line <l>)" for each function (methods and nested ones too) in `source`
    longer than MAX_FUNCTION_LINES."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{where}:{node.name} ({length} lines, from line {node.lineno})")
    return found


def test_no_function_is_over_80_lines():
    found = []
    for path in sorted((REPO / "qbuild").rglob("*.py")):
        found += _long_functions(path.read_text(), str(path.relative_to(REPO)))
    assert found == []


def test_the_length_check_sees_a_long_function():
    def source(lines: int) -> str:   # a method `f` of `lines` lines inside a class, after a decorator
        body = "\n".join(f"        x{i} = {i}" for i in range(lines - 1))
        return f"class C:\n    @staticmethod\n    async def f():\n{body}\n"

    assert _long_functions(source(MAX_FUNCTION_LINES), "m.py") == []
    assert _long_functions(source(MAX_FUNCTION_LINES + 1), "m.py") == ["m.py:f (81 lines, from line 3)"]


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


def _layout_entries(layout: str) -> list[str]:
    """The layout block's entries: a line that starts at the margin and the indented lines under it."""
    entries: list[str] = []
    for line in layout.splitlines():
        if line and not line[0].isspace():
            entries.append(line)
        elif entries:
            entries[-1] += "\n" + line
    return entries


def test_the_readme_layout_names_every_module_in_its_package_entry():
    """Every module of every package is named (by its name, with or without .py) in the layout entry of its
    top-level package, beside its sub-package's name: a module added without a word on the map fails here."""
    import re

    entries = _layout_entries(_readme_layout())
    for path in sorted((REPO / "qbuild").rglob("*.py")):
        parts = path.relative_to(REPO / "qbuild").parts
        if len(parts) == 1 or path.name == "__init__.py":
            continue
        entry = next((e for e in entries if f"qbuild/{parts[0]}/" in e), None)
        assert entry is not None, f"README layout: no entry for qbuild/{parts[0]}/"
        for sub in parts[1:-1]:
            assert f"{sub}/" in entry, f"README layout: qbuild/{parts[0]}/'s entry names no {sub}/"
        stem = path.stem
        assert re.search(rf"(?<![\w/]){re.escape(stem)}(\.py)?(?!\w)", entry), \
            f"README layout: qbuild/{'/'.join(parts)} is not named in qbuild/{parts[0]}/'s entry"


def test_the_developer_guide_orders_the_layers_as_the_contracts_do():
    import re
    import tomllib

    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c["layers"] for c in contracts if c["type"] == "layers")
    guide = " ".join((REPO / "docs" / "developer-guide.md").read_text().split())
    stated = re.search(r"The layers, bottom to top: ([a-z, ]+)\.", guide)
    assert stated, "docs/developer-guide.md states no layer order"
    assert [name.strip() for name in stated[1].split(",")] == [m.removeprefix("qbuild.") for m in reversed(layers)]


def test_only_render_and_the_cli_print():
    """What the docs say of output (qbuild/render.py, docs/architecture.md): no module outside render and cli/ calls
    print or writes to sys.stdout / sys.stderr, but a child process qbuild runs (the SDK worker, the server of a neuron
    VL bundle), whose error line goes to the qbuild that runs it."""
    printers = set()
    for path in sorted((REPO / "qbuild").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            if name in ("print", "sys.stdout.write", "sys.stderr.write") or name.endswith("console().print") or \
                    name.endswith("console_err().print"):
                printers.add(path.relative_to(REPO / "qbuild").as_posix())
    outside = {p for p in printers if p != "render.py" and not p.startswith("cli/")}
    assert outside == {"backends/neuron/sdk_worker.py", "backends/neuron/vl_serve.py"}, sorted(outside)
    assert "render.py" in printers and "cli/exits.py" in printers
