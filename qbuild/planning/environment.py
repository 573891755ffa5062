"""The planner's view of this machine: checkpoint and port files by digest (through the stat cache), the HF cache,
and the config.json a recipe's model resolves to. The planner reads the machine through nothing else."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qbuild.core.hashing import StatCache
from qbuild.model.arch import Arch
from qbuild.recipe import source
from qbuild.recipe.schema import LoadedRecipe

# A port's source: its Python files, minus tests (editing a port's tests must not rebuild anything).
_SKIP_DIRS = {"test", "tests", "__pycache__", ".git"}


def source_files(port_dir: Path) -> list[Path]:
    """The files whose digests identify a port: every .py under it, tests excluded, sorted."""
    out = []
    for path in port_dir.rglob("*.py"):
        rel = path.relative_to(port_dir)
        if not _SKIP_DIRS.intersection(rel.parts[:-1]) and path.is_file():
            out.append(path)
    return sorted(out)


@dataclass(frozen=True)
class HostEnvironment:
    stat_cache: StatCache

    def arch(self, loaded: LoadedRecipe) -> Arch:
        return source.load_arch(loaded)

    def checkpoint_digests(self, directory: Path) -> dict[str, str]:
        return {p.name: "blake3:" + self.stat_cache.digest(p) for p in source.checkpoint_files(directory)}

    def hf_revision(self, repo: str, revision: str) -> str | None:
        cached = source.hf_cached_snapshot(repo, revision)
        return cached[0] if cached else None

    def port_digests(self, port_dir: Path) -> dict[str, str] | None:
        if not port_dir.is_dir():
            return None
        return {p.relative_to(port_dir).as_posix(): "blake3:" + self.stat_cache.digest(p)
                for p in source_files(port_dir)}
