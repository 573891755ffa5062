"""The checks of a recipe against its model's architecture, and the memory estimates they rest on.

Schema errors are qbuild.recipe.schema's; what is found here needs the Arch (qbuild.model.arch) as well: head counts that a
parallel degree must divide, the FP8 policies and port lineages a family takes (qbuild.model.families), and whether a rank
fits in device memory.
"""

from __future__ import annotations

from qbuild.model.arch import Arch
from qbuild.core.dtypes import DTYPE_BYTES
from qbuild.core.errors import RecipeError
from qbuild.model.families import FAMILIES
from qbuild.recipe.ports import lineage_for
from qbuild.recipe.schema import LoadedRecipe, recipe_field_location

# Device memory one rank (one logical NeuronCore) can use, by target and LNC.
_HBM_PER_RANK_GIB = {("trn2", 2): 24, ("trn2", 1): 12, ("trn1", 1): 16, ("trn1", 2): 32, ("inf2", 1): 16,
                     ("inf2", 2): 32}


def _fail(loaded: LoadedRecipe, field: str, msg: str) -> None:
    raise RecipeError(f"{recipe_field_location(loaded, field)}: {field}: {msg}")


def validate(loaded: LoadedRecipe, arch: Arch) -> None:
    """Raise RecipeError for the first recipe field the architecture cannot support."""
    r = loaded.recipe
    tp, ep = r.parallel.tp, r.parallel.ep
    if arch.num_heads % tp:
        _fail(loaded, "parallel.tp", f"tp={tp} does not divide the {arch.num_heads} attention heads")
    if tp > arch.num_kv_heads and tp % arch.num_kv_heads:
        _fail(loaded, "parallel.tp", f"tp={tp} is not a multiple of the {arch.num_kv_heads} KV heads "
                                     "(they are replicated when tp exceeds them)")
    if tp < arch.num_kv_heads and arch.num_kv_heads % tp:
        _fail(loaded, "parallel.tp", f"tp={tp} does not divide the {arch.num_kv_heads} KV heads")
    for heads, what in ((arch.num_k_heads, "DeltaNet key heads"), (arch.num_v_heads, "DeltaNet value heads")):
        if heads % tp:
            _fail(loaded, "parallel.tp", f"tp={tp} does not divide the {heads} {what}")
    if arch.is_moe:
        if arch.num_experts % ep:
            _fail(loaded, "parallel.ep", f"ep={ep} does not divide the {arch.num_experts} experts")
        moe_tp = r.parallel.effective_moe_tp
        if arch.moe_intermediate_size % moe_tp:
            _fail(loaded, "parallel.moe_tp", f"moe_tp={moe_tp} does not divide the expert intermediate size "
                                             f"{arch.moe_intermediate_size}")
    else:
        if ep != 1:
            _fail(loaded, "parallel.ep", f"ep={ep} needs an MoE model; {arch.family} is dense")
        if r.moe_backend is not None:
            _fail(loaded, "moe_backend", f"{arch.family} is dense and has no MoE backend")
        if arch.intermediate_size % tp:
            _fail(loaded, "parallel.tp", f"tp={tp} does not divide the MLP intermediate size {arch.intermediate_size}")
    policies = FAMILIES[arch.family].fp8_policies
    if r.fp8 not in policies:
        _fail(loaded, "fp8", f"{r.fp8!r} is not supported for {arch.family}; use one of {', '.join(policies)}")
    if r.vision is not None:
        if arch.vision is None:
            _fail(loaded, "vision", f"{arch.family} checkpoint has no vision encoder")
        merge = arch.vision.spatial_merge_size ** 2
        for i, b in enumerate(r.vision.buckets):
            if b % merge:
                _fail(loaded, f"vision.buckets.{i}", f"{b} patch tokens is not a multiple of {merge} "
                                                     "(the 2x2 spatial merge)")
    if arch.max_position_embeddings is not None and r.text.seq_len > arch.max_position_embeddings:
        _fail(loaded, "text.seq_len", f"{r.text.seq_len} exceeds the model's max_position_embeddings "
                                      f"{arch.max_position_embeddings}")
    est = rank_memory_bytes(loaded, arch)
    limit = _HBM_PER_RANK_GIB.get((r.compiler.target, r.compiler.effective_lnc))
    if limit is not None and est > limit << 30:
        _fail(loaded, "parallel.tp", f"needs ~{est / 2**30:.1f} GiB per rank (weights + KV cache + DeltaNet "
                                     f"state), over the {limit} GiB of a {r.compiler.target} LNC"
                                     f"{r.compiler.effective_lnc} rank; raise tp")
    if r.backend == "neuron":
        _validate_neuron(loaded, arch)


def _validate_neuron(loaded: LoadedRecipe, arch: Arch) -> None:
    """The checks that only a neuron build needs: a port that can serve the recipe, and a pinned toolchain."""
    r = loaded.recipe
    lineage, served_by = lineage_for(arch.family, r.port.lineage), FAMILIES[arch.family].port_lineages
    if lineage.name not in served_by:
        _fail(loaded, "port.lineage", f"the {lineage.name} lineage has no port for {arch.family}; use "
                                      f"{' or '.join(served_by)}")
    if r.port.path is None and r.port.module is None:
        _fail(loaded, "port", "a neuron build runs an NxDI contrib port: set port.path (the port directory, e.g. a "
                              "checkout of contrib/models/<Port>) or port.module")
    if r.fp8 == "full":
        _fail(loaded, "fp8", "a neuron build makes the FP8 port's mlp_only configuration (PR 173); full is for the "
                             "CPU backends")
    if r.fp8 != "none" and arch.is_moe:
        # The FP8 port is dense; NxD reads per-expert scales only as expert_wise_per_channel_symmetric, which no
        # public port configures.
        _fail(loaded, "fp8", f"no public NxDI port builds FP8 experts; {arch.family} builds with fp8: none on neuron")
    if r.vision is not None and lineage.vision_module is None:
        _fail(loaded, "vision", f"the {lineage.name}-lineage port has no vision encoder; drop vision or use main")
    if r.vision is not None and r.dtype != "bfloat16":
        # NeuronQwen35VisionModelWrapper casts every encoder input to bfloat16
        # (contrib/models/Qwen3.5-35B-A3B/src/modeling_qwen35_vision.py:790-820 @ 4bcdc54), so an encoder traced in
        # another dtype would be fed inputs it was not traced for.
        _fail(loaded, "dtype", f"the port's vision encoder runs in bfloat16; a neuron recipe with vision builds in "
                               f"bfloat16, not {r.dtype}")
    if r.parallel.ep > 1:
        # NxD's ExpertMLPsV2 refuses EP in selective-loading decode (it raises) (expert_mlps_v2.py @
        # fbac349; Qwen3.5-35B-A3B README). Coder-Next's README works around it with a patch of
        # ExpertMLPsV2.forward that is in no public commit of the port (PR 170 @ 753c7f5).
        _fail(loaded, "parallel.ep", f"no public {lineage.name}-lineage port runs expert parallelism in decode "
                                     "(NxD refuses it without an unpublished patch); use ep: 1")
    for dist, version in r.toolchain.pins().items():
        if version is None:
            _fail(loaded, "toolchain", f"a neuron build pins the Neuron SDK: set toolchain.{dist.replace('-', '_')} "
                                       "(see recipes/bases/trn2.yaml)")


def moe_backend(loaded: LoadedRecipe, arch: Arch) -> str | None:
    if not arch.is_moe:
        return None
    return loaded.recipe.moe_backend or FAMILIES[arch.family].default_moe_backend


def weight_bytes(arch: Arch, dtype: str, fp8: str) -> int:
    dense, experts = arch.param_counts()
    b = DTYPE_BYTES[dtype]
    # FP8 stores one byte per quantised weight; experts are the MLP weights of the MoE families.
    mlp_bytes = 1 if fp8 != "none" else b
    if arch.is_moe:
        return dense * b + experts * mlp_bytes
    mlp = 3 * arch.hidden_size * arch.intermediate_size * arch.num_layers
    return (dense - mlp) * b + mlp * mlp_bytes


def rank_memory_bytes(loaded: LoadedRecipe, arch: Arch) -> int:
    """Estimated device memory of one rank: its weight shard, its KV cache and its DeltaNet state."""
    r = loaded.recipe
    tp, b = r.parallel.tp, DTYPE_BYTES[r.dtype]
    weights = weight_bytes(arch, r.dtype, r.fp8) // tp
    rank = arch.per_rank(tp)
    kv = 2 * r.text.batch_size * r.text.seq_len * rank.kv_dim * b * arch.num_attn_layers
    n_delta = arch.num_layers - arch.num_attn_layers
    state = r.text.batch_size * n_delta * (rank.num_v_heads * arch.k_head_dim * arch.v_head_dim * 4
                                            + rank.conv_dim * (arch.conv_kernel - 1) * b)
    return weights + kv + state
