"""The NxDI source tree a bundle's port imports from (a recipe that installs NxDI from source: the Qwen3.6-27B port,
whose modeling_qwen35.py imports four functions of modules/async_execution.py that only NxDI PR 173's own tree has,
L47-52 @ 03db3ef). The package step records what the port imports from NxDI; `qbuild serve` checks that the host's
NxDI provides it, or a tree the user names (--nxdi-tree), which goes on PYTHONPATH as the port's launcher puts
`${REPO_ROOT}/src` there (vllm/start_vllm_server.sh L120-123); otherwise it refuses in one line, where vLLM would
die with an ImportError inside its plugin loading.

Read from the files, never imported: the serving process must not import NxDI (or torch) to find this out.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

PACKAGE = "neuronx_distributed_inference"


def port_imports(module_file: Path) -> dict[str, list[str]]:
    """{NxDI module: names} the port module imports at its top level (and in top-level `if` blocks), which must
    resolve for the module to import. Imports inside try blocks are left out: a port guards its optional ones so."""
    tree = ast.parse(module_file.read_text(), str(module_file))
    out: dict[str, set[str]] = {}
    for node in _statements(tree.body, into_try=False):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                (node.module == PACKAGE or node.module.startswith(PACKAGE + ".")):
            out.setdefault(node.module, set()).update(a.name for a in node.names if a.name != "*")
    return {module: sorted(names) for module, names in sorted(out.items())}


def missing(package_dir: Path, imports: dict[str, list[str]]) -> list[str]:
    """The `module.name`s (or modules) of `imports` that the NxDI package at `package_dir` does not provide: its module
    file is absent, or binds no such name at its top level (a def, class, assignment or import, also in top-level
    if / try blocks). A module with a star import is taken as providing every name."""
    gaps = []
    for module, names in imports.items():
        path = _module_file(package_dir, module)
        if path is None:
            gaps.append(module)
            continue
        bound = _bound_names(path)
        if bound is not None:
            gaps += [f"{module}.{name}" for name in names if name not in bound]
    return gaps


def version(package_dir: Path) -> str | None:
    """`__version__` as the tree's _version.py assigns it (NxDI's setup.py reads the same file, L19 @ 03db3ef)."""
    path = package_dir / "_version.py"
    if not path.is_file():
        return None
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets) \
                and isinstance(node.value, ast.Constant):
            return str(node.value.value)
    return None


def checkout_commit(tree: Path) -> str | None:
    """The commit a git checkout at `tree` has checked out, read from its .git files (HEAD, a loose ref or
    packed-refs); None where `tree` is no git checkout or the commit cannot be read so."""
    git = tree / ".git"
    if not git.is_dir():
        return None
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[len("ref: "):]
        if (git / ref).is_file():
            return (git / ref).read_text().strip()
        for line in (git / "packed-refs").read_text().splitlines() if (git / "packed-refs").is_file() else ():
            commit, _, name = line.partition(" ")
            if name == ref:
                return commit
    except OSError:
        return None
    return None


def installed_package() -> Path | None:
    """The directory of the NxDI package this interpreter imports (found, not imported), or None."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _module_file(package_dir: Path, module: str) -> Path | None:
    parts = module.split(".")[1:]
    base = package_dir.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py") if parts else (package_dir / "__init__.py",):
        if path.is_file():
            return path
    return None


def _bound_names(path: Path) -> set[str] | None:
    names: set[str] = set()
    for node in _statements(ast.parse(path.read_text(), str(path)).body, into_try=True):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(a.name == "*" for a in node.names):
                return None
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _statements(body: list[ast.stmt], into_try: bool):
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _statements(node.body + node.orelse, into_try)
        elif into_try and isinstance(node, ast.Try):
            yield from _statements(node.body + node.orelse + node.finalbody +
                                   [s for h in node.handlers for s in h.body], into_try)
