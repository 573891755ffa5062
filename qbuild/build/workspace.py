"""A workspace ties the pieces together for one command: recipes, store, lockfile, plan, engine.

The CLI parses flags into a Workspace and renders what its methods return; nothing here prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from qbuild.store import lock as lockmod
from qbuild.build.engine import BuildOptions, BuildResult, Event, build
from qbuild.planning.environment import HostEnvironment
from qbuild.core.errors import BuildError, UserError
from qbuild.core.hashing import StatCache, default_stat_cache
from qbuild.planning.keys import REGISTRY, Registry, as_locked, diff_preimages, key_node, key_of, walk
from qbuild.planning.plan import NodeStatus, Plan, build_plan, evaluate, explain, require_resolved, resolve_hub
from qbuild.recipe.params import FetchHub
from qbuild.recipe.schema import LoadedRecipe, load_recipe
from qbuild.store import Store, StoreSpec
from qbuild.store.remote import open_store
from qbuild.store.lease import open_lease

if TYPE_CHECKING:
    from qbuild.store.remote import Progress

RECIPES_DIR = Path("recipes")


@dataclass(frozen=True)
class PinMove:
    """What `qbuild lock update` did to one recipe's pin."""

    recipe: str
    pin: lockmod.HubPin
    before: lockmod.HubPin | None       # None: the recipe had no pin

    @property
    def moved(self) -> bool:
        return self.before != self.pin


def roles_by_node(plan: Plan) -> dict[str, list[tuple[str, str]]]:
    """plan.roles(node) for every node at once: asking per node costs recipes x roles each, quadratic in all."""
    roles: dict[str, list[tuple[str, str]]] = {}
    for name, pr in plan.recipes.items():
        for role, nid in pr.nodes.items():
            roles.setdefault(nid, []).append((name, role))
    return roles


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


@dataclass
class Workspace:
    store_spec: StoreSpec
    lock_path: Path = Path("artifacts.lock")
    root: Path = field(default_factory=Path.cwd)
    stat_cache: StatCache = field(default_factory=default_stat_cache)
    backend: str | None = None      # --backend: build every recipe on this backend instead of its own
    registry: Registry = field(default_factory=lambda: REGISTRY)
    progress: Progress | None = None    # where a remote-backed store reports its transfers
    keep_intermediates: bool = False    # also materialise each recipe's converted weights (never locked)

    @cached_property
    def store(self) -> Store:
        """The one store of this command, opened on first use: a remote-backed store keeps the remote manifests it
        has checked, so each is read from the remote once."""
        return open_store(self.store_spec, self.progress, probe=True)

    # --- recipes and plans -----------------------------------------------------------------------------------
    def recipe_files(self, files: list[str], all_: bool) -> list[Path]:
        if all_:
            found = sorted((self.root / RECIPES_DIR).glob("*.yaml"))
            if not found:
                raise UserError(f"{self.root / RECIPES_DIR}: --all found no recipes (*.yaml)")
            return found + [Path(f) for f in files]
        if not files:
            raise UserError("name at least one recipe file, or pass --all")
        return [Path(f) for f in files]

    def load(self, files: list[str], all_: bool = False) -> list[LoadedRecipe]:
        return [load_recipe(f).with_backend(self.backend) for f in self.recipe_files(files, all_)]

    @cached_property
    def environment(self) -> HostEnvironment:
        """One per command, so that the Hub is asked once per repo and revision whatever the command plans."""
        return HostEnvironment(self.stat_cache)

    def _build_plan(self, recipes: list[LoadedRecipe]) -> Plan:
        return build_plan(recipes, self.environment, lockmod.hub_pins(lockmod.read(self.lock_path)),
                          self.keep_intermediates)

    def plan(self, recipes: list[LoadedRecipe]) -> tuple[Plan, dict[str, NodeStatus]]:
        plan = self._build_plan(recipes)
        status = evaluate(plan, self.store.get_manifest, self._locked(plan), self.registry)
        return plan, status

    def explain(self, plan: Plan, status: dict[str, NodeStatus]) -> dict[str, str]:
        """Why each node would rebuild (see plan.explain), against this workspace's lockfile."""
        return explain(plan, status, self._locked(plan), self.registry)

    def _locked(self, plan: Plan) -> dict[str, lockmod.LockedNode]:
        return lockmod.locked_nodes(lockmod.read(self.lock_path), roles_by_node(plan))

    # --- building --------------------------------------------------------------------------------------------
    def compile(self, recipes: list[LoadedRecipe], options: BuildOptions, executor_factory: Callable,
                on_event: Callable[[Event], None] = lambda e: None, frozen: bool = False,
                update: bool = False) -> tuple[Plan, BuildResult, PlatformRebuild | None]:
        """Build `recipes`; the lockfile gets an entry for each recipe whose bundle was built (written as each step
        succeeds), and none for the others, whose entries stay as they were. With `frozen`, nothing is written and
        the build fails unless it reproduces the lock: every node bit for bit, except those that are not portable
        and that the lock holds for another platform, which are rebuilt for this one (the third value names them).
        Without `frozen`, a node whose key is the lock's must still have the lock's output (a cached one included),
        and a hub model fetched at its pinned commit the lock's files, unless `update` accepts other bytes."""
        # Before anything is built: a recipe whose name the lock holds for another file would replace its entry.
        lockmod.check_unique_names(lockmod.read(self.lock_path), self.lock_path,
                                   [(r.name, r.path) for r in recipes])
        plan = self._build_plan(recipes)
        require_resolved(plan)
        rebuilt = self._check_frozen(plan) if frozen else None
        if not update:
            self._pass_locked_files(plan)
        self._check_sources(plan)
        seen = BuildResult()
        # Held until the lockfile names what was built: a concurrent `qbuild gc` keeps what this build uses.
        lease = open_lease(self.store.local.root)

        def track(event: Event) -> None:
            if event.manifest is not None:
                seen.manifests[event.node.id] = event.manifest
                if lease is not None:
                    lease.add(event.manifest.key)
            # The lock entry of each step is written as soon as it succeeds, so an interrupted run keeps it.
            if event.kind == "built" and not frozen:
                self.write_lock(plan, seen)
            on_event(event)

        try:
            # --frozen compares the whole lock once the build is done; --update accepts what the build gives.
            locked = {} if frozen or update else self._locked(plan)
            result = build(plan, self.store, self.store_spec, executor_factory, options, track, self.registry,
                           locked)
            if not frozen:
                self.write_lock(plan, result)
        finally:
            if lease is not None:
                lease.close()
        if frozen:
            old = lockmod.read(self.lock_path)
            recipes_now, nodes_now = self._lock_entries(plan, result)
            # What was rebuilt for this platform differs from the lock by design: compared as the lock has it.
            for nid in rebuilt.nodes if rebuilt else ():
                if nid in nodes_now and nid in old["nodes"]:
                    nodes_now[nid] = old["nodes"][nid]
            for name, planned in plan.recipes.items():
                if rebuilt and planned.bundle in rebuilt.nodes and name in recipes_now and name in old["recipes"]:
                    recipes_now[name]["bundle"] = old["recipes"][name]["bundle"]
            if not lockmod.same(lockmod.merge(old, recipes_now, nodes_now), old):
                raise BuildError(f"{self.lock_path}: --frozen, but this build would change the lockfile; "
                                 "run `qbuild compile` without --frozen and commit the lockfile")
        return plan, result, rebuilt

    def _check_frozen(self, plan: Plan) -> PlatformRebuild | None:
        """Fail before building anything if a node's key differs from the lock's (upstream taken as locked), unless
        the node is not portable and differs only in the platform the lock holds it for: such nodes are returned, to
        be rebuilt for this platform."""
        roles = roles_by_node(plan)
        # A node must be locked under the role that names it in the error: its first one.
        locked = lockmod.locked_nodes(lockmod.read(self.lock_path), {nid: r[:1] for nid, r in roles.items()})
        keys = walk(plan, lambda nid, key: locked[nid].digest if nid in locked else None, self.registry)
        elsewhere: dict[str, str] = {}
        for nid, nk in keys.items():
            if nid not in roles:
                continue    # built on request and never locked (--keep-intermediates)
            recipe, role = roles[nid][0]
            entry = locked.get(nid)
            if entry is None:
                raise BuildError(f"{self.lock_path}: --frozen, but {recipe}: {role} is not in the lockfile; run "
                                 "`qbuild compile` without --frozen and commit the lockfile")
            if nk.key == entry.key:
                continue
            if _built_for_another_platform(nk.preimage, entry):
                elsewhere[nid] = entry.platform
                continue
            changed = "; ".join(diff_preimages(entry.preimage, as_locked(nk.preimage))) or "key changed"
            raise BuildError(f"{self.lock_path}: --frozen, but {recipe}: {role} would change ({changed}); run "
                             "`qbuild compile` without --frozen and commit the lockfile")
        if not elsewhere:
            return None
        counts: dict[str, int] = {}
        for nid in elsewhere:
            label = _rebuild_label(plan.nodes[nid])
            counts[label] = counts.get(label, 0) + 1
        host = next(keys[nid].preimage["platform"] for nid in elsewhere)
        return PlatformRebuild(host, tuple(sorted(set(elsewhere.values()))), tuple(elsewhere), counts)

    def _pass_locked_files(self, plan: Plan) -> None:
        """Give each hub fetch the files the lock holds for its commit (node context "locked_files", which no key
        reads): its step refuses a snapshot of that commit with other files (see actions/fetch.py)."""
        doc = lockmod.read(self.lock_path)
        for nid, pairs in roles_by_node(plan).items():
            params = plan.nodes[nid].params
            if not isinstance(params, FetchHub):
                continue
            for recipe, _ in pairs:
                model = doc["recipes"].get(recipe, {}).get("model") or {}
                if model.get("source") == "hf" and (model.get("repo"), model.get("revision")) == \
                        (params.repo, params.revision) and model.get("files"):
                    plan.nodes[nid].context["locked_files"] = {"lock": str(self.lock_path), "files": model["files"]}
                    break

    def _check_sources(self, plan: Plan) -> None:
        """Check each checkpoint whose fetch step will run before any step starts, so that a bad checkpoint is
        one line, exit 2, with nothing in the store or the lock. A cached fetch was checked when it ran; a hub model
        not downloaded yet (or only in part) is checked by its fetch step, and one in the HF cache has its bytes
        checked against the digests its blobs are named by first (a corrupt cache is exit 3, not a bad checkpoint)."""
        from qbuild.recipe.source import check_checkpoint, hub_snapshot_files, hub_snapshot_partial, source_directory

        checked: set[str] = set()
        for planned in plan.recipes.values():
            nid = planned.nodes["fetch"]
            if nid in checked:
                continue
            if self.store.get_manifest(key_node(plan.nodes[nid], {}, self.registry).key) is not None:
                continue
            checked.add(nid)
            params = plan.nodes[nid].params
            directory = source_directory(planned.loaded, params.revision if isinstance(params, FetchHub) else None)
            if isinstance(params, FetchHub) and directory is not None:
                if hub_snapshot_partial(directory):
                    continue
                hub_snapshot_files(directory)
            if directory is not None:
                check_checkpoint(directory)

    def _lock_entries(self, plan: Plan, result: BuildResult) -> tuple[dict, dict]:
        """The lock entries of the recipes whose bundle was built, and of their nodes. A recipe whose bundle was not
        built gets none: its entry, if the lock has one, stays as it was."""
        recipes, nodes = {}, {}
        for name, planned in plan.recipes.items():
            if planned.bundle not in result.manifests:
                continue
            fetch_manifest = result.manifests.get(planned.nodes["fetch"])
            model = self._model_entry(plan, planned, fetch_manifest)
            recipes[name] = lockmod.recipe_entry(planned, model, result.manifests, self.lock_path,
                                                 result.failed.get(planned.verify))
            for nid in recipes[name]["nodes"].values():
                nodes[nid] = lockmod.node_entry(plan.nodes[nid], result.manifests[nid])
        return recipes, nodes

    def _model_entry(self, plan: Plan, planned, fetch_manifest) -> dict:
        """The recipe's model as locked: a local checkpoint's digests, or the commit its hub fetch is keyed on (the
        pin), with the built snapshot's digests."""
        snap = None
        if fetch_manifest is not None:
            import json

            snapshot = fetch_manifest.outputs["snapshot.json"]
            self.store.ensure_blobs({"snapshot.json": snapshot})   # a remote hit's blobs come down only on use
            snap = json.loads(self.store.blob_path(snapshot["digest"]).read_text())
        params = plan.nodes[planned.nodes["fetch"]].params
        pin = None if not isinstance(params, FetchHub) else \
            lockmod.HubPin(params.repo, planned.loaded.recipe.model.revision, params.revision)
        return lockmod.model_entry(pin, snap)

    def update_pins(self, recipes: list[LoadedRecipe]) -> list[PinMove]:
        """Resolve the hub revision of each recipe through the Hub, ignoring its pin, and write the pins (nothing
        else) into the lockfile. Every recipe is resolved before anything is written: one that cannot be leaves the
        lockfile as it was."""
        lockmod.check_unique_names(lockmod.read(self.lock_path), self.lock_path,
                                   [(r.name, r.path) for r in recipes])
        pins, moves = {}, []
        for loaded in recipes:
            hub = resolve_hub(loaded, self.environment)
            if hub is None:
                continue
            if hub.unresolved is not None:
                raise type(hub.unresolved)(str(hub.unresolved))
            pins[loaded.name] = (self._recorded_path(loaded.path), lockmod.HubPin(hub.repo, hub.requested, hub.commit))
        before = lockmod.set_pins(self.lock_path, pins) if pins else {}
        for name, (_, pin) in pins.items():
            moves.append(PinMove(name, pin, before[name]))
        return moves

    def _recorded_path(self, path: Path) -> str:
        """A recipe file as the lock records it (lockmod.recipe_entry)."""
        try:
            return path.resolve().relative_to(self.lock_path.parent.resolve()).as_posix()
        except ValueError:
            return path.resolve().as_posix()

    def write_lock(self, plan: Plan, result: BuildResult) -> bool:
        return lockmod.update(self.lock_path, *self._lock_entries(plan, result))

    def check_lock(self, recipes: list[str] | None = None) -> list[str]:
        return lockmod.check(lockmod.read(self.lock_path), self.store, recipes)


def _built_for_another_platform(pre: dict, entry: lockmod.LockedNode) -> bool:
    """Whether the locked node is this one built for another platform: its key is this preimage's, with the lock's
    platform in place of this host's (so a portable node, or a locked entry without a platform, never is)."""
    return "platform" in pre and entry.platform is not None and entry.platform != pre["platform"] \
        and key_of({**pre, "platform": entry.platform}) == entry.key


def _rebuild_label(node) -> str:
    """How the one line of a platform rebuild counts a node: by kind, and for a compile, by its backend too."""
    return f"{node.kind} {node.params.backend}" if node.kind == "compile" else node.kind
