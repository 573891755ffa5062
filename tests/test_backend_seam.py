"""The backend seam: outside qbuild.backends nothing asks which backend it holds, and every import points down the
layers (core < store < model < recipe < hub < planning < backends < execution < cli, render), lazy imports included."""

from __future__ import annotations

import ast
from pathlib import Path

from qbuild import backends

ROOT = Path(__file__).resolve().parents[1] / "qbuild"
LAYERS = ("core", "store", "model", "recipe", "hub", "planning", "backends", "execution", "cli", "render")
# The seam (qbuild.backends, qbuild.backends.base) may be imported from anywhere above it; an implementation (every
# other module or package under qbuild/backends) only through qbuild.backends.get.
IMPLEMENTATIONS = {p.name.removesuffix(".py") for p in (ROOT / "backends").iterdir()} - {"base", "__init__",
                                                                                        "__pycache__"}


def _modules(under: Path = ROOT):
    for path in sorted(under.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _imports(tree: ast.AST):
    """(line, imported module) of every import statement, at any depth."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
            yield from ((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)


def _names_in(node: ast.AST) -> set[str]:
    """The backend names a comparison operand is or (a literal tuple, list or set) holds."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {i.value for i in items if isinstance(i, ast.Constant) and i.value in backends.NAMES}


def _backend_tests(tree: ast.AST):
    """(line, names) of each comparison that tells some backends from others: `x == "neuron"`, `"neuron" != x`,
    `x in ("inductor", "export")`, `case "neuron":`. A membership test of every name (validating one) tells none."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            names = set().union(*(_names_in(operand) for operand in [node.left, *node.comparators]))
            if names and names != set(backends.NAMES):
                yield node.lineno, names
        elif isinstance(node, ast.MatchValue) and _names_in(node.value):
            yield node.lineno, _names_in(node.value)


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "qbuild" or len(parts) < 2 or parts[1] not in LAYERS:
        return None
    return LAYERS.index(parts[1])


def test_no_module_outside_the_backends_tests_for_a_backend_or_imports_one():
    found = []
    for path, tree in _modules():
        rel = path.relative_to(ROOT.parent)
        if rel.parts[1] == "backends":
            continue
        found += [f"{rel}:{line}: compares with {sorted(names)}" for line, names in _backend_tests(tree)]
        found += [f"{rel}:{line}: imports {module}" for line, module in _imports(tree) if _implementation(module)]
    assert found == []


def _implementation(module: str) -> bool:
    parts = module.split(".")
    return parts[:2] == ["qbuild", "backends"] and len(parts) > 2 and parts[2] in IMPLEMENTATIONS


def test_the_check_sees_what_it_forbids():
    """The walk itself: each form of a backend test and of an implementation import is found."""
    code = ('if b == "neuron": pass\nif "export" != b: pass\nif b in ("inductor", "export"): pass\n'
            'if b not in ("neuron", "inductor", "export"): pass\n'
            'match b:\n    case "neuron": pass\n'
            'import qbuild.backends.neuron.config\nfrom qbuild.backends import neuron\n'
            'from qbuild.backends import get\n')
    tree = ast.parse(code)
    assert [line for line, _ in _backend_tests(tree)] == [1, 2, 3, 6]
    assert [m for _, m in _imports(tree) if _implementation(m)] == ["qbuild.backends.neuron.config",
                                                                    "qbuild.backends.neuron"]
    assert IMPLEMENTATIONS == {"cpu", "neuron"}


def test_every_import_points_down_the_layers():
    found = []
    for path, tree in _modules():
        rel = path.relative_to(ROOT.parent)
        here = _layer(".".join(rel.with_suffix("").parts))
        if here is None:
            continue
        for line, module in _imports(tree):
            there = _layer(module)
            if there is not None and there > here and not (LAYERS[here] in ("cli", "render")
                                                           and LAYERS[there] in ("cli", "render")):
                found.append(f"{rel}:{line}: {LAYERS[here]} imports {module}")
    assert found == []
