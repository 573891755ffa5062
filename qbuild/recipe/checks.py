"""The checks of a recipe against its model's architecture, and the memory estimates they rest on.

Schema errors are qbuild.recipe.schema's; what is found here needs the Arch (qbuild.model.arch) as well: head counts that a
parallel degree must divide, the FP8 policies a family takes (qbuild.model.families), and whether a rank fits in device
memory. What only one backend needs is that backend's own check (qbuild.backends.base.Backend.validate).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from qbuild.model.arch import Arch
from qbuild.core.dtypes import DTYPE_BYTES
from qbuild.core.errors import RecipeError
from qbuild.model.families import FAMILIES
from qbuild.model.sizes import VERIFY_IMAGE_SIZE, image_patches, weight_bytes
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
        moe_tp = r.parallel.moe_tp
        if arch.moe_intermediate_size % moe_tp:
            fail(loaded, "parallel.ep", f"tp / ep = {moe_tp} ranks per expert group do not divide the expert "
                                        f"intermediate size {arch.moe_intermediate_size}")
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
        if problem := arch.vision.tp_problem(r.vision.tp):
            fail(loaded, "vision.tp", problem)
        context = r.text.cte_buckets[-1]
        for i, b in enumerate(r.vision.buckets):
            # The encoder turns a bucket of patch tokens into bucket / merge**2 image tokens, which enter the prompt
            # between <|vision_start|> and <|vision_end|> and go through one context-encoding graph
            # (qbuild.model.modeling.vision, docs/models.md section 2).
            if b // merge + 2 > context:
                fit = (context - 2) * merge
                fail(loaded, f"vision.buckets.{i}",
                     f"{b} patch tokens merge to {b // merge} image tokens ({b // merge + 2} with <|vision_start|> "
                     f"and <|vision_end|>), more than the largest context-encoding bucket {context} holds: an image "
                     f"that fills this bucket can never be prompted; use vision buckets of at most {fit} patch "
                     f"tokens, or a larger text.cte_buckets")
    if arch.max_position_embeddings is not None and r.text.seq_len > arch.max_position_embeddings:
        fail(loaded, "text.seq_len", f"{r.text.seq_len} exceeds the model's max_position_embeddings "
                                      f"{arch.max_position_embeddings}")
    _check_long_context(loaded)
    _check_verify_fits(loaded, arch)
    _check_memory(loaded, arch)


def _check_memory(loaded: LoadedRecipe, arch: Arch) -> None:
    """One rank's estimate within its device memory; where the prefix cache's blocks and checkpoint slots are what
    pushes it over, the error names them."""
    r = loaded.recipe
    limit = _HBM_PER_RANK_GIB.get((r.compiler.target, r.compiler.effective_lnc))
    est = rank_memory_bytes(loaded, arch)
    if limit is None or est <= limit << 30:
        return
    cache = prefix_cache_bytes(loaded, arch)
    where = f"over the {limit} GiB of a {r.compiler.target} LNC{r.compiler.effective_lnc} rank"
    if cache and est - cache <= limit << 30:
        fail(loaded, "text.prefix_cache.num_blocks",
             f"{r.text.num_blocks} KV blocks of {r.text.prefix_cache.block_size} tokens and "
             f"{r.text.prefix_cache.checkpoint_slots} DeltaNet checkpoint slots need ~{cache / 2**30:.1f} GiB per "
             f"rank, which brings it to ~{est / 2**30:.1f} GiB, {where}; use fewer blocks or slots, or raise tp")
    fail(loaded, "parallel.tp", f"needs ~{est / 2**30:.1f} GiB per rank (weights + KV cache + DeltaNet "
                                 f"state), {where}; raise tp")


def _check_long_context(loaded: LoadedRecipe) -> None:
    """Chunked prefill and the prefix cache against the buckets: a chunk is a compiled context-encoding bucket; the
    KV length is whole chunks and whole blocks (the last chunk of a prompt may end at it); a DeltaNet checkpoint
    lies on a block boundary (the KV before it is whole blocks) and on a chunk boundary (a prefill resumed there runs
    the chunks a cold one ran from there; with checkpoints closer than the chunk, prefill runs chunks of the
    checkpoint interval); the blocks hold at least batch_size sequences of seq_len (NxDI's block KV cache is these
    blocks, and the Qwen3.6-27B port asks for as many)."""
    t = loaded.recipe.text
    kv, kv_field = t.token_buckets[-1], "text.tkg_buckets" if t.tkg_buckets else "text.seq_len"
    if t.prefix_cache is not None and t.chunked_prefill is None:
        fail(loaded, "text.prefix_cache", "needs text.chunked_prefill: a prefill resumed from a cached prefix "
                                          "continues chunk by chunk")
    if t.chunked_prefill is None:
        return
    chunk = t.chunk_size
    if chunk not in t.cte_buckets:
        fail(loaded, "text.chunked_prefill.chunk_size", f"{chunk} is not one of the context-encoding buckets "
                                                         f"{t.cte_buckets}: a chunk runs through a compiled bucket")
    if kv % chunk:
        fail(loaded, kv_field, f"the KV length {kv} is not a multiple of the prefill chunk {chunk}: the last chunk "
                               f"of a prompt would run past the cache")
    cache = t.prefix_cache
    if cache is None:
        return
    block, interval = cache.block_size, t.checkpoint_interval
    if kv % block:
        fail(loaded, "text.prefix_cache.block_size", f"{block} does not divide the KV length {kv}")
    if interval % block:
        fail(loaded, "text.prefix_cache.checkpoint_interval", f"{interval} is not a multiple of block_size {block}: "
                                                               "a checkpoint must lie on a block boundary")
    if interval % chunk and chunk % interval:
        fail(loaded, "text.prefix_cache.checkpoint_interval", f"{interval} and the prefill chunk {chunk}: one must "
                                                               "be a multiple of the other, so that every "
                                                               "checkpoint is a chunk boundary")
    least = -(-t.seq_len // block) * t.batch_size   # the port's _pa_min_blocks (docs/long-context.md)
    if t.num_blocks < least:
        fail(loaded, "text.prefix_cache.num_blocks", f"{t.num_blocks} blocks of {block} tokens hold less than "
                                                      f"{t.batch_size} sequence(s) of seq_len {t.seq_len}; give at "
                                                      f"least {least}")


def moe_backend(loaded: LoadedRecipe, arch: Arch) -> str | None:
    if not arch.is_moe:
        return None
    return loaded.recipe.moe_backend or FAMILIES[arch.family].default_moe_backend


def _kv_bytes_per_token(loaded: LoadedRecipe, arch: Arch) -> int:
    """One token's attention K and V on one rank, over every attention layer."""
    r = loaded.recipe
    return 2 * arch.per_rank(r.parallel.tp).kv_dim * DTYPE_BYTES[r.dtype] * arch.num_attn_layers


def _deltanet_state_bytes(loaded: LoadedRecipe, arch: Arch) -> int:
    """One sequence's DeltaNet state on one rank: the float32 recurrent state and the conv state of every layer."""
    r = loaded.recipe
    rank = arch.per_rank(r.parallel.tp)
    n_delta = arch.num_layers - arch.num_attn_layers
    return n_delta * (rank.num_v_heads * arch.k_head_dim * arch.v_head_dim * 4
                      + rank.conv_dim * (arch.conv_kernel - 1) * DTYPE_BYTES[r.dtype])


def prefix_cache_bytes(loaded: LoadedRecipe, arch: Arch) -> int:
    """What the prefix cache adds to one rank: the KV blocks beyond the contiguous cache they replace (NxDI's block
    layout holds every sequence in them) and the DeltaNet checkpoint slots. 0 without a prefix cache."""
    t = loaded.recipe.text
    if t.prefix_cache is None:
        return 0
    extra_tokens = max(0, t.num_blocks * t.prefix_cache.block_size - t.batch_size * t.seq_len)
    return (extra_tokens * _kv_bytes_per_token(loaded, arch)
            + t.prefix_cache.checkpoint_slots * _deltanet_state_bytes(loaded, arch))


def rank_memory_bytes(loaded: LoadedRecipe, arch: Arch) -> int:
    """Estimated device memory of one rank: its weight shard, its KV cache, its DeltaNet state and the prefix
    cache's blocks and checkpoint slots."""
    r = loaded.recipe
    weights = weight_bytes(arch, r.dtype, r.fp8) // r.parallel.tp
    kv = r.text.batch_size * r.text.seq_len * _kv_bytes_per_token(loaded, arch)
    state = r.text.batch_size * _deltanet_state_bytes(loaded, arch)
    return weights + kv + state + prefix_cache_bytes(loaded, arch)


# --- what the verify step will feed the bundle -------------------------------------------------------------------

GOLDEN_PROMPTS = Path(__file__).resolve().parents[1] / "golden" / "prompts.json"


@cache
def golden_prompts() -> dict:
    """The shipped verify prompts (qbuild/golden/prompts.json): {"prompts": [...], "image_prompt": str}."""
    return json.loads(GOLDEN_PROMPTS.read_text())


def min_prompt_tokens(text: str) -> int:
    """A lower bound on the tokens a Qwen tokenizer makes of `text`: one per whitespace-separated word. Qwen's
    byte-level BPE pre-tokenizer splits the text before merging, and no piece it makes holds whitespace between two
    non-space characters, so no token spans two words. Exact counts need the checkpoint's tokenizer, which planning
    does not load."""
    return max(1, len(text.split()))


def _check_verify_fits(loaded: LoadedRecipe, arch: Arch) -> None:
    """The verify step runs every verify prompt through the bundle and generates `verify.new_tokens` after it: the
    prompt must fit the largest context-encoding bucket (without chunked prefill), and prompt + new_tokens - 1
    positions the largest token-generation bucket (qbuild.model.runtime Runtime.generate; NxDI's max_length is
    seq_len, which bounds the token-generation buckets). Prompt lengths are lower bounds (min_prompt_tokens), so a
    recipe refused here cannot verify; a recipe passed may still meet a longer prompt than the bound."""
    r, v = loaded.recipe, loaded.recipe.verify
    golden = golden_prompts()
    field = "verify.prompts" if v.prompts else "text.cte_buckets"
    prompts = [(min_prompt_tokens(p), repr(p if len(p) <= 60 else p[:57] + "..."), field)
               for p in (v.prompts or golden["prompts"])]
    if r.vision is not None and v.image_prompt and arch.vision is not None:
        patches = image_patches(arch.vision, *VERIFY_IMAGE_SIZE)
        if patches > r.vision.buckets[-1]:
            fail(loaded, "vision.buckets", f"the verify image ({VERIFY_IMAGE_SIZE[1]}x{VERIFY_IMAGE_SIZE[0]} pixels) "
                                           f"is {patches} patch tokens, more than the largest vision bucket "
                                           f"{r.vision.buckets[-1]}; add a bucket of at least {patches} or set "
                                           "verify.image_prompt: false")
        image = patches // arch.vision.spatial_merge_size ** 2 + 2
        prompts.append((image + min_prompt_tokens(golden["image_prompt"]),
                        f"{golden['image_prompt']!r} with the verify image ({image} tokens)", "text.cte_buckets"))
    tokens, what, where = max(prompts, key=lambda p: p[0])
    context, kv = r.text.cte_buckets[-1], r.text.token_buckets[-1]
    if tokens > context and r.text.chunked_prefill is None:   # chunked prefill takes a prompt up to the KV length
        fail(loaded, where, f"the verify prompt {what} is at least {tokens} tokens, more than the largest "
                            f"context-encoding bucket {context}; verify could not run it")
    if tokens + v.new_tokens - 1 > kv:
        fail(loaded, "verify.new_tokens",
             f"{v.new_tokens} new tokens after the verify prompt {what} (at least {tokens} tokens) need "
             f"{tokens + v.new_tokens - 1} positions, more than the largest token-generation bucket {kv} "
             f"({'text.tkg_buckets' if r.text.tkg_buckets else 'seq_len'}); use new_tokens <= {kv - tokens + 1}")
