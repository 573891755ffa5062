"""Keys come from the code itself: for every module under qbuild/, a code edit changes exactly the keys of the actions
whose import closure holds it, a comment or docstring edit changes none, and the closure agrees with an independent
reading of the bytecode (the standard library's modulefinder). Generated from the tree, never hand-listed."""

from __future__ import annotations

import ast
import json
import modulefinder
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.keyscope import modules as package_modules
from qbuild import backends
from qbuild.planning.closures import MACHINERY, Sources
from qbuild.planning.keys import closure, code_hash
from qbuild.steps.registry import STEPS
from tests.conftest import REPO, qbuild

PACKAGE = REPO / "qbuild"
# What a node runs beyond its action's entry (qbuild.planning.plan.Node.code): nothing, a backend's implementation
# (qbuild.backends.get), or a shard layout's rules (qbuild.backends.shard_layout).
CODES = [(), *sorted({(backends.implementation_module(name),) for name in backends.NAMES}),
         *sorted({(backends.layout_module(name),) for name in backends.LAYOUTS})]
# (step, code): every step kind with every such code.
PAIRS = [(step, code) for step in STEPS for code in CODES]


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A copy of the qbuild package, edited by the tests and restored after each edit."""
    root = tmp_path_factory.mktemp("hermetic") / "qbuild"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _hashes(sources: Sources) -> dict[tuple, str]:
    return {(step, code): code_hash(step, code, sources) for step, code in PAIRS}


def _code_edit(text: str) -> str:
    return text + "\n_hermetic_probe = 1\n"


def _comment_edit(text: str) -> str:
    """A comment, blank lines, a re-wrapped line's worth of whitespace, and a changed docstring: no code."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    doc = ast.get_docstring(tree, clean=False)
    if doc is not None:
        node = tree.body[0].value
        line = lines[node.lineno - 1]
        col = node.col_offset
        while line[col] not in "\"'":
            col += 1
        quote = line[col:col + 3] if line[col:col + 3] in ('"""', "'''") else line[col]
        col += len(quote)
        lines[node.lineno - 1] = line[:col] + "Edited. " + line[col:]
    return "# an edited comment\n\n" + "".join(lines) + "\n\n# another one\n"


def test_every_module_edit_changes_exactly_the_keys_whose_closure_holds_it(tree):
    facts: dict = {}
    base = Sources({"qbuild": tree}, _facts=facts)
    before = _hashes(base)
    closures = {pair: {name for name, _ in closure(pair[0], pair[1], base).modules} for pair in PAIRS}
    modules = package_modules(tree)
    assert len(modules) > 80, "the walk found the package"
    for name, path in modules.items():
        original = path.read_text()
        try:
            path.write_text(_comment_edit(original))
            after = _hashes(Sources({"qbuild": tree}, _facts=facts))
            assert after == before, f"a comment/docstring edit of {name} changed keys"
            path.write_text(_code_edit(original))
            after = _hashes(Sources({"qbuild": tree}, _facts=facts))
            changed = {pair for pair in PAIRS if after[pair] != before[pair]}
            expected = {pair for pair in PAIRS if name in closures[pair]}
            assert changed == expected, f"a code edit of {name}: changed {sorted(map(str, changed))}, " \
                                        f"expected {sorted(map(str, expected))}"
        finally:
            path.write_text(original)


def test_a_data_file_edit_changes_the_keys_of_the_actions_that_declare_it(tree):
    facts: dict = {}
    before = _hashes(Sources({"qbuild": tree}, _facts=facts))
    golden = tree / "golden" / "prompts.json"
    original = golden.read_text()
    try:
        doc = json.loads(original)
        golden.write_text(json.dumps(doc, indent=3) + "\n")   # same data, other bytes: still an edit of the input
        after = _hashes(Sources({"qbuild": tree}, _facts=facts))
    finally:
        golden.write_text(original)
    assert {pair for pair in PAIRS if after[pair] != before[pair]} == {pair for pair in PAIRS
                                                                      if pair[0].kind == "reference"}


def _type_checking_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            for child in node.body:
                for sub in ast.walk(child):
                    if isinstance(sub, ast.ImportFrom) and sub.module:
                        out.add(sub.module)
                        out.update(f"{sub.module}.{a.name}" for a in sub.names)
                    elif isinstance(sub, ast.Import):
                        out.update(a.name for a in sub.names)
    return out


@pytest.mark.parametrize("step,code", PAIRS, ids=[f"{s.kind}-{'-'.join(c) or 'own'}" for s, c in PAIRS])
def test_the_closure_is_what_modulefinder_reads_from_the_bytecode(step, code):
    """modulefinder follows every import instruction of the compiled code (nested functions too). It also follows
    imports under `if TYPE_CHECKING:`, which never run, and through the machinery the closure stops at (store,
    execution, the CLI...), so those it is told to skip; then it finds exactly the closure."""
    sources = Sources({"qbuild": PACKAGE})
    ours = {name for name, _ in closure(step, code, sources).modules}
    typing_only = set()
    for name, path in package_modules(PACKAGE).items():
        if name in ours:
            typing_only |= _type_checking_imports(path)
    machinery = {name for name in package_modules(PACKAGE) if any(name == m or name.startswith(m + ".") for m in MACHINERY)}
    finder = modulefinder.ModuleFinder(path=[str(REPO)], excludes=sorted((typing_only - ours) | machinery))
    for module in (step.module(), *code):
        finder.import_hook(module)
    theirs = {name for name in finder.modules if name == "qbuild" or name.startswith("qbuild.")}
    assert ours == theirs


ALLOWED_DYNAMIC_IMPORTS = {
    "qbuild.backends",                      # a backend's implementation or a shard layout (joins the key of the
                                            # nodes that run it), or a backend's server (no build step serves)
    "qbuild.backends.neuron.sdk_worker",    # a port's modules in the SDK worker (keyed as the port's files)
    "qbuild.backends.neuron.vllm_plugin",   # a port's modules inside vLLM, when a bundle is served (no key)
    "qbuild.backends.neuron.vl_runtime",    # a port's VL modules in qbuild's server of a VL bundle (no key)
    "qbuild.model.convert.layout",          # a family's conversion rules (Family.rules: joins the key of the
                                            # convert and shard nodes of that family)
}


def test_no_import_is_hidden_from_the_walk():
    """An import the static walk cannot see is a key that misses code: each dynamic import is accounted for."""
    found = set()
    for name, path in package_modules(PACKAGE).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = ast.unparse(node.func)
                if func in ("importlib.import_module", "__import__", "import_module", "importlib.__import__"):
                    found.add(name)
    assert found == ALLOWED_DYNAMIC_IMPORTS


@pytest.mark.slow
def test_keys_do_not_depend_on_the_directory_user_tmpdir_or_unrelated_environment(dense_project, tmp_path):
    """A built project planned from elsewhere, as another user (HOME, USER, caches), with another TMPDIR and
    unrelated variables set: every node is cached under the same key."""
    project = tmp_path / "project"
    shutil.copytree(dense_project, project, symlinks=True)
    lock = project / "artifacts.lock"
    store = project / "store"

    def keys(cwd: Path, env: dict) -> dict:
        proc = qbuild("plan", str(project / "recipes" / "tiny-dense.yaml"), "--json", "--lock", str(lock),
                      "--store", str(store), cwd=cwd, env=env, check=True)
        return {n["id"]: (n["key"], n["status"]) for n in json.loads(proc.stdout)["nodes"]}

    reference = keys(project, {})
    assert reference and all(status == "cached" for _, status in reference.values())
    elsewhere = tmp_path / "elsewhere" / "deeper"
    elsewhere.mkdir(parents=True)
    other_home = tmp_path / "other-home"
    other_home.mkdir()
    other_tmp = tmp_path / "other-tmp"
    other_tmp.mkdir()
    env = {"HOME": str(other_home), "USER": "someone-else", "LOGNAME": "someone-else",
           "XDG_CACHE_HOME": str(other_home / ".cache"), "TMPDIR": str(other_tmp), "LANG": "C",
           "SKIP_MOE_COMPUTE": "1", "CUDA_VISIBLE_DEVICES": "3", "OMP_NUM_THREADS": "1", "SOME_UNRELATED": "x"}
    assert keys(elsewhere, env) == reference
    os.utime(project / "recipes" / "tiny-dense.yaml")   # a touched recipe: same content, same keys
    assert keys(project, {"TMPDIR": str(other_tmp)}) == reference


def test_an_install_on_the_path_shows_in_the_next_commands_toolchain(tmp_path):
    """Which distribution provides a module is cached on disk between commands; an install, a replacement by another
    distribution, and a removal each show in the next command, whatever directory it runs in."""
    site = tmp_path / "site"
    (site / "probemod").mkdir(parents=True)
    (site / "probemod" / "__init__.py").write_text("")

    def install(dist: str | None, version: str = "") -> None:
        for info in site.glob("*.dist-info"):
            shutil.rmtree(info)
        if dist is not None:
            info = site / f"{dist.replace('-', '_')}-{version}.dist-info"    # the directory name is normalised
            info.mkdir()
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n\n")
            (info / "RECORD").write_text("probemod/__init__.py,,\n")

    def versions(cwd: Path) -> str:
        code = "from qbuild.planning.closures import distribution_versions as v; print(v(('probemod',)))"
        env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{site}")
        return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                              check=True, timeout=120).stdout.strip()

    install("probe-one", "1.0")
    assert versions(tmp_path) == "{'probe-one': '1.0'}"
    assert versions(site) == "{'probe-one': '1.0'}"
    install("probe_two", "2.0")
    assert versions(tmp_path) == "{'probe_two': '2.0'}"
    install(None)
    assert versions(tmp_path) == "{'probemod': 'absent'}"
