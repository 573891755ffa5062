"""A workspace ties the pieces together for one command: recipes, store, lockfile, plan, engine.

The CLI parses flags into a Workspace and renders what its methods return; nothing here prints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from qbuild import backends as backend_registry
from qbuild.execution.engine import BuildOptions, BuildResult, Event, ProgressCallback, build
from qbuild.planning import lock as lockmod
from qbuild.planning.environment import HostEnvironment
from qbuild.core.errors import BuildError, UserError
from qbuild.core.hashing import StatCache, default_stat_cache
from qbuild.planning.keys import LockedNode, key_node
from qbuild.planning.lock import Lock, PlatformRebuild
from qbuild.planning.dag import Plan
from qbuild.planning.plan import HubPin, NodeStatus, build_plan, evaluate, explain, require_resolved, resolve_hub
from qbuild.planning.step import Step
from qbuild.planning.backend import Backends
from qbuild.recipe.params import FetchHub
from qbuild.recipe.schema import LoadedRecipe, load_recipe
from qbuild.store.remote import Store
from qbuild.store.spec import StoreSpec
from qbuild.store.remote import open_store
from qbuild.store.lease import open_lease
from qbuild.steps.registry import STEPS

if TYPE_CHECKING:
    from qbuild.store.manifest import Manifest
    from qbuild.store.remote import Progress, PushReport

RECIPES_DIR = Path("recipes")


@dataclass(frozen=True)
class PinMove:
    """What `qbuild lock update` did to one recipe's pin."""

    recipe: str
    pin: HubPin
    before: HubPin | None       # None: the recipe had no pin

    @property
    def moved(self) -> bool:
        return self.before != self.pin


@dataclass
class Workspace:
    store_spec: StoreSpec
    lock_path: Path = Path("artifacts.lock")
    root: Path = field(default_factory=Path.cwd)
    stat_cache: StatCache = field(default_factory=default_stat_cache)
    backend: str | None = None      # --backend: build every recipe on this backend instead of its own
    steps: Sequence[type[Step]] = field(default_factory=lambda: STEPS)    # the step kinds a recipe is planned with
    backends: Backends = field(default=backend_registry)    # what plans each recipe's backend part
    progress: Progress | None = None    # where a remote-backed store reports its transfers
    keep_intermediates: bool = False    # also materialize each recipe's converted weights (never locked)

    @cached_property
    def store(self) -> Store:
        """The one store of this command, opened on first use: a remote-backed store keeps the remote manifests it
        has checked, so each is read from the remote once."""
        return open_store(self.store_spec, self.progress, probe=True)

    @cached_property
    def read_lock(self) -> lockmod.ReadLock:
        """The lockfile as this command read it, once (lock.read checks it). A build's own writes merge into the
        file under its directory's lock and leave this as read: it is what the build is compared with."""
        return lockmod.ReadLock.of(self.lock_path)

    @property
    def lock(self) -> Lock:
        return self.read_lock.lock

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

    def _build_plan(self, recipes: list[LoadedRecipe], update: bool = False) -> Plan:
        """The plan of `recipes`, keyed on the lock's hub pins; a fetch of a pinned commit must give the files the
        lock holds for it, unless `update` accepts others."""
        pinned = {} if update else lockmod.pinned_files(self.lock, self.lock_path)
        return build_plan(recipes, self.environment, self.lock.hub_pins(), self.keep_intermediates,
                          backends=self.backends, steps=self.steps, locked_files=pinned)

    def plan(self, recipes: list[LoadedRecipe]) -> tuple[Plan, dict[str, NodeStatus]]:
        plan = self._build_plan(recipes)
        status = evaluate(plan, self.store.get_manifest, lockmod.locked_entries(plan, self.lock))
        return plan, status

    def explain(self, plan: Plan, status: dict[str, NodeStatus]) -> dict[str, str]:
        """Why each node would rebuild (see plan.explain), against this workspace's lockfile."""
        return explain(plan, status, lockmod.locked_entries(plan, self.lock))

    # --- building --------------------------------------------------------------------------------------------
    def compile(self, recipes: list[LoadedRecipe], options: BuildOptions, executor_factory: Callable,
                on_event: Callable[[Event], None] = lambda e: None, frozen: bool = False,
                update: bool = False, on_progress: ProgressCallback | None = None,
                ) -> tuple[Plan, BuildResult, PlatformRebuild | None]:
        """Build `recipes`; the lockfile gets the entry of each recipe whose build is over once it is (every step
        built, cached, failed or skipped) and its bundle was built; a recipe whose build did not finish keeps the entry
        it had. With `frozen`, nothing is written and the build fails unless it reproduces the lock: every node bit
        for bit, except those that are not portable and that the lock holds for another platform, which are rebuilt
        for this one (the third value names them). Without `frozen`, a node whose key is the lock's must still have
        the lock's output (a cached one included), and a hub model fetched at its pinned commit the lock's files,
        unless `update` accepts other bytes. `on_progress` hears what running steps report (engine.build)."""
        # Before anything is built: a recipe whose name the lock holds for another file would replace its entry.
        lockmod.check_unique_names(self.lock, self.lock_path, [(r.name, r.path) for r in recipes])
        plan = self._build_plan(recipes, update)
        require_resolved(plan)
        rebuilt = lockmod.frozen_verdict(plan, self.lock, self.lock_path) if frozen else None
        self._check_sources(plan)
        # --frozen compares the whole lock once the build is done; --update accepts what the build gives.
        locked = {} if frozen or update else lockmod.locked_entries(plan, self.lock)
        result, written = self._run(plan, options, executor_factory, on_event, locked, write=not frozen,
                                    on_progress=on_progress)
        if frozen:
            where = lockmod.frozen_difference(plan, self.lock, written, rebuilt)
            if where is not None:
                raise BuildError(f"{self.lock_path}: --frozen, but this build would change the lockfile, first at "
                                 f"{where}; run `qbuild compile` without --frozen and commit the lockfile")
        return plan, result, rebuilt

    def _run(self, plan: Plan, options: BuildOptions, executor_factory: Callable, on_event: Callable[[Event], None],
             locked: dict[str, LockedNode], write: bool,
             on_progress: ProgressCallback | None = None) -> tuple[BuildResult, Lock]:
        """Run the engine under a lease, so that a concurrent `qbuild gc` keeps what this build uses until the lockfile
        names it. Each recipe's entry is made once its build is over, and with `write` merged into the lockfile then,
        so an interrupted build keeps the entries of the recipes it finished and no other. Returns the result and
        the entries made (a Lock of those recipes)."""
        lease = open_lease(self.store.local.root)
        manifests: dict[str, Manifest] = {}
        outcomes: dict[str, str] = {}        # node id -> how it ended: built, cached, failed, skipped
        why: dict[str, str] = {}             # node id -> why it failed or was skipped
        recipes_of = {nid: [name for name, _ in pairs] for nid, pairs in lockmod.roles_by_node(plan).items()}
        over: set[str] = set()
        entries: list[Lock] = []

        def track(event: Event) -> None:
            nid = event.node.id
            if event.manifest is not None:
                manifests[nid] = event.manifest
                if lease is not None:
                    lease.add(event.manifest.key)
            if event.kind in ("built", "cached", "failed", "skipped"):
                outcomes[nid] = event.kind
                if event.error is not None:
                    why[nid] = event.error
                for name in recipes_of.get(nid, ()):
                    if name not in over and lockmod.finished(plan.recipes[name], outcomes):
                        over.add(name)
                        entry = self._entry(plan, name, manifests, why)
                        if entry is not None:
                            entries.append(entry)
                            if write:
                                lockmod.write(self.lock_path, entry, self.read_lock)
            on_event(event)

        try:
            result = build(plan, self.store, self.store_spec, executor_factory, options, track, locked, on_progress)
        finally:
            if lease is not None:
                lease.close()
        return result, lockmod.combined(entries)

    def _check_sources(self, plan: Plan) -> None:
        """Check each checkpoint whose fetch step will run before any step starts, so that a bad checkpoint is
        one line, exit 2, with nothing in the store or the lock. A cached fetch was checked when it ran; a hub model
        not downloaded yet (or only in part) is checked by its fetch step, and one in the HF cache has its bytes
        checked against the digests its blobs are named by first (a corrupt cache is exit 3, not a bad checkpoint). A
        download is checked by its fetch step for well-formed files, and by its convert step against the conversion
        program."""
        from qbuild.hub.hf import hub_snapshot_files, hub_snapshot_partial
        from qbuild.hub.source import source_directory

        checked: set[str] = set()
        for planned in plan.recipes.values():
            nid = planned.nodes["fetch"]
            if nid in checked:
                continue
            if self.store.get_manifest(key_node(plan.nodes[nid], {}).key) is not None:
                continue
            checked.add(nid)
            params = plan.nodes[nid].params
            directory = source_directory(planned.loaded, params.revision if isinstance(params, FetchHub) else None)
            if isinstance(params, FetchHub) and directory is not None:
                if hub_snapshot_partial(directory):
                    continue
                hub_snapshot_files(directory)
            if directory is not None:
                check_source(directory)

    def _entry(self, plan: Plan, name: str, manifests: dict[str, Manifest], why: dict[str, str]) -> Lock | None:
        """The lock entry of recipe `name`, whose build is over (lock.written_entry), with its fetch's snapshot read
        from the store."""
        planned = plan.recipes[name]
        fetch = planned.nodes["fetch"]
        snapshot = self._snapshot(manifests[fetch]) if fetch in manifests and planned.bundle in manifests else None
        return lockmod.written_entry(plan, name, manifests, why.get(planned.verify), snapshot, self.lock_path)

    def _snapshot(self, fetch: Manifest) -> dict:
        """A fetch step's snapshot.json (a remote hit's blobs come down only on use)."""
        import json

        snapshot = fetch.outputs["snapshot.json"]
        self.store.ensure_blobs({"snapshot.json": snapshot})
        return json.loads(self.store.blob_path(snapshot["digest"]).read_text())

    # --- pins and checks -------------------------------------------------------------------------------------
    def update_pins(self, recipes: list[LoadedRecipe]) -> list[PinMove]:
        """Resolve the hub revision of each recipe through the Hub, ignoring its pin, and write the pins (nothing
        else) into the lockfile; this workspace then plans with them. Every recipe is resolved before anything is
        written: one that cannot be leaves the lockfile as it was."""
        lockmod.check_unique_names(self.lock, self.lock_path, [(r.name, r.path) for r in recipes])
        pins, moves = {}, []
        for loaded in recipes:
            hub = resolve_hub(loaded, self.environment)
            if hub is None:
                continue
            if hub.unresolved is not None:
                raise type(hub.unresolved)(str(hub.unresolved))
            pins[loaded.name] = (lockmod.recorded_path(loaded.path, self.lock_path),
                                 HubPin(hub.repo, hub.requested, hub.commit))
        if not pins:
            return []
        _, before = lockmod.set_pins(self.lock_path, pins)
        self.read_lock = lockmod.ReadLock.of(self.lock_path)
        for name, (_, pin) in pins.items():
            moves.append(PinMove(name, pin, before[name]))
        return moves

    def check_lock(self, recipes: list[str] | None = None) -> list[str]:
        return lockmod.check(self.lock, self.store, recipes)

    # --- after a build ---------------------------------------------------------------------------------------
    def push(self, result: BuildResult) -> PushReport:
        """After a --push build: everything the build produced or found must be on the remote (the workers pushed what
        they built; this uploads cached entries the remote lacks, and fails with exit 3 if the remote is gone)."""
        from qbuild.store.remote import push_manifests

        store = self.store
        return push_manifests(store.local, store.remote, list(result.manifests.values()), store.progress)


def check_source(directory: Path) -> None:
    """UserError, one line naming the file (and tensor), unless the checkpoint at `directory` can be built: its files
    well formed (the fetch step's check) and its tensors the ones the conversion program reads (the convert step's)."""
    from qbuild.hub.snapshot import check_checkpoint
    from qbuild.model.convert.errors import CheckpointError
    from qbuild.model.convert.layout import open_checkpoint

    check_checkpoint(directory)
    try:
        open_checkpoint(directory)
    except CheckpointError as e:
        raise UserError(f"{directory}{os.sep}{e}") from None
