"""The planner: recipes -> a DAG of action nodes with keys, statuses and reasons. Pure over its inputs.

A node's id is structural (its kind, params and the ids of its inputs), so equal work in two recipes is one
node: the tp4 and tp8 recipes of a model share fetch, convert and reference. A node's key is the content key of
docs/architecture.md (qbuild.planning.keys); it is known once every input's output digest is known, that is once the
upstream nodes are cached or built. The backend a recipe names plans its own part (qbuild.backends.base.Backend.plan):
extra source nodes, the shard layout, the compile nodes and the package.

What planning needs of this machine (checkpoint files' digests, the HF cache, config.json) comes through an
`Environment` the caller passes in; the store and the lock come in as a lookup and the locked nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Mapping, Protocol

from qbuild import backends
from qbuild.backends.base import GIB, Backend, PlannedStep, Sizes
from qbuild.core.dtypes import DTYPE_BYTES
from qbuild.core.errors import RecipeError
from qbuild.core.hashing import digest_json
from qbuild.model.arch import Arch
from qbuild.planning.keys import REGISTRY, Registry, as_locked, diff_preimages, walk
from qbuild.recipe import checks
from qbuild.recipe.params import (ConvertParams, FetchHub, FetchParams, FetchPath, ReferenceParams, VerifyParams,
                                  to_json)
from qbuild.recipe.schema import HFSource, LoadedRecipe, PathSource, recipe_field_location
from qbuild.store.lock import LockedNode
from qbuild.store.manifest import Manifest


class Environment(Protocol):
    """What the planner may know of the machine it plans on; it reads nothing else."""

    def arch(self, loaded: LoadedRecipe) -> Arch:
        """The architecture of the recipe's model, from its config.json."""

    def checkpoint_digests(self, directory: Path) -> dict[str, str]:
        """File name -> "blake3:<hex>" of each file a build needs from a local checkpoint directory."""

    def hf_revision(self, repo: str, revision: str) -> str | None:
        """The commit the local HF cache resolves `revision` of `repo` to; None where it is not cached."""

    def port_digests(self, port_dir: Path) -> dict[str, str] | None:
        """Relative path -> "blake3:<hex>" of a port's source files (every .py, tests excluded); None where the
        directory does not exist."""


@dataclass
class Node:
    id: str
    kind: str
    name: str                       # what a person reads: "compile cte-128", "fetch Qwen/Qwen3.5-2B"
    params: object                  # the step's typed params (qbuild.recipe.params); their JSON enters the key
    deps: dict[str, str]            # input name -> node id
    est_out_bytes: int
    est_peak_bytes: int
    context: dict = field(default_factory=dict)   # where things are on this machine; never in a key
    recipes: list[str] = field(default_factory=list)
    neuron_cores: int = 0           # NeuronCores the step runs on (verifying a neuron bundle); 0: any host
    neffs: int = 0                  # NEFFs a neuron compile produces (one per bucket of each submodel)

    @property
    def needs_device(self) -> bool:
        return self.neuron_cores > 0


@dataclass
class PlannedRecipe:
    loaded: LoadedRecipe
    arch: Arch
    nodes: dict[str, str]           # role ("fetch", "compile cte-128", "package", ...) -> node id
    bundle: str                     # id of the package node
    verify: str                     # id of the verify node


@dataclass
class Plan:
    nodes: dict[str, Node]          # in a topological order
    recipes: dict[str, PlannedRecipe]

    def roles(self, node_id: str) -> list[tuple[str, str]]:
        return [(r, role) for r, pr in self.recipes.items() for role, nid in pr.nodes.items() if nid == node_id]


# --- building the graph ---------------------------------------------------------------------------------------

def _add(nodes: dict[str, Node], recipe: str, kind: str, name: str, params, deps: dict[str, str],
         out: int, peak: int, context: dict | None = None, neuron_cores: int = 0, neffs: int = 0) -> str:
    node_id = digest_json({"kind": kind, "params": to_json(params), "deps": deps})[:16]
    node = nodes.get(node_id)
    if node is None:
        node = nodes[node_id] = Node(node_id, kind, name, params, deps, out, peak, dict(context or {}),
                                     neuron_cores=neuron_cores, neffs=neffs)
    if recipe not in node.recipes:
        node.recipes.append(recipe)
    return node_id


def _fetch_params(loaded: LoadedRecipe, env: Environment) -> tuple[FetchParams, dict]:
    """(params, context) of the fetch node. A local dir is identified by its files' digests, never its path."""
    src = loaded.recipe.model
    if isinstance(src, PathSource):
        return FetchPath("path", env.checkpoint_digests(loaded.source_dir)), {"path": str(loaded.source_dir)}
    revision = env.hf_revision(src.hf, src.revision) or src.revision
    return FetchHub("hf", src.hf, revision), {"requested_revision": src.revision}


def _largest_tensor_bytes(arch: Arch, dtype_bytes: int) -> int:
    emb = arch.vocab_size * arch.hidden_size
    experts = (arch.num_experts or 0) * 2 * (arch.moe_intermediate_size or 0) * arch.hidden_size
    return max(emb, experts) * dtype_bytes


def plan_recipe(nodes: dict[str, Node], loaded: LoadedRecipe, arch: Arch, env: Environment) -> PlannedRecipe:
    r, name = loaded.recipe, loaded.name
    backend = resolve_backend(loaded)
    dbytes = DTYPE_BYTES[r.dtype]
    weights = checks.weight_bytes(arch, r.dtype, r.fp8)
    vision_bytes = 0 if arch.vision is None else 12 * arch.vision.depth * arch.vision.hidden_size ** 2 * dbytes
    big = _largest_tensor_bytes(arch, 4)
    roles: dict[str, str] = {}

    fparams, fctx = _fetch_params(loaded, env)
    label = r.model.hf if isinstance(r.model, HFSource) else Path(r.model.path).name
    roles["fetch"] = fetch = _add(nodes, name, "fetch", f"fetch {label}", fparams, {},
                                  checks.weight_bytes(arch, "bfloat16", "none") + vision_bytes, GIB // 4, fctx)
    roles["convert"] = convert = _add(
        nodes, name, "convert", f"convert {arch.family} {r.dtype} fp8={r.fp8}",
        ConvertParams(arch.family, r.dtype, r.fp8), {"snapshot": fetch}, weights + vision_bytes, 3 * big + GIB // 2,
        fctx)
    bp = backend.plan(loaded, arch, env, Sizes(weights, vision_bytes))
    for step in bp.sources:
        roles[step.role] = _add_step(nodes, name, step, roles)
    # Every source node a backend adds (a port) is an input of the shard, package and verify steps.
    sources = {step.role: roles[step.role] for step in bp.sources}
    shard_label = "" if bp.shard.layout == "cpu" else bp.shard.layout + " "
    roles["shard"] = shard = _add(
        nodes, name, "shard", f"shard {shard_label}tp{r.parallel.tp} ep{r.parallel.ep}", bp.shard,
        {"converted": convert, **sources}, weights, 3 * big + GIB // 2)
    compile_ids = {step.role: _add_step(nodes, name, step, roles) for step in bp.compiles}
    roles.update(compile_ids)
    deps = {"converted": convert, "shard": shard, **sources,
            **{role.replace(" ", ":"): nid for role, nid in compile_ids.items()}}
    roles["package"] = package = _add(
        nodes, name, "package", f"package {name}", bp.package, deps,
        weights + vision_bytes + len(compile_ids) * (64 << 20), GIB // 2)
    v = r.verify
    prompts = None if v.prompts is None else tuple(v.prompts)
    roles["reference"] = reference = _add(
        nodes, name, "reference", f"reference {label}",
        ReferenceParams(prompts, v.new_tokens, bool(r.vision and v.image_prompt)),
        {"snapshot": fetch}, 4 << 20, checks.weight_bytes(arch, "float32", "none") + vision_bytes * 2 + GIB, fctx)
    roles["verify"] = verify = _add(
        nodes, name, "verify", f"verify {name}", VerifyParams(v.top1_min, v.token_match_min, v.max_logit_err),
        {"bundle": package, "reference": reference, **sources}, 1 << 20,
        2 * weights + GIB + _run_bytes(loaded, arch), neuron_cores=bp.verify_cores)
    return PlannedRecipe(loaded, arch, roles, package, verify)


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


def _add_step(nodes: dict[str, Node], recipe: str, step: PlannedStep, roles: dict[str, str]) -> str:
    """A backend's node, its inputs named by the roles of nodes already planned."""
    deps = {name: roles[role] for name, role in step.deps.items()}
    return _add(nodes, recipe, step.kind, step.name, step.params, deps, step.est_out_bytes, step.est_peak_bytes,
                step.context, neffs=step.neffs)


def validate_recipe(loaded: LoadedRecipe, arch: Arch) -> None:
    """Every check of a recipe against its architecture: the recipe layer's, then its backend's own."""
    checks.validate(loaded, arch)
    resolve_backend(loaded).validate(loaded, arch)


def resolve_backend(loaded: LoadedRecipe) -> Backend:
    """The backend a recipe names; RecipeError at the recipe's `backend:` for a name no backend has."""
    try:
        return backends.get(loaded.recipe.backend)
    except ValueError:
        raise RecipeError(f"{recipe_field_location(loaded, 'backend')}: backend: {loaded.recipe.backend!r} is not one "
                          f"of {', '.join(backends.NAMES)}") from None


def build_plan(recipes: list[LoadedRecipe], env: Environment) -> Plan:
    """Validate each recipe against its architecture and expand all of them into one deduplicated DAG."""
    nodes: dict[str, Node] = {}
    planned: dict[str, PlannedRecipe] = {}
    for loaded in recipes:
        if loaded.name in planned:
            raise RecipeError(f"{loaded.path}: name: recipe name {loaded.name!r} is also used by "
                              f"{planned[loaded.name].loaded.path}")
        arch = env.arch(loaded)
        validate_recipe(loaded, arch)
        planned[loaded.name] = plan_recipe(nodes, loaded, arch, env)
    return Plan(nodes, planned)


# --- statuses and reasons -------------------------------------------------------------------------------------

@dataclass
class NodeStatus:
    status: Literal["cached", "build", "waiting"]
    key: str | None
    preimage: dict | None
    manifest: Manifest | None
    why: str


def evaluate(plan: Plan, lookup: Callable[[str], Manifest | None], locked: Mapping[str, LockedNode],
             registry: Registry = REGISTRY) -> dict[str, NodeStatus]:
    """Status of every node, keyed with the store's digests: `lookup(key)` reads the store, and `locked` (node id ->
    the lock's entry for it) says what changed since the lock was written."""
    manifests: dict[str, Manifest] = {}

    def from_store(nid: str, key: str) -> str | None:
        manifest = lookup(key)
        if manifest is None:
            return None
        manifests[nid] = manifest
        return manifest.digest

    result: dict[str, NodeStatus] = {}
    for nid, nk in walk(plan, from_store, registry).items():
        if nk.key is None:
            result[nid] = NodeStatus("waiting", None, None, None, f"waits on {', '.join(nk.unknown)}")
        elif nid in manifests:
            result[nid] = NodeStatus("cached", nk.key, nk.preimage, manifests[nid], "cached")
        else:
            entry = locked.get(nid)
            why = "no entry" if entry is None else \
                _what_changed(plan.nodes[nid], entry.preimage, nk.preimage, "not in the store")
            result[nid] = NodeStatus("build", nk.key, nk.preimage, None, why)
    return result


def explain(plan: Plan, status: Mapping[str, NodeStatus], locked: Mapping[str, LockedNode],
            registry: Registry = REGISTRY) -> dict[str, str]:
    """Why each node would rebuild, naming the changed fields at any depth. Below a miss an input's digest is
    unknown until it is built, so there the node is keyed with the lock's digests for it: what the node itself
    changed since the lock, whatever its inputs turn out to be."""
    def store_then_lock(nid: str, key: str) -> str | None:
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
            changed = _what_changed(plan.nodes[nid], entry.preimage, pre, "")
            out[nid] = f"{st.why}; {changed}" if changed else st.why
    return out


def _what_changed(node: Node, old: dict, pre: dict, otherwise: str) -> str:
    """The fields of `pre` that differ from the locked preimage `old` (`otherwise` where none does), and for a
    compile, what its backend can still reuse (a neuron text compile's NEFFs)."""
    parts = ["; ".join(diff_preimages(old, as_locked(pre))) or otherwise]
    if node.kind == "compile":
        parts.append(backends.get(node.params.backend).explain_reuse(old["params"], node.params))
    return "; ".join(p for p in parts if p)
