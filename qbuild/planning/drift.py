"""Whether a locked recipe still asks for what the lock holds for it: the check behind `run`, `bench`, `serve`, `pull`
and `lock check` naming a recipe edited since its bundle was locked (and refusing it with --strict).

The recipe is planned again, offline (the Hub is never asked: a pin that no longer matches the recipe's revision is
itself the change) and without torch; the verdict against the lock is qbuild.planning.lock.first_change: each node
is compared, in plan order, with the node the lock holds for the same role, its params and its inputs, and the first
field that differs is named, as `qbuild explain` names it. Neither the code version nor the toolchain is compared:
an upgrade of qbuild or of a library re-keys every node while the recipe asks for the same bundle, and
`compile --frozen` is the check for those. A step the plan has and the lock lacks is a change where the bundle is
built from it (a new bucket); a reference or verify the lock lacks is a verify that did not pass, which `pull` names
on its own. A recipe file that is gone is named too (deleted), unless no recipe file of the lock is on this machine:
a serving host holds the lockfile alone, and only --strict refuses there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

from qbuild.core.errors import InfraError, QbuildError
from qbuild.core.hashing import StatCache
from qbuild.model.arch import Arch
from qbuild.planning.environment import HostEnvironment
from qbuild.planning.lock import Lock, first_change, locked_recipe, recipe_file
from qbuild.planning.plan import build_plan
from qbuild.planning.backend import Backends
from qbuild.planning.step import Step
from qbuild.hub import source
from qbuild.recipe.schema import LoadedRecipe


@dataclass(frozen=True)
class RecipeChange:
    """How a locked recipe's file differs from what the lock was built from. `state`:
    - "changed": it asks for something else now (`what`: the role and the first field that moved);
    - "unknown": it could not be planned to tell (`what`: why);
    - "deleted": it is gone, while other recipe files of the lock are still beside it;
    - "absent": no recipe file of the lock is on this machine (a serving host that holds the lockfile alone)."""

    recipe: str
    file: Path
    what: str
    state: Literal["changed", "unknown", "deleted", "absent"] = "changed"

    @property
    def quiet(self) -> bool:
        """Said only where asked to be strict: a lockfile alone is how a serving host is meant to pull."""
        return self.state == "absent"

    def line(self) -> str:
        if self.state == "unknown":
            return f"{self.recipe}: cannot tell whether {self.file} changed since it was locked: {self.what}"
        if self.state == "deleted":
            return (f"{self.recipe}: {self.file}, which it was locked from, is gone; the lock holds the bundle it "
                    "built, which no recipe file asks for now")
        if self.state == "absent":
            return (f"{self.recipe}: {self.file}, which it was locked from, is not on this machine, so the locked "
                    "bundle cannot be compared with it")
        return (f"{self.recipe}: {self.file} changed since it was locked ({self.what}); the lock holds what it asked "
                f"for before: `qbuild compile {self.file}` builds what it asks for now")


@dataclass(frozen=True)
class OfflineEnvironment:
    """This machine as the planner sees it, without the network: checkpoint and port files by digest, config.json
    from the local caches or the shipped copy; a Hub revision is never resolved."""

    host: HostEnvironment

    def arch(self, loaded: LoadedRecipe, commit: str | None = None) -> Arch:
        return source.load_arch(loaded, commit)

    def checkpoint_digests(self, directory: Path) -> dict[str, str]:
        return self.host.checkpoint_digests(directory)

    def hf_commit(self, repo: str, revision: str) -> str:
        raise InfraError(f"{repo}@{revision}: not the revision the lock pins, and this check never asks the Hub")

    def port_digests(self, port_dir: Path) -> dict[str, str] | None:
        return self.host.port_digests(port_dir)


def recipe_change(lock: Lock, lock_path: Path, name: str, stat_cache: StatCache, backends: Backends,
                  steps: Sequence[type[Step]]) -> RecipeChange | None:
    """How the recipe file of the locked recipe `name` changed since it was locked (planned again with `backends`
    and `steps`);
    None where it did not, or where the lock holds no bundle for it (only a pin: nothing built to compare). A file
    that is gone is "deleted" where other recipe files of the lock are still beside it, else "absent" (RecipeChange)."""
    entry = lock.recipes[name]
    path = recipe_file(entry, lock_path)
    if entry.bundle is None:
        return None
    if not path.is_file():
        others = any(recipe_file(e, lock_path).is_file() for e in lock.recipes.values())
        return RecipeChange(name, path, "", "deleted" if others else "absent")
    try:
        loaded = locked_recipe(lock, lock_path, name)
        plan = build_plan([loaded], OfflineEnvironment(HostEnvironment(stat_cache)), lock.hub_pins(),
                          backends=backends, steps=steps)
    except QbuildError as e:
        return RecipeChange(name, path, str(e), "unknown")
    what = first_change(plan, plan.recipes[loaded.name], lock, name)
    return None if what is None else RecipeChange(name, path, what)
