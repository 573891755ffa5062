"""The planner: recipes -> a DAG of action nodes with keys, statuses and reasons. Pure over its inputs.

A node's id is structural (its kind, params and the ids of its inputs), so equal work in two recipes is one
node: the tp4 and tp8 recipes of a model share fetch, convert and reference. A node's key is the content key of
docs/architecture.md (qbuild.planning.keys); it is known once every input's output digest is known, that is once the
upstream nodes are cached or built. The backend a recipe names plans its own part (qbuild.planning.steps.PlanningBackend
.plan): extra source nodes, the shard layout, the compile nodes and the package. Planning names and imports no
backend: the caller passes the registry of backends in (qbuild.planning.steps.Backends), and the plan keeps it for its
keys and explanations.

What planning needs of this machine (checkpoint files' digests, the commit a Hub branch resolves to, config.json)
comes through an `Environment` the caller passes in; the store and the lock come in as a lookup, the locked nodes and
the lock's Hub pins. A hub model's fetch is keyed on a commit: the recipe's own where it names one, else the lock's
pin, else what the Hub resolves now (docs/architecture.md section 4); where none is known the fetch node is
unresolved, has no key, and a build refuses to start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Mapping, Protocol, Sequence

from qbuild.core.dtypes import DTYPE_BYTES
from qbuild.core.errors import InfraError, QbuildError, RecipeError, UserError
from qbuild.core.hashing import digest_json
from qbuild.core.units import GIB
from qbuild.model.arch import Arch
from qbuild.planning.keys import REGISTRY, LockedNode, Registry, as_locked, diff_preimages, walk
from qbuild.planning.steps import Backends, PlanningBackend, PlannedStep, Sizes
from qbuild.recipe import checks
from qbuild.recipe.params import (ConvertParams, FetchHub, FetchParams, FetchPath, ReferenceParams, VerifyParams,
                                  to_json)
from qbuild.recipe.schema import HFSource, LoadedRecipe, PathSource, recipe_field_location
from qbuild.hub.hf import is_commit
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


@dataclass
class Node:
    """One step of the plan. `resources` are the devices the step runs on, by the name its backend gives them and an
    executor schedules them by (verifying a neuron bundle: {"neuron_cores": 8}); empty where any host runs it."""

    id: str
    kind: str
    name: str                       # what a person reads: "compile cte-128", "fetch Qwen/Qwen3.5-2B"
    params: object                  # the step's typed params (qbuild.recipe.params); their JSON enters the key
    deps: dict[str, str]            # input name -> node id
    backend: str | None             # the backend whose implementation the node runs (Backends.get), if any
    est_out_bytes: int
    est_peak_bytes: int
    context: dict = field(default_factory=dict)   # where things are on this machine; never in a key
    recipes: list[str] = field(default_factory=list)
    resources: dict[str, int] = field(default_factory=dict)     # devices it runs on; empty: any host
    unresolved: QbuildError | None = None   # why a hub fetch has no commit (so no key); None when it has one
    est_new_bytes: int | None = None    # what of its output no input holds (a package links them); None: all of it
    code: tuple[str, ...] = ()      # modules it runs beyond its action's entry (a backend's implementation, a shard
                                    # layout's rules): their import closures join its key (keys.ActionSpec.closure)

    @property
    def needs_device(self) -> bool:
        return any(self.resources.values())


@dataclass
class PlannedRecipe:
    loaded: LoadedRecipe
    arch: Arch
    nodes: dict[str, str]           # role ("fetch", "compile cte-128", "package", ...) -> node id
    bundle: str                     # id of the package node
    verify: str                     # id of the verify node
    kept: str | None = None         # id of the node materialising the converted weights (--keep-intermediates):
                                    # built on request, never locked, so no role names it


@dataclass
class Plan:
    nodes: dict[str, Node]          # in a topological order
    recipes: dict[str, PlannedRecipe]
    backends: Backends | None = None    # the registry it was planned with (None: a plan of no backend's nodes)

    def roles(self, node_id: str) -> list[tuple[str, str]]:
        return [(r, role) for r, pr in self.recipes.items() for role, nid in pr.nodes.items() if nid == node_id]


# --- building the graph ---------------------------------------------------------------------------------------

def _add(nodes: dict[str, Node], recipe: str, kind: str, name: str, params, deps: dict[str, str],
         out: int, peak: int, context: dict | None = None, resources: dict[str, int] | None = None,
         backend: str | None = None, unresolved: QbuildError | None = None, new: int | None = None,
         code: tuple[str, ...] = ()) -> str:
    """The id of the node of this kind, params, inputs and backend, added to `nodes` unless it is there (then the
    recipe is one more that needs it). `code`: the modules it runs beyond its action's entry (Node.code)."""
    node_id = digest_json({"kind": kind, "params": to_json(params), "deps": deps, "backend": backend})[:16]
    node = nodes.get(node_id)
    if node is None:
        node = nodes[node_id] = Node(node_id, kind, name, params, deps, backend, out, peak, dict(context or {}),
                                     resources=dict(resources or {}), unresolved=unresolved, est_new_bytes=new,
                                     code=code)
    if recipe not in node.recipes:
        node.recipes.append(recipe)
    return node_id


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


def _fetch_params(loaded: LoadedRecipe, env: Environment,
                  hub: HubRevision | None) -> tuple[FetchParams, dict, QbuildError | None]:
    """(params, context, why it has no key) of the fetch node. A local dir is identified by its files' digests, never
    its path; a hub model by its commit (the requested revision stands in, unkeyed, where none is known)."""
    src = loaded.recipe.model
    if isinstance(src, PathSource):
        return FetchPath("path", env.checkpoint_digests(loaded.source_dir)), {"path": str(loaded.source_dir)}, None
    assert hub is not None
    return (FetchHub("hf", hub.repo, hub.commit or hub.requested), {"requested_revision": hub.requested},
            hub.unresolved)


def require_resolved(plan: Plan) -> None:
    """Refuse a plan that has a node without a commit to key it on, with that node's one line (exit 3 where the Hub
    could not be asked, 2 where the recipe names what the Hub does not have)."""
    for node in plan.nodes.values():
        if node.unresolved is not None:
            raise type(node.unresolved)(str(node.unresolved))


# A description names each source tensor and each converted one (file, names, dtype, shape, byte range): about this
# many bytes of JSON per source tensor, counting the per-expert storage form's E tensors per projection.
_DESCRIBED_BYTES_PER_TENSOR = 256


def _description_bytes(arch: Arch) -> int:
    """About the size of a convert step's text/description.json (qbuild.model.convert.description)."""
    return (arch.num_layers * (24 + 3 * (arch.num_experts or 0)) + 8) * _DESCRIBED_BYTES_PER_TENSOR


def _largest_tensor_bytes(arch: Arch, dtype_bytes: int) -> int:
    emb = arch.vocab_size * arch.hidden_size
    experts = (arch.num_experts or 0) * 2 * (arch.moe_intermediate_size or 0) * arch.hidden_size
    return max(emb, experts) * dtype_bytes


def plan_recipe(nodes: dict[str, Node], loaded: LoadedRecipe, arch: Arch, env: Environment,
                hub: HubRevision | None = None, keep_intermediates: bool = False, *,
                backends: Backends) -> PlannedRecipe:
    """Add one recipe's nodes to `nodes`, with the backend `backends` gives for its name. `hub`: its model's resolved
    revision (resolve_hub; resolved here, without the lock's pins, when not given). `keep_intermediates` adds a node
    that materialises the converted weights, which nothing else reads: every other node's id and key are the same
    without it."""
    r, name = loaded.recipe, loaded.name
    backend = resolve_backend(loaded, backends)
    runs = (backends.implementation_module(r.backend),)      # what a node running the backend runs: its code
    dbytes = DTYPE_BYTES[r.dtype]
    weights = checks.weight_bytes(arch, r.dtype, r.fp8)
    vision_bytes = 0 if arch.vision is None else 12 * arch.vision.depth * arch.vision.hidden_size ** 2 * dbytes
    big = _largest_tensor_bytes(arch, 4)
    roles: dict[str, str] = {}

    fparams, fctx, unresolved = _fetch_params(loaded, env, hub or resolve_hub(loaded, env))
    label = r.model.hf if isinstance(r.model, HFSource) else Path(r.model.path).name
    roles["fetch"] = fetch = _add(nodes, name, "fetch", f"fetch {label}", fparams, {},
                                  checks.weight_bytes(arch, "bfloat16", "none") + vision_bytes, GIB // 4, fctx,
                                  unresolved=unresolved)
    # The text weights are described, not written (the shard step streams the checkpoint through the description);
    # the vision weights are written: the bundle ships them as they are.
    convert_params = ConvertParams(arch.family, r.dtype, r.fp8)
    roles["convert"] = convert = _add(
        nodes, name, "convert", f"convert {arch.family} {r.dtype} fp8={r.fp8}", convert_params, {"snapshot": fetch},
        _description_bytes(arch) + vision_bytes, 3 * _largest_vision_bytes(arch) + GIB // 2, fctx)
    kept = None if not keep_intermediates else _add(
        nodes, name, "materialize", f"materialize converted {arch.family} {r.dtype} fp8={r.fp8}", convert_params,
        {"converted": convert, "snapshot": fetch}, weights + vision_bytes, 3 * big + GIB // 2, fctx)
    bp = backend.plan(loaded, arch, env, Sizes(weights, vision_bytes))
    for step in bp.sources:
        roles[step.role] = _add_step(nodes, name, step, roles, r.backend, runs)
    # Every source node a backend adds (a port) is an input of the shard, package and verify steps.
    sources = {step.role: roles[step.role] for step in bp.sources}
    roles["shard"] = shard = _add(
        nodes, name, "shard", f"shard {bp.shard.layout} {bp.shard.ranks.describe()}", bp.shard,
        {"converted": convert, "snapshot": fetch, **sources}, weights, 3 * big + GIB // 2, fctx,
        code=(backends.layout_module(bp.shard.layout),))
    compile_ids = {step.role: _add_step(nodes, name, step, roles, r.backend, runs) for step in bp.compiles}
    roles.update(compile_ids)
    deps = {"converted": convert, "shard": shard, **sources,
            **{role.replace(" ", ":"): nid for role, nid in compile_ids.items()}}
    # A bundle links its weights and graphs from its inputs: what it writes itself is a manifest and configs.
    roles["package"] = package = _add(
        nodes, name, "package", f"package {name}", bp.package, deps,
        weights + vision_bytes + len(compile_ids) * (64 << 20), GIB // 2, backend=r.backend, new=1 << 20, code=runs)
    v = r.verify
    prompts = None if v.prompts is None else tuple(v.prompts)
    roles["reference"] = reference = _add(
        nodes, name, "reference", f"reference {label}",
        ReferenceParams(prompts, v.new_tokens, bool(r.vision and v.image_prompt)),
        {"snapshot": fetch}, 4 << 20, checks.weight_bytes(arch, "float32", "none") + vision_bytes * 2 + GIB, fctx)
    roles["verify"] = verify = _add(
        nodes, name, "verify", f"verify {name}", VerifyParams(v.top1_min, v.token_match_min, v.max_logit_err),
        {"bundle": package, "reference": reference, **sources}, 1 << 20,
        2 * weights + GIB + _run_bytes(loaded, arch), resources=bp.verify_resources, backend=r.backend, code=runs)
    return PlannedRecipe(loaded, arch, roles, package, verify, kept)


def _largest_vision_bytes(arch: Arch) -> int:
    """The largest vision tensor in float32 (the merger's fc1, or the position embedding)."""
    v = arch.vision
    if v is None:
        return 0
    return max(v.merged_hidden_size ** 2, v.num_position_embeddings * v.hidden_size,
               v.intermediate_size * v.hidden_size) * 4


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
    recipes included, as a build of it alone writes them; the materialised weights where kept), a bundle's links not
    at all."""
    pr = plan.recipes[recipe]
    fetch = pr.nodes["fetch"]
    ids = (set(pr.nodes.values()) | ({pr.kept} if pr.kept else set())) - {fetch}
    written = sum(plan.nodes[n].est_out_bytes if plan.nodes[n].est_new_bytes is None else plan.nodes[n].est_new_bytes
                  for n in ids)
    return WrittenBytes(plan.nodes[fetch].est_out_bytes, written)


def _run_bytes(loaded: LoadedRecipe, arch: Arch) -> int:
    """What running the bundle on the verify prompts holds beyond its weights, growing with the buckets: the host's
    KV cache of the largest token-generation bucket and the slice each decode graph gets of it, the prefill logits of
    the largest context bucket, and the verify image's pass through its vision bucket (the (1, 1, S, S) mask and
    each head's attention scores, with softmax's copy) (qbuild.model.runtime)."""
    r = loaded.recipe
    d, batch, tp = DTYPE_BYTES[r.dtype], r.text.batch_size, r.parallel.tp
    kv = 2 * arch.num_attn_layers * tp * batch * r.text.token_buckets[-1] * arch.per_rank(tp).kv_dim * d
    logits = batch * r.text.cte_buckets[-1] * arch.vocab_size * 4
    vision = 0
    if r.vision is not None and r.verify.image_prompt and arch.vision is not None:
        patches = checks.image_patches(arch.vision, *checks.VERIFY_IMAGE_SIZE)
        bucket = next((b for b in r.vision.buckets if b >= patches), r.vision.buckets[-1])
        vision = bucket * bucket * (d + 3 * 4 * arch.vision.num_heads)
    return 2 * kv + 2 * logits + vision


def _add_step(nodes: dict[str, Node], recipe: str, step: PlannedStep, roles: dict[str, str], backend: str,
              code: tuple[str, ...]) -> str:
    """A backend's node, its inputs named by the roles of nodes already planned."""
    deps = {name: roles[role] for name, role in step.deps.items()}
    return _add(nodes, recipe, step.kind, step.name, step.params, deps, step.est_out_bytes, step.est_peak_bytes,
                step.context, backend=backend, code=code)


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
               keep_intermediates: bool = False, *, backends: Backends) -> Plan:
    """Validate each recipe against its architecture and expand all of them into one deduplicated DAG, each recipe's
    own part planned by the backend it names in `backends`. `pins`: the lock's hub pins by recipe name
    (qbuild.planning.lock.Lock.hub_pins). `keep_intermediates`: see plan_recipe."""
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
        planned[loaded.name] = plan_recipe(nodes, loaded, arch, env, hub, keep_intermediates, backends=backends)
    return Plan(nodes, planned, backends)


# --- statuses and reasons -------------------------------------------------------------------------------------

@dataclass
class NodeStatus:
    status: Literal["cached", "build", "waiting", "unresolved"]
    key: str | None
    preimage: dict | None
    manifest: Manifest | None
    why: str


def evaluate(plan: Plan, lookup: Callable[[str], Manifest | None], locked: Mapping[str, LockedNode],
             registry: Registry = REGISTRY) -> dict[str, NodeStatus]:
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
    for nid, nk in walk(plan, from_store, registry).items():
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


def explain(plan: Plan, status: Mapping[str, NodeStatus], locked: Mapping[str, LockedNode],
            registry: Registry = REGISTRY) -> dict[str, str]:
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

    keys = walk(plan, store_then_lock, registry)
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
                requested = node.context.get("requested_revision", new)
                requested = requested[:12] if is_commit(requested) else requested
                lines.append(f"model {node.params.repo}@{requested}: {str(old.get('revision'))[:8]} -> {new[:8]}")
        if lines:
            moved[nid] = list(dict.fromkeys(lines))
    return moved
