"""What a step runs, read from the code itself: the static import closure of its module.

A node's key holds a digest of every first-party module its step's module can import (the module's own package, and
qbuild), found by reading import statements at any depth (function bodies included, `if TYPE_CHECKING:` blocks
excluded: they never run), and the installed versions of the third-party distributions those modules import. Nothing
is listed by hand, so a module cannot be missing from a key. The walk stops at the machinery around the steps (store,
execution, cli, render, report, a step's progress: MACHINERY), which decides nothing of what a step writes: an edit of
it re-keys nothing.

A module's digest is of its syntax tree with docstrings removed, written out field by field: a comment, a docstring,
a blank line or a re-wrapped line changes no key; a code edit changes the key of every step whose closure holds
the module. The tree is written out by node type and non-empty fields, so the same source gives the same digest on
every Python version whose parser gives the same tree.

Dynamic imports (`importlib.import_module`) are invisible to this walk. qbuild has these, each accounted for: in the
backend registry (qbuild.backends), a backend's implementation and a shard layout's rules, and in the conversion
program (qbuild.model.convert.layout), a family's conversion rules (a node records the ones it runs, and their closures
join its key: dag.Node.code, keys.closure); a backend's server (which no build step runs);
and a port's modules, in the Neuron SDK worker (keyed as the port's files) and in the vLLM plugin a served bundle
carries (which no build step runs). A worker finds a node's step by its class (a job pickles it by reference), never
by a name. tests/test_hermetic_sources.py fails on any other.
tests/test_hermetic_sources.py fails on any other.

Per file, the digest and the imports are cached by the file's stat identity (qbuild.core.hashing.StatCache), so
planning parses only the files that changed.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from qbuild.core.hashing import StatCache, digest_bytes
from qbuild.core.userdir import cache_dir

# Bumped whenever what a file's facts hold, or how the digest is computed, changes: old rows never answer.
_FACTS_VERSION = 1
# The machinery around the steps: where outputs are kept (store), how steps are scheduled, run and recorded
# (execution), what a person sees (cli, render, report, the progress of a running step). None of it decides the bytes a
# step writes, so the walk stops at its modules: an edit of them re-keys nothing. Code that does decide them (a
# bundle's layout, how a file is written) lives in the layers below (model, core).
MACHINERY = ("qbuild.store", "qbuild.execution", "qbuild.cli", "qbuild.render", "qbuild.report",
             "qbuild.core.progress")


@dataclass(frozen=True)
class FileFacts:
    digest: str                     # of the module's syntax tree without docstrings
    imports: tuple[str, ...]        # absolute names of the modules it imports, at any depth, sorted


@dataclass(frozen=True)
class Closure:
    modules: tuple[tuple[str, Path], ...]    # (module name, file), first-party, sorted by name
    third_party: tuple[str, ...]             # top-level names of the other modules imported, sorted


# --- one file --------------------------------------------------------------------------------------------------

def _without_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return tree


def _dump(node) -> object:
    """A syntax tree as plain data: node type and its non-empty fields, no positions."""
    if isinstance(node, ast.AST):
        fields = {}
        for name in node._fields:
            value = getattr(node, name, None)
            if value is None or value == []:
                continue
            fields[name] = _dump(value)
        return [type(node).__name__, fields]
    if isinstance(node, list):
        return [_dump(v) for v in node]
    if isinstance(node, (bytes, complex, float)) or node is Ellipsis:
        return repr(node)
    return node


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module) -> set[str]:
    """What a module imports, at any depth: for `from a.b import c`, both a.b and a.b.c (c may be a module).
    Relative imports keep their leading dots; `resolve` makes them absolute."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            out.add(base)
            sep = "" if base.endswith(".") else "."
            out.update(f"{base}{sep}{alias.name}" for alias in node.names if alias.name != "*")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def resolve(name: str, module: str, is_package: bool) -> str:
    """`name` as imported by `module`, made absolute."""
    level = len(name) - len(name.lstrip("."))
    if not level:
        return name
    parts = (module if is_package else module.rpartition(".")[0]).split(".")
    base = ".".join(parts[:len(parts) - level + 1])
    rest = name[level:]
    return f"{base}.{rest}" if rest else base


def file_facts(path: Path) -> FileFacts:
    tree = ast.parse(path.read_bytes(), filename=str(path))
    imports = _imports(tree)
    digest = digest_bytes(json.dumps(_dump(_without_docstrings(tree)), separators=(",", ":")).encode())
    return FileFacts(digest, tuple(sorted(imports)))


# --- the closure -----------------------------------------------------------------------------------------------

def _cache_path() -> Path:
    return cache_dir(f"source-facts-v{_FACTS_VERSION}.sqlite")


@dataclass
class Sources:
    """Finds and reads first-party modules: qbuild, and the top-level package of any entry asked about.

    `roots` maps a top-level package name to its directory; a package not named there is found with find_spec (its
    parents are never imported). Tests pass a copy of the qbuild tree here to see what an edit would change.

    One instance sees one state of the tree: it finds and reads each module once, and keeps the closures it walked.
    DEFAULT serves a command, which plans against the code as it was when it started; a process that outlives a
    change of the tree (a Ray worker, between tasks) makes a new instance for each check, which reads again through
    the stat-keyed caches."""

    roots: dict[str, Path] = field(default_factory=dict)
    stat_cache: StatCache | None = None
    _facts: dict[tuple, FileFacts] = field(default_factory=dict, repr=False)
    _closures: dict[tuple[str, ...], Closure] = field(default_factory=dict, repr=False)
    _paths: dict[str, Path | None] = field(default_factory=dict, repr=False)
    _read: dict[Path, FileFacts] = field(default_factory=dict, repr=False)

    def root(self, top: str) -> Path | None:
        if top not in self.roots:
            spec = importlib.util.find_spec(top)
            if spec is None or not spec.submodule_search_locations:
                return None
            self.roots[top] = Path(next(iter(spec.submodule_search_locations)))
        return self.roots[top]

    def path(self, module: str) -> Path | None:
        """The file of a first-party module (its __init__.py for a package); None where it is not one."""
        if module not in self._paths:
            self._paths[module] = self._find(module)
        return self._paths[module]

    def _find(self, module: str) -> Path | None:
        top, *rest = module.split(".")
        root = self.root(top)
        if root is None:
            return None
        base = root.joinpath(*rest)
        for candidate in (base / "__init__.py", base.with_name(base.name + ".py") if rest else None):
            if candidate is not None and candidate.is_file():
                return candidate
        return None

    def facts(self, path: Path) -> FileFacts:
        if path not in self._read:
            self._read[path] = self._file_facts(path)
        return self._read[path]

    def _file_facts(self, path: Path) -> FileFacts:
        st = path.stat()
        ident = (str(path), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        facts = self._facts.get(ident)
        if facts is None:
            if self.stat_cache is None:
                self.stat_cache = StatCache(_cache_path(), hash_file=lambda p: json.dumps(
                    (lambda f: [f.digest, f.imports])(file_facts(p))))
            digest, imports = json.loads(self.stat_cache.digest(path))
            facts = self._facts[ident] = FileFacts(digest, tuple(imports))
        return facts

    def closure(self, entries: tuple[str, ...], first_party: tuple[str, ...] = ("qbuild",)) -> Closure:
        """Every first-party module `entries` can import, with their packages' __init__ modules (an import runs
        them), but none of the MACHINERY, and the top-level names of the other modules they import."""
        key = (*entries, "|", *first_party)
        if key in self._closures:
            return self._closures[key]
        ours = set(first_party) | {e.split(".")[0] for e in entries}
        found: dict[str, Path] = {}
        third: set[str] = set()
        todo = list(entries)
        while todo:
            name = todo.pop()
            if name in found:
                continue
            top = name.split(".")[0]
            if top not in ours:
                if top and top not in sys.stdlib_module_names and top != "__future__":
                    third.add(top)
                continue
            if any(name == m or name.startswith(m + ".") for m in MACHINERY):
                continue
            path = self.path(name)
            if path is None:
                continue    # `from pkg import name` where name is not a module
            found[name] = path
            parts = name.split(".")
            todo += [".".join(parts[:i]) for i in range(1, len(parts))]
            todo += [resolve(i, name, path.name == "__init__.py") for i in self.facts(path).imports]
        missing = [e for e in entries if e not in found]
        if missing:
            raise ValueError(f"step module {missing[0]!r} is not importable")
        out = self._closures[key] = Closure(tuple(sorted(found.items())), tuple(sorted(third)))
        return out

    def digest(self, closure: Closure) -> str:
        return digest_bytes("\n".join(f"{name}:{self.facts(path).digest}" for name, path in closure.modules).encode())


# --- third-party distributions -------------------------------------------------------------------------------------

def distribution_versions(top_level_names: tuple[str, ...]) -> dict[str, str]:
    """{distribution: installed version} of the distributions providing these top-level modules; "absent" for a
    name no installed distribution provides (the code that imports it cannot run here, and says so when it tries)."""
    mapping = _top_level_distributions()
    out = {}
    for name in top_level_names:
        dists = mapping.get(name)
        if not dists:
            out[name] = "absent"
            continue
        for dist in dists:
            out[dist] = _installed_version(dist)
    return out


def _metadata_stamp() -> list:
    """What importlib.metadata reads to map modules to distributions: the metadata directories (*.dist-info,
    *.egg-info) of every sys.path entry, each by name, inode and mtime. An install, upgrade or removal replaces one;
    nothing else on sys.path (the script's directory, the working directory) counts."""
    stamp = []
    for entry in sorted({os.path.abspath(entry or ".") for entry in sys.path}):
        try:
            with os.scandir(entry) as children:
                for child in children:
                    if child.name.endswith((".dist-info", ".egg-info")):
                        st = child.stat()
                        stamp.append([entry, child.name, st.st_ino, st.st_mtime_ns])
        except OSError:     # a zip file or a missing directory holds no metadata directory here
            continue
    return sorted(stamp)


@cache
def _top_level_distributions() -> dict[str, tuple[str, ...]]:
    """importlib.metadata.packages_distributions(), cached on disk until a metadata directory on sys.path changes:
    reading every distribution's file list takes a fifth of a second, planning's whole budget."""
    stamp = _metadata_stamp()
    path = _cache_path().with_name("distributions-v2.json")
    try:
        cached = json.loads(path.read_text())
        if cached["stamp"] == stamp:
            return {k: tuple(v) for k, v in cached["mapping"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    mapping = {k: tuple(sorted(set(v))) for k, v in importlib.metadata.packages_distributions().items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"stamp": stamp, "mapping": mapping}))
        os.replace(tmp, path)
    except OSError:
        pass
    return mapping


@cache
def _installed_version(name: str) -> str:
    """importlib.metadata.version(name), without parsing the whole METADATA file as an email message (which took
    most of a plan's keying time): the Version field is one line of the header block, before the first empty line."""
    dist = importlib.metadata.distribution(name)
    for line in (dist.read_text("METADATA") or dist.read_text("PKG-INFO") or "").splitlines():
        if not line:
            break
        if line.startswith("Version:"):
            return line.removeprefix("Version:").strip()
    return dist.version


DEFAULT = Sources()
