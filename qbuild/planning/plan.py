"""The planner: recipes -> a DAG of action nodes with keys, statuses and reasons. Pure over its inputs.

A node's id is structural (its kind, params and the ids of its inputs), so equal work in two recipes is one
node: the tp4 and tp8 recipes of a model share fetch, convert and reference. A node's key is the content key of
DESIGN.md (qbuild.planning.keys); it is known once every input's output digest is known, that is once the upstream nodes
are cached or built.

What planning needs of this machine (checkpoint files' digests, the HF cache, config.json) comes through an
`Environment` the caller passes in; the store and the lock come in as a lookup and the locked nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Mapping, Protocol

from qbuild.model import arch as archmod
from qbuild.recipe import checks, ports
from qbuild.model.arch import Arch
from qbuild.core.dtypes import DTYPE_BYTES
from qbuild.core.hashing import digest_json
from qbuild.planning.keys import REGISTRY, Registry, as_locked, diff_preimages, walk
from qbuild.store.lock import LockedNode
from qbuild.recipe.schema import HFSource, LoadedRecipe, PathSource
from qbuild.store.manifest import Manifest

GIB = 1 << 30


class Environment(Protocol):
    """What the planner may know of the machine it plans on; it reads nothing else."""

    def arch(self, loaded: LoadedRecipe) -> Arch:
        """The architecture of the recipe's model, from its config.json."""

    def checkpoint_digests(self, directory: Path) -> dict[str, str]:
        """File name -> "blake3:<hex>" of each file a build needs from a local checkpoint directory."""

    def hf_revision(self, repo: str, revision: str) -> str | None:
        """The commit the local HF cache resolves `revision` of `repo` to; None where it is not cached."""

    def port_digests(self, port_dir: Path) -> dict[str, str] | None:
        """Relative path -> "blake3:<hex>" of a port's source files; None where the directory does not exist."""


@dataclass
class Node:
    id: str
    kind: str
    name: str                       # what a person reads: "compile cte-128", "fetch Qwen/Qwen3.5-2B"
    params: dict                    # the allow-listed inputs that enter the key
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

def _add(nodes: dict[str, Node], recipe: str, kind: str, name: str, params: dict, deps: dict[str, str],
         out: int, peak: int, context: dict | None = None, neuron_cores: int = 0, neffs: int = 0) -> str:
    node_id = digest_json({"kind": kind, "params": params, "deps": deps})[:16]
    node = nodes.get(node_id)
    if node is None:
        node = nodes[node_id] = Node(node_id, kind, name, params, deps, out, peak, dict(context or {}),
                                     neuron_cores=neuron_cores, neffs=neffs)
    if recipe not in node.recipes:
        node.recipes.append(recipe)
    return node_id


def _fetch_params(loaded: LoadedRecipe, env: Environment) -> tuple[dict, dict]:
    """(params, context) of the fetch node. A local dir is identified by its files' digests, never its path."""
    src = loaded.recipe.model
    if isinstance(src, PathSource):
        files = env.checkpoint_digests(loaded.source_dir)
        return {"source": "path", "files": files}, {"path": str(loaded.source_dir)}
    revision = env.hf_revision(src.hf, src.revision) or src.revision
    return {"source": "hf", "repo": src.hf, "revision": revision}, {"requested_revision": src.revision}


def _port_params(loaded: LoadedRecipe, env: Environment) -> tuple[dict, dict, str]:
    """(params, context, label) of the port node: the port is identified by its source files' digests."""
    port_dir = loaded.port_dir
    written = loaded.recipe.port.path or loaded.recipe.port.module
    files = None if port_dir is None else env.port_digests(port_dir)
    if files is None:
        # Planned anyway, so `plan` shows the whole graph; building it fails with one line saying where to put it.
        return {"missing": written}, {}, f"port {written} (not found)"
    return {"files": files}, {"path": str(port_dir)}, f"port {port_dir.name}"


def compile_params(loaded: LoadedRecipe, arch: Arch, graph: str, bucket: int) -> dict:
    """The allow-listed inputs of one CPU-compiled graph: architecture, parallelism, shapes and backend.

    Weight values never enter (a compile serves every fine-tune of an architecture). The text graphs do not
    depend on the vision encoder and the vision graphs do not depend on the text model or on tp.
    """
    r = loaded.recipe
    common = {"graph": graph, "bucket": bucket, "backend": r.backend, "dtype": r.dtype}
    if graph == "vision":
        return {**common, "vision": archmod.asdict(arch.vision)}
    text = arch.fingerprint()
    text.pop("vision")
    return {**common, "text": text, "tp": r.parallel.tp, "ep": r.parallel.ep,
            "moe_tp": r.parallel.effective_moe_tp if arch.is_moe else None,
            "batch_size": r.text.batch_size, "seq_len": r.text.seq_len, "fp8": r.fp8,
            "moe_backend": checks.moe_backend(loaded, arch), "fused_qkv": r.fused_qkv}


def neuron_text_params(loaded: LoadedRecipe, arch: Arch) -> dict:
    """The allow-listed inputs of a recipe's ONE neuron text compile (NxDI builds every CTE and TKG bucket of both
    submodels in one compile(): nxdi-api.md section 2). The toolchain is the recipe's pin, never what is installed,
    so every machine plans the same key."""
    from qbuild.backends.neuron import nxd_parallel

    r = loaded.recipe
    text = arch.fingerprint()
    text.pop("vision")
    lineage = ports.lineage_for(arch.family, r.port.lineage)
    return {"graph": "text", "backend": "neuron", "lineage": lineage.name, "text": text,
            "parallel": nxd_parallel(lineage.name, arch.is_moe, r.parallel.tp, r.parallel.ep),
            "batch_size": r.text.batch_size, "seq_len": r.text.seq_len,
            "cte_buckets": list(r.text.cte_buckets), "tkg_buckets": list(r.text.token_buckets),
            "dtype": r.dtype, "fp8": r.fp8, "moe_backend": checks.moe_backend(loaded, arch),
            "fused_qkv": r.fused_qkv, "compiler": _compiler(r), "toolchain": r.toolchain.pins(),
            "port_env": dict(sorted(r.port.env.items())),
            # A bundle with vision encoders needs a context-encoding graph that takes the image features.
            "vision_inputs": bool(r.vision and r.vision.buckets),
            # The ports' scripts pad with eos where the config names no pad token (run_text_smoke.py @ 4bcdc54).
            "pad_token_id": arch.pad_token_id if arch.pad_token_id is not None else arch.eos_token_id}


def neuron_vision_params(loaded: LoadedRecipe, arch: Arch, bucket: int) -> dict:
    """One traced vision encoder at one patch bucket (its weights are inlined: the node depends on them)."""
    r = loaded.recipe
    lineage = ports.lineage_for(arch.family, r.port.lineage)
    return {"graph": "vision", "bucket": bucket, "backend": "neuron", "lineage": lineage.name,
            "vision": archmod.asdict(arch.vision), "dtype": r.dtype, "compiler": _compiler(r),
            "toolchain": r.toolchain.pins(), "port_env": dict(sorted(r.port.env.items()))}


def _compiler(r) -> dict:
    return {"target": r.compiler.target, "lnc": r.compiler.effective_lnc, "flags": list(r.compiler.flags)}


def _largest_tensor_bytes(arch: Arch, dtype_bytes: int) -> int:
    emb = arch.vocab_size * arch.hidden_size
    experts = (arch.num_experts or 0) * 2 * (arch.moe_intermediate_size or 0) * arch.hidden_size
    return max(emb, experts) * dtype_bytes


def plan_recipe(nodes: dict[str, Node], loaded: LoadedRecipe, arch: Arch, env: Environment) -> PlannedRecipe:
    r, name = loaded.recipe, loaded.name
    neuron = r.backend == "neuron"
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
        {"family": arch.family, "dtype": r.dtype, "fp8": r.fp8}, {"snapshot": fetch},
        weights + vision_bytes, 3 * big + GIB // 2, fctx)
    port_dep: dict[str, str] = {}
    if neuron:
        pparams, pctx, plabel = _port_params(loaded, env)
        roles["port"] = _add(nodes, name, "port", plabel, pparams, {}, 1 << 20, GIB // 4, pctx)
        port_dep = {"port": roles["port"]}

    if neuron:
        lineage = ports.lineage_for(arch.family, r.port.lineage)
        par = neuron_text_params(loaded, arch)["parallel"]
        # One file per rank of NxD's world; every non-expert layer is split over tp_degree (dense_tp), which is
        # smaller than the world where ep_degree > 1 (qbuild.model.convert.nxd). A dense model has no moe_ep_degree
        # (None), and its shard step takes ep 1.
        shard_params = {"layout": lineage.shard_layout, "tp": par["world_size"],
                        "ep": par["moe_ep_degree"] if arch.is_moe else 1, "dense_tp": par["tp_degree"],
                        "moe_tp": par["moe_tp_degree"] if arch.is_moe else None, "fused_qkv": r.fused_qkv,
                        "pad_intermediate_to": None, "dtype": r.dtype}
        ranks = par["world_size"]
    else:
        shard_params = {"layout": "cpu", "tp": r.parallel.tp, "ep": r.parallel.ep,
                        "moe_tp": r.parallel.effective_moe_tp if arch.is_moe else None, "fused_qkv": r.fused_qkv,
                        "pad_intermediate_to": None}
        ranks = r.parallel.tp
    roles["shard"] = shard = _add(
        nodes, name, "shard", f"shard {'' if not neuron else shard_params['layout'] + ' '}tp{r.parallel.tp} "
                              f"ep{r.parallel.ep}", shard_params,
        {"converted": convert, **port_dep}, weights, 3 * big + GIB // 2)

    compile_ids = {}
    if neuron:
        params = neuron_text_params(loaded, arch)
        neffs = len(params["cte_buckets"]) + len(params["tkg_buckets"])
        # neuronx-cc runs on any host with the SDK: CPUs and memory, no device.
        compile_ids["compile text"] = _add(
            nodes, name, "compile", f"compile text ({neffs} NEFFs, neuron)", params, port_dep,
            64 << 20, 4 * weights // ranks + 8 * GIB, neffs=neffs)
        for b in (r.vision.buckets if r.vision else []):
            compile_ids[f"compile vision-{b}"] = _add(
                nodes, name, "compile", f"compile vision-{b} (neuron)", neuron_vision_params(loaded, arch, b),
                {**port_dep, "converted": convert}, 64 << 20, 4 * vision_bytes + 8 * GIB, neffs=1)
    else:
        graphs = [("cte", b) for b in r.text.cte_buckets] + [("tkg", b) for b in r.text.token_buckets]
        graphs += [("vision", b) for b in (r.vision.buckets if r.vision else [])]
        for graph, bucket in graphs:
            model_bytes = vision_bytes if graph == "vision" else weights
            compile_ids[f"compile {graph}-{bucket}"] = _add(
                nodes, name, "compile", f"compile {graph}-{bucket} ({r.backend})",
                compile_params(loaded, arch, graph, bucket), {}, 64 << 20, GIB + model_bytes)
    roles.update(compile_ids)
    deps = {"converted": convert, "shard": shard, **port_dep,
            **{role.replace(" ", ":"): nid for role, nid in compile_ids.items()}}
    package_params = {"family": arch.family, "backend": r.backend, "tp": r.parallel.tp, "ep": r.parallel.ep,
                      "ranks": ranks, "batch_size": r.text.batch_size, "seq_len": r.text.seq_len,
                      "cte_buckets": r.text.cte_buckets, "tkg_buckets": r.text.token_buckets,
                      "vision_buckets": r.vision.buckets if r.vision else [], "dtype": r.dtype}
    if neuron:
        package_params.update(lineage=lineage.name, fp8=r.fp8)
    roles["package"] = package = _add(
        nodes, name, "package", f"package {name}", package_params, deps,
        weights + vision_bytes + len(compile_ids) * (64 << 20), GIB // 2)
    v = r.verify
    roles["reference"] = reference = _add(
        nodes, name, "reference", f"reference {label}",
        {"prompts": v.prompts, "new_tokens": v.new_tokens, "image": bool(r.vision and v.image_prompt)},
        {"snapshot": fetch},
        4 << 20, checks.weight_bytes(arch, "float32", "none") + vision_bytes * 2 + GIB, fctx)
    # Verifying a neuron bundle runs it: every rank on a NeuronCore of one host.
    roles["verify"] = verify = _add(
        nodes, name, "verify", f"verify {name}",
        {"top1_min": v.top1_min, "token_match_min": v.token_match_min, "max_logit_err": v.max_logit_err},
        {"bundle": package, "reference": reference, **port_dep}, 1 << 20, 2 * weights + GIB,
        neuron_cores=ranks if neuron else 0)
    return PlannedRecipe(loaded, arch, roles, package, verify)


def build_plan(recipes: list[LoadedRecipe], env: Environment) -> Plan:
    """Validate each recipe against its architecture and expand all of them into one deduplicated DAG."""
    nodes: dict[str, Node] = {}
    planned: dict[str, PlannedRecipe] = {}
    for loaded in recipes:
        if loaded.name in planned:
            from qbuild.core.errors import RecipeError
            raise RecipeError(f"{loaded.path}: name: recipe name {loaded.name!r} is also used by "
                              f"{planned[loaded.name].loaded.path}")
        arch = env.arch(loaded)
        checks.validate(loaded, arch)
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
    neuron text compile, which NEFFs the compile can still reuse."""
    new = as_locked(pre)
    parts = ["; ".join(diff_preimages(old, new)) or otherwise]
    if node.kind == "compile" and node.params.get("graph") == "text" and node.params.get("backend") == "neuron":
        from qbuild.backends.neuron import neff_reuse

        parts.append(neff_reuse(old["params"], new["params"]))
    return "; ".join(p for p in parts if p)
