"""Where a recipe's NxDI port source lives on this machine, and which lineage a build targets.

A neuron build runs a public NxDI contrib port (aws-neuron/neuronx-distributed-inference, contrib/models/). The ports
come in three lineages (qbuild.model.families.LINEAGES: module names, class names, compiler arguments, sharded-checkpoint
formats; shared/reference/nxdi-api.md section 1); each family names the lineages that serve it.
This module is pure data plus file lookups: it never imports a port.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from qbuild.model.families import FAMILIES, LINEAGES, Lineage

# A port's source: its Python files, minus tests (editing a port's tests must not rebuild anything).
_SKIP_DIRS = {"test", "tests", "__pycache__", ".git"}


def lineage_for(family: str, requested: str | None) -> Lineage:
    """The lineage a recipe asked for, else the family's default (the first that serves it)."""
    return LINEAGES[requested or FAMILIES[family].port_lineages[0]]


def module_dir(module: str) -> Path | None:
    """The directory of an importable package (without importing it), or None where it is not importable."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin).parent if spec.origin else None


def source_files(port_dir: Path) -> list[Path]:
    """The files whose digests identify a port: every .py under it, tests excluded, sorted."""
    out = []
    for path in port_dir.rglob("*.py"):
        rel = path.relative_to(port_dir)
        if not _SKIP_DIRS.intersection(rel.parts[:-1]) and path.is_file():
            out.append(path)
    return sorted(out)
