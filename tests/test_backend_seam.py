"""The backend seam: outside qbuild.backends nothing asks which backend it holds, and every import points down the
layers (core < store < model < recipe < hub < planning < backends < execution < cli, render), lazy imports included."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from qbuild.steps.registry import STEPS
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
    assert IMPLEMENTATIONS == {"cpu", "neuron", "openai_server"}


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


# --- what sits below the backends names none of them ----------------------------------------------------------------

BELOW = ("store", "planning", "model")      # packages the backends build on, which must not know which backend is used
# An identifier naming the neuron backend or its formats (NxD, NEFF); "neuron" anywhere outside a docstring.
BACKEND_WORD = re.compile(r"neuron|nxd|neff", re.IGNORECASE)
NEURON = re.compile(r"neuron", re.IGNORECASE)


def _docstring_starts(tree: ast.AST) -> set[tuple[int, int]]:
    """(line, column) where each docstring of a module, class or function starts."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
                    isinstance(first.value.value, str):
                out.add((first.value.lineno, first.value.col_offset))
    return out


def backend_words(source: str) -> list[tuple[int, str]]:
    """(line, token) of each identifier naming neuron, NxD or NEFFs, and each comment or string (not a docstring)
    naming neuron."""
    docstrings = _docstring_starts(ast.parse(source))
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME and BACKEND_WORD.search(tok.string):
            found.append((tok.start[0], tok.string))
        elif tok.type in (tokenize.COMMENT, tokenize.STRING) and tok.start not in docstrings and \
                NEURON.search(tok.string):
            found.append((tok.start[0], tok.string))
    return found


def test_store_planning_and_model_name_no_backend_but_in_docstrings():
    """A docstring may name the neuron backend as an example; code, strings and comments of the layers below the
    backends may not name it, nor identifiers its formats (NxD's files, NEFFs): those belong to the backend."""
    found = []
    for package in BELOW:
        for path, _ in _modules(ROOT / package):
            found += [f"{path.relative_to(ROOT.parent)}:{line}: {word[:60]}"
                      for line, word in backend_words(path.read_text())]
    assert found == []


def test_the_backend_word_check_sees_what_it_forbids():
    source = ('"""A docstring may say neuron."""\n'
              'import qbuild.x.nxd\n'
              'neffs = 1  # a comment about Neuron\n'
              'def f(neuron_cores):\n    """neuron here is fine."""\n    return "neuron" + "NxDI layout"\n')
    assert [line for line, _ in backend_words(source)] == [2, 3, 3, 4, 6]


# --- what a node's key holds: the backend code it runs, and no more -------------------------------------------------

def _planned(tmp_path):
    """A CPU recipe and a neuron recipe of the same model, planned as a build plans them."""
    from qbuild.planning.plan import build_plan
    from tests.test_planner import COMMIT, NEURON as NEURON_RECIPE, FakeEnvironment, _cpu, _recipe

    env = FakeEnvironment(checkpoints={tmp_path / "ck": {"config.json": "blake3:1"}},
                          ports={tmp_path / "port": {"m.py": "blake3:9"}},
                          hub={("Qwen/Qwen3.5-2B", "main"): COMMIT})
    plan = build_plan([_cpu(tmp_path, "cpu"), _recipe(tmp_path, "nrn", NEURON_RECIPE)], env, backends=backends, steps=STEPS)
    return {name: {role: plan.nodes[nid] for role, nid in pr.nodes.items()} for name, pr in plan.recipes.items()}


def _closure(node) -> set[str]:
    from qbuild.planning.keys import closure

    return {name for name, _ in closure(node.step, node.code).modules}


def test_a_cpu_shard_is_keyed_on_no_neuron_code_and_a_neuron_shard_on_nxds_rules(tmp_path):
    """The layout comes through the backend registry: an edit of the NxD rules re-keys neuron shards alone."""
    nodes = _planned(tmp_path)
    cpu, neuron = _closure(nodes["cpu"]["shard"]), _closure(nodes["nrn"]["shard"])
    assert "qbuild.model.convert.shard" in cpu and not [m for m in cpu if m.startswith("qbuild.backends.neuron")]
    assert "qbuild.backends.neuron.layout.nxd" in neuron


def test_a_cpu_compile_package_or_verify_is_keyed_on_no_serving_code(tmp_path):
    """No build step serves: an edit of the server re-keys no compile (the registry keeps the servers apart)."""
    nodes = _planned(tmp_path)["cpu"]
    for role in ("compile cte-32", "package", "verify"):
        closure = _closure(nodes[role])
        assert "qbuild.backends.cpu.backend" in closure, role
        assert [m for m in closure if "serv" in m.rsplit(".", 1)[-1]] == [], role


# --- whose bundle it is --------------------------------------------------------------------------------------------

def _bundle(root: Path, backend: str, graphs: dict[str, str]) -> Path:
    from qbuild.model.bundle import write_manifest

    root.mkdir()
    for rel in graphs.values():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"graph")
    write_manifest(root, {"family": "qwen3_5", "backend": backend, "graphs": graphs})
    return root


def test_each_backend_recognises_its_own_bundles(tmp_path):
    from qbuild.core.errors import UserError
    from qbuild.model.bundle import read_manifest

    cpu = _bundle(tmp_path / "cpu", "export", {"cte-32": "graphs/cte-32.pt2"})
    neuron = _bundle(tmp_path / "neuron", "neuron", {"text": "model.pt"})
    assert backends.bundle_backend(cpu, read_manifest(cpu)).name == "export"
    assert backends.bundle_backend(neuron, read_manifest(neuron)).name == "neuron"
    # A bundle.json whose backend and layout disagree is no backend's.
    odd = _bundle(tmp_path / "odd", "inductor", {"text": "model.pt"})
    with pytest.raises(UserError, match="odd: not a bundle of any backend"):
        backends.bundle_backend(odd, read_manifest(odd))


def test_qbuild_run_asks_the_bundles_backend_for_its_runtime(tmp_path):
    """A neuron bundle is refused by its backend, and a bundle no backend recognises by the registry, each in one
    line (exit 2) before anything is loaded."""
    from tests.conftest import qbuild

    for bundle, why in [(_bundle(tmp_path / "neuron", "neuron", {"text": "model.pt"}),
                         "a neuron bundle runs on a Neuron host through NxDI, not on this runtime"),
                        (_bundle(tmp_path / "odd", "inductor", {"text": "model.pt"}),
                         "not a bundle of any backend (neuron, inductor, export): its bundle.json names backend "
                         "'inductor' and graphs ['text']")]:
        proc = qbuild("run", str(bundle), "--prompt", "hi", cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines() == [f"error: {bundle}: {why}"]
