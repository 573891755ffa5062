"""The planner: recipes -> a Plan (qbuild.planning.dag) of step nodes, with statuses and reasons. Pure over its inputs.

Each recipe's nodes are planned by the step kinds it is handed (qbuild.steps.registry.STEPS), in their order: each kind's
`plan` adds its nodes through a RecipePlanning, which names their inputs by role, merges equal work of several recipes
into one node, and records the recipe's roles. The backend a recipe names plans its own part first
(qbuild.planning.backend.PlanningBackend.plan): extra source nodes, the shard layout, the compile nodes and the
package; the step kinds of those nodes take them. Planning names and imports no backend: the caller passes the
registry of backends in, and the plan keeps it for its keys and explanations.

What planning needs of this machine (checkpoint files' digests, the commit a Hub branch resolves to, config.json)
comes through an `Environment` the caller passes in; the store and the lock come in as a lookup, the locked nodes, the
lock's Hub pins and the files it holds for pinned commits. A hub model's fetch is keyed on a commit: the recipe's own
where it names one, else the lock's pin, else what the Hub resolves now (docs/architecture.md section 4); where none
is known the fetch node is unresolved, has no key, and a build refuses to start.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Literal, Mapping, Protocol, Sequence

from qbuild.core.dtypes import DTYPE_BYTES
from qbuild.core.errors import InfraError, QbuildError, RecipeError, UserError
from qbuild.core.hashing import digest_json
from qbuild.model.arch import Arch
from qbuild.model.families import FAMILIES
from qbuild.planning.backend import BackendPlan, Backends, PlanningBackend, Sizes
from qbuild.planning.dag import Node, Plan, PlannedRecipe
from qbuild.planning.keys import LockedNode, as_locked, diff_preimages, walk
from qbuild.planning.step import LockedFiles, PlannedNode, Source, Step
from qbuild.model.sizes import weight_bytes
from qbuild.recipe import checks
from qbuild.recipe.params import FetchHub, to_json
from qbuild.recipe.schema import HFSource, LoadedRecipe, PathSource, recipe_field_location
from qbuild.core.hashing import is_commit
from qbuild.store.manifest import Manifest


class Environment(Protocol):
    """What the planner may know of the machine it plans on; it reads nothing else."""

    def arch(self, loaded: LoadedRecipe, commit: str | None = None) -> Arch:
        """The architecture of the recipe's model, from its config.json: a hub model's at `commit` (None: not
        resolved; then only a config that does not depend on this machine's caches may stand in)."""

    def checkpoint_digests(self, directory: Path) -> dict[str, str]:
        """File name -> "blake3:<hex>" of each file a build needs from a local checkpoint directory."""

    def hf_commit(self, repo: str, revision: str) -> str:
        """The commit the Hub resolves `revision` (a branch or tag) of `repo` to, asked once per command. Raises the
        reason it cannot: InfraError (offline, the Hub unreachable) or UserError (no such repo or revision). Never
        the local HF cache's refs: two machines must plan the same keys."""

    def port_digests(self, port_dir: Path) -> dict[str, str] | None:
        """Relative path -> "blake3:<hex>" of a port's source files (every .py, tests excluded); None where the
        directory does not exist."""


@dataclass(frozen=True)
class HubPin:
    """A recipe's hub model pinned to a commit in the lockfile, as uv or Cargo lock a version: the repo, the revision
    the recipe asks for (a branch, a tag or the commit itself) and the commit it was resolved to."""

    repo: str
    requested: str
    revision: str


@dataclass(frozen=True)
class HubRevision:
    """A hub model as planned: the commit its fetch is keyed on, or (commit None) why no commit is known."""

    repo: str
    requested: str                  # the recipe's revision: a branch, a tag or a commit
    commit: str | None
    unresolved: QbuildError | None = None


def resolve_hub(loaded: LoadedRecipe, env: Environment, pins: Mapping[str, HubPin] | None = None) -> HubRevision | None:
    """The commit a recipe's hub model is keyed on, in order: the recipe's revision where it is a full commit; the
    lock's pin for this recipe when it pins the same repo and revision (a build on another backend, locked as
    `<name>@<backend>`, takes its recipe's pin where it has none of its own); what the Hub resolves the revision to
    now. None for a local checkpoint."""
    src = loaded.recipe.model
    if not isinstance(src, HFSource):
        return None
    if is_commit(src.revision):
        return HubRevision(src.hf, src.revision, src.revision)
    pins = pins or {}
    pin = pins.get(loaded.name) or pins.get(loaded.name.partition("@")[0])
    if pin is not None and (pin.repo, pin.requested) == (src.hf, src.revision):
        return HubRevision(src.hf, src.revision, pin.revision)
    try:
        return HubRevision(src.hf, src.revision, env.hf_commit(src.hf, src.revision))
    except QbuildError as e:
        where = recipe_field_location(loaded, "model.hf")
        line = f"{where}: model.hf: {src.hf}@{src.revision} is not resolved ({e})"
        if isinstance(e, InfraError):
            return HubRevision(src.hf, src.revision, None, InfraError(
                f"{line}; pin a commit in the recipe or run 'qbuild lock update' online"))
        return HubRevision(src.hf, src.revision, None, UserError(line))


def require_resolved(plan: Plan) -> None:
    """Refuse a plan that has a node without a commit to key it on, with that node's one line (exit 3 where the Hub
    could not be asked, 2 where the recipe names what the Hub does not have)."""
    for node in plan.nodes.values():
        if node.unresolved is not None:
            raise type(node.unresolved)(str(node.unresolved))


# --- one recipe's part of the plan ---------------------------------------------------------------------------------

@dataclass
class RecipePlanning:
    """One recipe as its step kinds plan it: what they read (the recipe, its architecture, this machine, its hub
    revision, its backend's part of the plan, the sizes of its weights) and what they add (`add`). Every node of the
    plan is in `nodes`, shared with the recipes planned before."""

    loaded: LoadedRecipe
    arch: Arch
    env: Environment
    hub: HubRevision | None
    source: Source                  # where the recipe's model is on this machine
    backend: PlanningBackend
    backend_plan: BackendPlan
    sizes: Sizes
    runs: tuple[str, ...]           # the backend's implementation module: the code of a node that runs the backend
    layout_module: Callable[[str], str]     # a shard layout -> the module holding its rules
    steps: Mapping[str, type[Step]]
    nodes: dict[str, Node]
    keep_intermediates: bool = False
    roles: dict[str, str] = field(default_factory=dict)
    kept: str | None = None

    @property
    def name(self) -> str:
        return self.loaded.name

    @property
    def rule_modules(self) -> tuple[str, ...]:
        """The conversion rule modules the recipe's family runs (Family.rules): code of its convert and shard nodes."""
        return FAMILIES[self.arch.family].rule_modules()

    @property
    def model_label(self) -> str:
        """The recipe's model as a node's name shows it: the hub repo, or the local checkpoint directory's name."""
        model = self.loaded.recipe.model
        return model.hf if isinstance(model, HFSource) else Path(model.path).name

    def add(self, planned: PlannedNode) -> str:
        """The id of the node `planned` describes (its inputs' roles made ids), added to the plan unless an equal node
        is there (then this recipe is one more that needs it), and recorded under its role."""
        step = self.steps.get(planned.kind)
        if step is None:
            raise ValueError(f"{planned.name}: no step kind {planned.kind!r} is registered")
        if not isinstance(planned.params, step.params):
            raise TypeError(f"{planned.name}: params of type {type(planned.params).__name__}, where step kind "
                            f"{step.kind} takes {step.params}")
        deps = {name: self.roles[role] for name, role in planned.deps.items()}
        missing = [name for name in step.inputs if name not in deps]
        if missing:
            raise ValueError(f"{planned.name}: step kind {step.kind} takes the input {missing[0]!r}")
        node_id = digest_json({"kind": step.kind, "params": to_json(planned.params), "deps": deps,
                               "backend": planned.backend})[:16]
        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes[node_id] = Node(
                node_id, step, planned.name, planned.params, deps, planned.backend, planned.est_out_bytes,
                planned.est_peak_bytes, planned.source, resources=dict(planned.resources),
                unresolved=planned.unresolved, est_new_bytes=planned.est_new_bytes, code=planned.code)
        if self.name not in node.recipes:
            node.recipes.append(self.name)
        if planned.role is not None:
            self.roles[planned.role] = node_id
        return node_id

    def add_backend_nodes(self, step: type[Step], runs_backend: bool = True) -> None:
        """The nodes of kind `step` the recipe's backend planned (its sources, its compiles). Their keys hold the
        backend's implementation where they run it, else the module of their params (what a port's copy reads)."""
        for planned in self.backend_plan.nodes():
            if planned.kind == step.kind:
                code = self.runs if runs_backend else (type(planned.params).__module__,)
                self.add(replace(planned, backend=self.loaded.recipe.backend, code=code))

    def source_roles(self) -> dict[str, str]:
        """input name -> role of every source node the backend planned (a port): an input of the shard, package and
        verify nodes."""
        return {planned.role: planned.role for planned in self.backend_plan.sources}


def plan_recipe(nodes: dict[str, Node], loaded: LoadedRecipe, arch: Arch, env: Environment,
                hub: HubRevision | None = None, keep_intermediates: bool = False, *, backends: Backends,
                steps: Sequence[type[Step]], locked_files: Mapping[tuple[str, str], LockedFiles] | None = None,
                ) -> PlannedRecipe:
    """Add one recipe's nodes to `nodes`: its backend's part (from `backends`), then each step kind's, in the order of
    `steps`. `hub`: its model's resolved revision (resolve_hub; resolved here, without the lock's pins, when not
    given). `keep_intermediates` adds a node that materializes the converted weights, which nothing else reads: every
    other node's id and key are the same without it. `locked_files`: (repo, commit) -> the files the lock holds for
    that commit, which a fetch of it must give."""
    r = loaded.recipe
    backend = resolve_backend(loaded, backends)
    weights = weight_bytes(arch, r.dtype, r.fp8)
    vision_bytes = 0 if arch.vision is None else 12 * arch.vision.depth * arch.vision.hidden_size ** 2 * \
        DTYPE_BYTES[r.dtype]
    hub = hub or resolve_hub(loaded, env)
    if isinstance(r.model, PathSource):
        source = Source(path=str(loaded.source_dir))
    else:
        pinned = (locked_files or {}).get((hub.repo, hub.commit)) if hub.commit else None
        source = Source(requested_revision=hub.requested, locked_files=pinned)
    sizes = Sizes(weights, vision_bytes)
    rp = RecipePlanning(loaded, arch, env, hub, source, backend, backend.plan(loaded, arch, env, sizes), sizes,
                        (backends.implementation_module(r.backend),), backends.layout_module,
                        {step.kind: step for step in steps}, nodes, keep_intermediates)
    for step in steps:
        step.plan(rp)
    return PlannedRecipe(loaded, arch, dict(rp.roles), rp.roles["package"], rp.roles["verify"], rp.kept)


@dataclass(frozen=True)
class WrittenBytes:
    """What building a recipe writes beyond its source checkpoint (the HF cache or the local directory), against
    the model's size (its weights as the checkpoint stores them)."""
    model: int
    written: int

    @property
    def ratio(self) -> float:
        return self.written / self.model if self.model else 0.0


def written_bytes(plan: Plan, recipe: str) -> WrittenBytes:
    """The estimated bytes a build of `recipe` writes, every node it needs counted once (nodes it shares with other
    recipes included, as a build of it alone writes them; the materialized weights where kept), a bundle's links not
    at all."""
    pr = plan.recipes[recipe]
    fetch = pr.nodes["fetch"]
    ids = (set(pr.nodes.values()) | ({pr.kept} if pr.kept else set())) - {fetch}
    written = sum(plan.nodes[n].est_out_bytes if plan.nodes[n].est_new_bytes is None else plan.nodes[n].est_new_bytes
                  for n in ids)
    return WrittenBytes(plan.nodes[fetch].est_out_bytes, written)


def validate_recipe(loaded: LoadedRecipe, arch: Arch, backends: Backends) -> None:
    """Every check of a recipe against its architecture: the recipe layer's, then its backend's own."""
    checks.validate(loaded, arch)
    resolve_backend(loaded, backends).validate(loaded, arch)


def resolve_backend(loaded: LoadedRecipe, backends: Backends) -> PlanningBackend:
    """The backend a recipe names; RecipeError at the recipe's `backend:` for a name no backend has."""
    try:
        return backends.get(loaded.recipe.backend)
    except ValueError:
        raise RecipeError(f"{recipe_field_location(loaded, 'backend')}: backend: {loaded.recipe.backend!r} is not one "
                          f"of {', '.join(backends.NAMES)}") from None


def build_plan(recipes: list[LoadedRecipe], env: Environment, pins: Mapping[str, HubPin] | None = None,
               keep_intermediates: bool = False, *, backends: Backends, steps: Sequence[type[Step]],
               locked_files: Mapping[tuple[str, str], LockedFiles] | None = None) -> Plan:
    """Validate each recipe against its architecture and expand all of them into one deduplicated DAG, each recipe's
    nodes planned by the step kinds `steps` (qbuild.steps.registry.STEPS) and its own part by the backend it names in
    `backends`. `pins`: the lock's hub pins by recipe name, `locked_files`: the files the lock holds for each pinned
    commit (qbuild.planning.lock). `keep_intermediates`: see plan_recipe."""
    nodes: dict[str, Node] = {}
    planned: dict[str, PlannedRecipe] = {}
    for loaded in recipes:
        if loaded.name in planned:
            raise RecipeError(f"{loaded.path}: name: recipe name {loaded.name!r} is also used by "
                              f"{planned[loaded.name].loaded.path}")
        hub = resolve_hub(loaded, env, pins)
        try:
            arch = env.arch(loaded, hub.commit if hub else None)
        except QbuildError:
            if hub is None or hub.unresolved is None:
                raise
            # Without a commit there is no config.json to read but a shipped one: the reason is the missing commit.
            raise type(hub.unresolved)(str(hub.unresolved)) from None
        validate_recipe(loaded, arch, backends)
        planned[loaded.name] = plan_recipe(nodes, loaded, arch, env, hub, keep_intermediates, backends=backends,
                                           steps=steps, locked_files=locked_files)
    return Plan(nodes, planned, backends)


# --- statuses and reasons -------------------------------------------------------------------------------------

@dataclass
class NodeStatus:
    status: Literal["cached", "build", "waiting", "unresolved"]
    key: str | None
    preimage: dict | None
    manifest: Manifest | None
    why: str


def evaluate(plan: Plan, lookup: Callable[[str], Manifest | None],
             locked: Mapping[str, LockedNode]) -> dict[str, NodeStatus]:
    """Status of every node, keyed with the store's digests: `lookup(key)` reads the store, and `locked` (node id ->
    the lock's entry for it) says what changed since the lock was written."""
    manifests: dict[str, Manifest] = {}
    moved = _moved_pins(plan, locked)

    def from_store(nid: str, key: str) -> str | None:
        if plan.nodes[nid].unresolved is not None:
            return None     # keyed on a branch name only to have an id: no store entry may answer for it
        manifest = lookup(key)
        if manifest is None:
            return None
        manifests[nid] = manifest
        return manifest.digest

    result: dict[str, NodeStatus] = {}
    for nid, nk in walk(plan, from_store).items():
        pins = moved.get(nid, [])
        if plan.nodes[nid].unresolved is not None:
            result[nid] = NodeStatus("unresolved", None, None, None, str(plan.nodes[nid].unresolved))
        elif nk.key is None:
            result[nid] = NodeStatus("waiting", None, None, None,
                                     "; ".join([f"waits on {', '.join(nk.unknown)}", *pins]))
        elif nid in manifests:
            result[nid] = NodeStatus("cached", nk.key, nk.preimage, manifests[nid], "cached")
        else:
            entry = locked.get(nid)
            why = "no entry" if entry is None else \
                _what_changed(plan, nid, entry.preimage, nk.preimage, "not in the store", pins)
            result[nid] = NodeStatus("build", nk.key, nk.preimage, None, why)
    return result


def explain(plan: Plan, status: Mapping[str, NodeStatus], locked: Mapping[str, LockedNode]) -> dict[str, str]:
    """Why each node would rebuild, naming the changed fields at any depth. Below a miss an input's digest is
    unknown until it is built, so there the node is keyed with the lock's digests for it: what the node itself
    changed since the lock, whatever its inputs turn out to be."""
    def store_then_lock(nid: str, key: str) -> str | None:
        if plan.nodes[nid].unresolved is not None:
            return None
        manifest = status[nid].manifest
        if manifest is not None:
            return manifest.digest
        entry = locked.get(nid)
        return entry.digest if entry is not None else None

    keys = walk(plan, store_then_lock)
    out: dict[str, str] = {}
    for nid, st in status.items():
        entry, pre = locked.get(nid), keys[nid].preimage
        if st.status != "waiting" or pre is None:
            out[nid] = st.why
        elif entry is None:
            out[nid] = f"{st.why}; no entry"
        else:
            changed = _what_changed(plan, nid, entry.preimage, pre, "")
            out[nid] = f"{st.why}; {changed}" if changed else st.why
    return out


def _what_changed(plan: Plan, nid: str, old: dict, pre: dict, otherwise: str, pins: Sequence[str] = ()) -> str:
    """The hub pins that moved below the node (`pins`), the fields of `pre` that differ from the locked preimage `old`
    (`otherwise` where none does), and for a compile, what its backend can still reuse (a neuron text compile's
    NEFFs). A fetch's moved pin is its changed revision, so that field is named once, as the pin."""
    node = plan.nodes[nid]
    changed = diff_preimages(old, as_locked(pre))
    if pins and node.kind == "fetch":
        changed = [c for c in changed if not c.startswith("params.revision")]
    parts = [*pins, "; ".join(changed) or ("" if pins else otherwise)]
    if node.kind == "compile":
        parts.append(plan.backends.get(node.params.backend).explain_reuse(old["params"], node.params))
    return "; ".join(p for p in parts if p)


def _moved_pins(plan: Plan, locked: Mapping[str, LockedNode]) -> dict[str, list[str]]:
    """node id -> the hub pins below it whose commit differs from the one the lock's build was keyed on, as
    "model <repo>@<requested>: <old> -> <new>" (commits to 8 characters), for the nodes that rebuild because of them."""
    moved: dict[str, list[str]] = {}
    for nid, node in plan.nodes.items():          # topological: a node's inputs come first
        lines = [line for dep in node.deps.values() for line in moved.get(dep, [])]
        if node.kind == "fetch" and isinstance(node.params, FetchHub) and node.unresolved is None \
                and nid in locked:
            old = locked[nid].preimage.get("params", {})
            new = node.params.revision
            if old.get("source") == "hf" and old.get("repo") == node.params.repo and old.get("revision") != new:
                requested = (node.source.requested_revision if node.source else None) or new
                requested = requested[:12] if is_commit(requested) else requested
                lines.append(f"model {node.params.repo}@{requested}: {str(old.get('revision'))[:8]} -> {new[:8]}")
        if lines:
            moved[nid] = list(dict.fromkeys(lines))
    return moved
