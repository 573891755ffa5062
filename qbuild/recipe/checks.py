"""The checks of a recipe against its model's architecture, and the memory estimates they rest on.

Schema errors are qbuild.recipe.schema's; what is found here needs the Arch (qbuild.model.arch) as well: head counts that a
parallel degree must divide, the FP8 policies a family takes (qbuild.model.families), and whether a rank fits in device
memory. What only one backend needs is that backend's own check (qbuild.backends.base.Backend.validate).
"""

from __future__ import annotations

from qbuild.model.arch import Arch
from qbuild.core.dtypes import DTYPE_BYTES
from qbuild.core.errors import RecipeError
from qbuild.model.families import FAMILIES
from qbuild.model.fp8 import policy as fp8_policy
from qbuild.recipe.schema import LoadedRecipe, recipe_field_location

# Device memory one rank (one logical NeuronCore) can use, by target and LNC.
_HBM_PER_RANK_GIB = {("trn2", 2): 24, ("trn2", 1): 12, ("trn1", 1): 16, ("trn1", 2): 32, ("inf2", 1): 16,
                     ("inf2", 2): 32}


def fail(loaded: LoadedRecipe, field: str, msg: str) -> None:
    raise RecipeError(f"{recipe_field_location(loaded, field)}: {field}: {msg}")


def validate(loaded: LoadedRecipe, arch: Arch) -> None:
    """Raise RecipeError for the first recipe field the architecture cannot support."""
    r = loaded.recipe
    tp, ep = r.parallel.tp, r.parallel.ep
    if arch.num_heads % tp:
        fail(loaded, "parallel.tp", f"tp={tp} does not divide the {arch.num_heads} attention heads")
    if tp > arch.num_kv_heads and tp % arch.num_kv_heads:
        fail(loaded, "parallel.tp", f"tp={tp} is not a multiple of the {arch.num_kv_heads} KV heads "
                                     "(they are replicated when tp exceeds them)")
    if tp < arch.num_kv_heads and arch.num_kv_heads % tp:
        fail(loaded, "parallel.tp", f"tp={tp} does not divide the {arch.num_kv_heads} KV heads")
    for heads, what in ((arch.num_k_heads, "DeltaNet key heads"), (arch.num_v_heads, "DeltaNet value heads")):
        if heads % tp:
            fail(loaded, "parallel.tp", f"tp={tp} does not divide the {heads} {what}")
    if arch.is_moe:
        if arch.num_experts % ep:
            fail(loaded, "parallel.ep", f"ep={ep} does not divide the {arch.num_experts} experts")
        moe_tp = r.parallel.effective_moe_tp
        if arch.moe_intermediate_size % moe_tp:
            fail(loaded, "parallel.moe_tp", f"moe_tp={moe_tp} does not divide the expert intermediate size "
                                             f"{arch.moe_intermediate_size}")
    else:
        if ep != 1:
            fail(loaded, "parallel.ep", f"ep={ep} needs an MoE model; {arch.family} is dense")
        if r.moe_backend is not None:
            fail(loaded, "moe_backend", f"{arch.family} is dense and has no MoE backend")
        if arch.intermediate_size % tp:
            fail(loaded, "parallel.tp", f"tp={tp} does not divide the MLP intermediate size {arch.intermediate_size}")
    policies = FAMILIES[arch.family].fp8_policies
    if r.fp8 not in policies:
        fail(loaded, "fp8", f"{r.fp8!r} is not supported for {arch.family}; use one of {', '.join(policies)}")
    if r.vision is not None:
        if arch.vision is None:
            fail(loaded, "vision", f"{arch.family} checkpoint has no vision encoder")
        merge = arch.vision.spatial_merge_size ** 2
        for i, b in enumerate(r.vision.buckets):
            if b % merge:
                fail(loaded, f"vision.buckets.{i}", f"{b} patch tokens is not a multiple of {merge} "
                                                     "(the 2x2 spatial merge)")
    if arch.max_position_embeddings is not None and r.text.seq_len > arch.max_position_embeddings:
        fail(loaded, "text.seq_len", f"{r.text.seq_len} exceeds the model's max_position_embeddings "
                                      f"{arch.max_position_embeddings}")
    est = rank_memory_bytes(loaded, arch)
    limit = _HBM_PER_RANK_GIB.get((r.compiler.target, r.compiler.effective_lnc))
    if limit is not None and est > limit << 30:
        fail(loaded, "parallel.tp", f"needs ~{est / 2**30:.1f} GiB per rank (weights + KV cache + DeltaNet "
                                     f"state), over the {limit} GiB of a {r.compiler.target} LNC"
                                     f"{r.compiler.effective_lnc} rank; raise tp")


def moe_backend(loaded: LoadedRecipe, arch: Arch) -> str | None:
    if not arch.is_moe:
        return None
    return loaded.recipe.moe_backend or FAMILIES[arch.family].default_moe_backend


def weight_bytes(arch: Arch, dtype: str, fp8: str) -> int:
    dense, experts = arch.param_counts()
    b = DTYPE_BYTES[dtype]
    # Experts are the MLP weights of the MoE families.
    mlp_bytes = fp8_policy(fp8).mlp_bytes(b)
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
