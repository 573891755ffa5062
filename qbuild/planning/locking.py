"""A plan against the lockfile: the locked entry of each planned node, the verdict of `compile --frozen`, the Hub files
a fetch must reproduce, and the entries a build's results write.

Pure functions over a plan, a lock document as `qbuild.store.lock.read` returns it, and manifests: the workspace reads
the lockfile once per command and passes the document here; reading, merging and writing the file is
qbuild.store.lock's. A node is matched to the lock by its roles (recipe, role), since a changed param changes its id.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from qbuild.core.errors import BuildError
from qbuild.core.platform import host_tag
from qbuild.planning.keys import REGISTRY, Registry, as_locked, diff_preimages, key_of, walk
from qbuild.planning.plan import Node, Plan, PlannedRecipe
from qbuild.recipe.params import FetchHub
from qbuild.store import lock as lockmod
from qbuild.store.lock import LockedNode
from qbuild.store.manifest import Manifest


def roles_by_node(plan: Plan) -> dict[str, list[tuple[str, str]]]:
    """plan.roles(node) for every node at once: asking per node costs recipes x roles each, quadratic in all."""
    roles: dict[str, list[tuple[str, str]]] = {}
    for name, pr in plan.recipes.items():
        for role, nid in pr.nodes.items():
            roles.setdefault(nid, []).append((name, role))
    return roles


def locked_entries(plan: Plan, doc: dict) -> dict[str, LockedNode]:
    """node id -> the lock's entry for it (the first of its roles the lock holds)."""
    return lockmod.locked_nodes(doc, roles_by_node(plan))


# --- compile --frozen --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PlatformRebuild:
    """The nodes a --frozen build rebuilt for this platform: not portable, and locked as built for another one."""

    host: str
    locked: tuple[str, ...]          # the platforms the lock names for them
    nodes: tuple[str, ...]           # their ids, in plan order
    counts: dict[str, int]           # "reference", "compile inductor", ... -> how many

    def line(self) -> str:
        what = ", ".join(f"{label} x{n}" for label, n in self.counts.items())
        return f"rebuilt for {self.host} (locked for {', '.join(self.locked)}): {what}"

    def to_json(self) -> dict:
        return {"host": self.host, "locked": list(self.locked), "counts": self.counts}


def frozen_verdict(plan: Plan, doc: dict, lock_path: Path, registry: Registry = REGISTRY,
                   host: Callable[[], str] = host_tag) -> PlatformRebuild | None:
    """Raise BuildError, before anything is built, if a node's key differs from the lock's (upstream taken as locked),
    unless the node is not portable and differs only in the platform the lock holds it for: such nodes are returned,
    to be rebuilt for this platform (None: there are none)."""
    roles = roles_by_node(plan)
    # A node must be locked under the role that names it in the error: its first one.
    locked = lockmod.locked_nodes(doc, {nid: r[:1] for nid, r in roles.items()})
    keys = walk(plan, lambda nid, key: locked[nid].digest if nid in locked else None, registry, host)
    elsewhere: dict[str, str] = {}
    for nid, nk in keys.items():
        if nid not in roles:
            continue    # built on request and never locked (--keep-intermediates)
        recipe, role = roles[nid][0]
        entry = locked.get(nid)
        if entry is None:
            raise BuildError(f"{lock_path}: --frozen, but {recipe}: {role} is not in the lockfile; run "
                             "`qbuild compile` without --frozen and commit the lockfile")
        if nk.key == entry.key:
            continue
        if _built_for_another_platform(nk.preimage, entry):
            elsewhere[nid] = entry.platform
            continue
        changed = "; ".join(diff_preimages(entry.preimage, as_locked(nk.preimage))) or "key changed"
        raise BuildError(f"{lock_path}: --frozen, but {recipe}: {role} would change ({changed}); run "
                         "`qbuild compile` without --frozen and commit the lockfile")
    if not elsewhere:
        return None
    counts: dict[str, int] = {}
    for nid in elsewhere:
        label = _rebuild_label(plan.nodes[nid])
        counts[label] = counts.get(label, 0) + 1
    platform = next(keys[nid].preimage["platform"] for nid in elsewhere)
    return PlatformRebuild(platform, tuple(sorted(set(elsewhere.values()))), tuple(elsewhere), counts)


def frozen_changes(plan: Plan, doc: dict, entries: tuple[dict, dict], rebuilt: PlatformRebuild | None) -> bool:
    """Whether a --frozen build's lock entries (`entries`: lock_entries) would change the lockfile `doc`. What was
    rebuilt for this platform differs from the lock by design: it is compared as the lock has it."""
    recipes_now, nodes_now = dict(entries[0]), dict(entries[1])
    for nid in rebuilt.nodes if rebuilt else ():
        if nid in nodes_now and nid in doc["nodes"]:
            nodes_now[nid] = doc["nodes"][nid]
    for name, planned in plan.recipes.items():
        if rebuilt and planned.bundle in rebuilt.nodes and name in recipes_now and name in doc["recipes"]:
            recipes_now[name] = {**recipes_now[name], "bundle": doc["recipes"][name]["bundle"]}
    return not lockmod.same(lockmod.merge(doc, recipes_now, nodes_now), doc)


def _built_for_another_platform(pre: dict, entry: LockedNode) -> bool:
    """Whether the locked node is this one built for another platform: its key is this preimage's, with the lock's
    platform in place of this host's (so a portable node, or a locked entry without a platform, never is)."""
    return "platform" in pre and entry.platform is not None and entry.platform != pre["platform"] \
        and key_of({**pre, "platform": entry.platform}) == entry.key


def _rebuild_label(node: Node) -> str:
    """How the one line of a platform rebuild counts a node: by kind, and for a compile, by its backend too."""
    return f"{node.kind} {node.params.backend}" if node.kind == "compile" else node.kind


# --- what a fetch must reproduce, what a build writes ------------------------------------------------------------

def locked_files(plan: Plan, doc: dict, lock_path: Path) -> dict[str, dict]:
    """hub fetch node id -> the files the lock holds for its commit, as its step reads them from its context
    ("locked_files", which no key reads): the step refuses a snapshot of that commit with other files
    (see actions/fetch.py)."""
    out = {}
    for nid, pairs in roles_by_node(plan).items():
        params = plan.nodes[nid].params
        if not isinstance(params, FetchHub):
            continue
        for recipe, _ in pairs:
            model = doc["recipes"].get(recipe, {}).get("model") or {}
            if model.get("source") == "hf" and (model.get("repo"), model.get("revision")) == \
                    (params.repo, params.revision) and model.get("files"):
                out[nid] = {"lock": str(lock_path), "files": model["files"]}
                break
    return out


def recipes_with_bundles(plan: Plan, manifests: Mapping[str, Manifest]) -> list[str]:
    """The recipes whose bundle is built: the only ones a build writes entries for."""
    return [name for name, planned in plan.recipes.items() if planned.bundle in manifests]


def lock_entries(plan: Plan, manifests: Mapping[str, Manifest], failed: Mapping[str, str],
                 snapshots: Mapping[str, dict], lock_path: Path) -> tuple[dict, dict]:
    """(recipe entries, node entries) a build's results write: one per recipe whose bundle was built, and one per
    node such a recipe names. A recipe whose bundle was not built gets none: its entry, if the lock has one, stays as
    it was. `failed`: node id -> why it failed (a verify's failure is recorded); `snapshots`: fetch node id -> its
    snapshot.json, for each such recipe's fetch that is built."""
    recipes, nodes = {}, {}
    for name in recipes_with_bundles(plan, manifests):
        planned = plan.recipes[name]
        model = model_entry(plan, planned, snapshots.get(planned.nodes["fetch"]))
        recipes[name] = lockmod.recipe_entry(planned, model, manifests, lock_path, failed.get(planned.verify))
        for nid in recipes[name]["nodes"].values():
            nodes[nid] = lockmod.node_entry(plan.nodes[nid], manifests[nid])
    return recipes, nodes


def model_entry(plan: Plan, planned: PlannedRecipe, snapshot: dict | None) -> dict:
    """The recipe's model as locked: a local checkpoint's digests, or the commit its hub fetch is keyed on (the pin),
    with the built snapshot's digests (`snapshot`: its fetch's snapshot.json; None where not built)."""
    params = plan.nodes[planned.nodes["fetch"]].params
    pin = None if not isinstance(params, FetchHub) else \
        lockmod.HubPin(params.repo, planned.loaded.recipe.model.revision, params.revision)
    return lockmod.model_entry(pin, snapshot)
