"""The planner's view of this machine: checkpoint and port files by digest (through the stat cache), the commit the
Hugging Face Hub resolves a branch or tag to, and the config.json a recipe's model has at a commit. The planner
reads the machine through nothing else."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from qbuild.core.errors import InfraError, QbuildError
from qbuild.core.files import python_sources
from qbuild.core.hashing import StatCache
from qbuild.model.arch import Arch
from qbuild.hub import hf, snapshot, source
from qbuild.recipe.schema import HFSource, LoadedRecipe, recipe_field_location

# A port's source: its Python files, minus tests (editing a port's tests must not rebuild anything).
@dataclass(frozen=True)
class HostEnvironment:
    """This machine. One instance serves one command: it asks the Hub once per repo and revision, failures included."""

    stat_cache: StatCache
    _resolved: dict[tuple[str, str], str | QbuildError] = field(default_factory=dict, compare=False, repr=False)

    def arch(self, loaded: LoadedRecipe, commit: str | None = None) -> Arch:
        """A hub model's config.json at `commit`: on this machine, else downloaded (into qbuild's config cache), else
        the shipped copy where there is one."""
        src = loaded.recipe.model
        if isinstance(src, HFSource) and commit is not None and hf.hub_config_path(src.hf, commit) is None:
            try:
                if hf.hub_offline():
                    raise InfraError(f"model.hf: {src.hf}@{commit[:12]}: config.json is not on this machine and the "
                                     "Hub cannot be asked (offline)")
                hf.download_hub_config(src.hf, commit)
            except QbuildError as e:
                if not source.shipped_config_path(src.hf).is_file():
                    raise type(e)(f"{recipe_field_location(loaded, 'model.hf')}: {e}") from None
        return source.load_arch(loaded, commit)

    def checkpoint_digests(self, directory: Path) -> dict[str, str]:
        return {p.name: "blake3:" + self.stat_cache.digest(p) for p in snapshot.checkpoint_files(directory)}

    def hf_commit(self, repo: str, revision: str) -> str:
        if (repo, revision) not in self._resolved:
            try:
                self._resolved[repo, revision] = hf.resolve_hub_revision(repo, revision)
            except QbuildError as e:
                self._resolved[repo, revision] = e
        found = self._resolved[repo, revision]
        if isinstance(found, QbuildError):
            raise found
        return found

    def port_digests(self, port_dir: Path) -> dict[str, str] | None:
        if not port_dir.is_dir():
            return None
        return {p.relative_to(port_dir).as_posix(): "blake3:" + self.stat_cache.digest(p)
                for p in python_sources(port_dir)}
