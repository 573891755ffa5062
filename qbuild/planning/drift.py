"""Whether a locked recipe still asks for what the lock holds for it: the check behind `run`, `bench`, `serve`, `pull`
and `lock check` naming a recipe edited since its bundle was locked (and refusing it with --strict).

The recipe is planned again, offline (the Hub is never asked: a pin that no longer matches the recipe's revision is
itself the change) and without torch, and each node of it is compared, in plan order, with the node the lock holds
for the same role: its params (what the recipe and its model decide) and its inputs, taken as the lock's outputs of
the same recipe's upstream roles. The first field that differs is named, as `qbuild explain` names it. Neither the
code version nor the toolchain is compared: an upgrade of qbuild or of a library re-keys every node while the recipe
asks for the same bundle, and `compile --frozen` is the check for those. A step the plan has and the lock lacks is a
change where the bundle is built from it (a new bucket); a reference or verify the lock lacks is a verify that did
not pass, which `pull` names on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qbuild.core.errors import InfraError, QbuildError
from qbuild.core.hashing import StatCache
from qbuild.model.arch import Arch
from qbuild.planning.environment import HostEnvironment
from qbuild.planning.graph import graph_of, upstream
from qbuild.planning.keys import as_locked, diff_preimages
from qbuild.planning.plan import Plan, PlannedRecipe, build_plan
from qbuild.planning.steps import Backends
from qbuild.hub import checkpoint
from qbuild.recipe.params import to_json
from qbuild.recipe.locked import locked_recipe
from qbuild.recipe.schema import LoadedRecipe
from qbuild.store.lock import hub_pins, recipe_file


@dataclass(frozen=True)
class RecipeChange:
    """A locked recipe whose file asks for something else now (`what`: the role and the first field that moved), or
    whose file could not be planned to tell (`known` False, `what`: why)."""

    recipe: str
    file: Path
    what: str
    known: bool = True

    def line(self) -> str:
        if not self.known:
            return f"{self.recipe}: cannot tell whether {self.file} changed since it was locked: {self.what}"
        return (f"{self.recipe}: {self.file} changed since it was locked ({self.what}); the lock holds what it asked "
                f"for before: `qbuild compile {self.file}` builds what it asks for now")


@dataclass(frozen=True)
class OfflineEnvironment:
    """This machine as the planner sees it, without the network: checkpoint and port files by digest, config.json
    from the local caches or the shipped copy; a Hub revision is never resolved."""

    host: HostEnvironment

    def arch(self, loaded: LoadedRecipe, commit: str | None = None) -> Arch:
        return checkpoint.load_arch(loaded, commit)

    def checkpoint_digests(self, directory: Path) -> dict[str, str]:
        return self.host.checkpoint_digests(directory)

    def hf_commit(self, repo: str, revision: str) -> str:
        raise InfraError(f"{repo}@{revision}: not the revision the lock pins, and this check never asks the Hub")

    def port_digests(self, port_dir: Path) -> dict[str, str] | None:
        return self.host.port_digests(port_dir)


def recipe_change(doc: dict, lock_path: Path, name: str, stat_cache: StatCache,
                  backends: Backends) -> RecipeChange | None:
    """How the recipe file of the locked recipe `name` changed since it was locked (planned again with `backends`);
    None where it did not, where the lock holds no bundle for it (only a pin: nothing built to compare), or where the
    file is not on this machine (a serving host may hold the lockfile alone)."""
    entry = doc["recipes"][name]
    path = recipe_file(entry, lock_path)
    if entry["bundle"] is None or not path.is_file():
        return None
    try:
        loaded = locked_recipe(doc, lock_path, name)
        plan = build_plan([loaded], OfflineEnvironment(HostEnvironment(stat_cache)), hub_pins(doc), backends=backends)
    except QbuildError as e:
        return RecipeChange(name, path, str(e), known=False)
    what = first_change(plan, plan.recipes[loaded.name], doc, entry)
    return None if what is None else RecipeChange(name, path, what)


def first_change(plan: Plan, planned: PlannedRecipe, doc: dict, entry: dict) -> str | None:
    """"<role>: <field> ..." for the first node of `planned`, in plan order, whose params or inputs differ from the
    locked node of its role; None where none does."""
    locked = {role: doc["nodes"][nid] for role, nid in entry["nodes"].items()}
    role_of = {nid: role for role, nid in planned.nodes.items()}
    bundle_steps = upstream(graph_of(plan), [planned.bundle])
    for nid, node in plan.nodes.items():
        role = role_of.get(nid)
        if role is None:
            continue
        old = locked.get(role)
        if old is None:
            if nid in bundle_steps:
                return f"{role}: a step the locked bundle was not built with"
            continue
        inputs = {name: locked[role_of[dep]]["digest"] for name, dep in node.deps.items() if role_of[dep] in locked}
        # The params first: what the recipe says is the cause, an input that follows from it the consequence.
        changed = diff_preimages({"params": old["preimage"].get("params")},
                                 as_locked({"params": to_json(node.params)})) + \
            diff_preimages({"inputs": old["preimage"].get("inputs", {})}, {"inputs": inputs})
        if changed:
            return f"{role}: {changed[0]}"
    gone = sorted(set(locked) - set(planned.nodes))
    return f"{gone[0]}: a locked step the recipe no longer plans" if gone else None

