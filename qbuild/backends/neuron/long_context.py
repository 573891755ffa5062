"""Long prompts on neuron, as the Qwen3.6-27B port (NxDI PR 173 @ 03db3ef) builds and serves them: the recipe's
text.chunked_prefill and text.prefix_cache -> the compile's block KV layout and hybrid APC manager, the zero DeltaNet
checkpoint banks its shards carry, and the vLLM flags that serve it. Pure data and arithmetic; docs/long-context.md
section 5 tells the whole story, with every citation below.

Short names (all @ 03db3ef, under contrib/models/Qwen3.6-27B/ unless NxDI): compile script =
test/integration/qwen36_27b_compile_fp8.py; modeling = src/modeling_qwen35.py; launcher = vllm/start_vllm_server.sh;
patch = vllm/qwen36_hybrid_apc_scheduler_patch.py; NxDI = aws-neuron/neuronx-distributed-inference
src/neuronx_distributed_inference/ at the same commit (the recipe installs NxDI from that tree); loader / runner /
platform = vllm-neuron @ 3afb0a9 vllm_neuron/worker/neuronx_distributed_model_loader.py / _runner.py / platform.py;
vLLM = the 0.16.0 wheel.

What the port builds, and why qbuild builds the same for every recipe with chunked prefill:
- The block KV layout: is_block_kv_layout, pa_block_size, pa_num_blocks (compile script L952-955). NxDI's
  BlockKVCacheManager has a cache shape only for prefix caching or NxDI's own chunked prefill
  (modules/kvcache/block_kv_cache_manager.py L40-88), and NxDI refuses to compile the latter ("Chunked Prefill is not
  available in NxDI for now": models/model_base.py L3073-3074; the compile script never sets chunked_prefill_config,
  L974-978). The port's static hybrid cache manager refuses a block layout (modeling L3690-3715), and its only
  manager for a block layout is the hybrid APC one (modeling L5618-5626, QwenHybridBlockKVCacheManager L3925-3960,
  which keeps KV for the attention layers only). So the compile is the port's --enable-hybrid-apc one:
  is_prefix_caching with prefix_buckets (L956-973), use_hybrid_apc_manager, use_hybrid_cache_manager off (L982-986),
  and use_qwen_hybrid_chunked_prefill(_nki) for chunks after the first (L1009-1010, modeling L3371-3396).
- The compiled blocks are one more than vLLM is told (compiled_blocks): vLLM's block 0 is its null block, so it hands
  out blocks 1..N, and NxDI's prefix-caching cache sends every padded slot to its own last block; compiling N would
  make block N both a sequence's and the padding's.
- vLLM serves it with its own chunked-prefill scheduler feeding the compiled CTE bucket chunk by chunk (the port's
  vllm/README.md L100-109; launcher L135-137, L254-287, L688-692), with the port's patch installed (launcher
  L138-140, vllm/sitecustomize.py L14-23, vllm/serve_qwen36.py L8-16), which here the bundle's vLLM plugin loads from
  the bundle's copy of the port (qbuild.backends.neuron.vllm_plugin). The runtime config always says
  use_hybrid_apc_manager: the patch copies it onto the model's config around every step, and the model's argument
  builders pick the traced graphs' inputs from it (runtime_config).
- vLLM's prefix caching on top (the launcher's --enable-hybrid-apc settings) where the recipe says
  text.prefix_cache.neuron_apc: experimental, as recipes/36-27b-fp8-128k.yaml does: the port validated native vLLM
  prefix caching on its 128K artifact (README.md L144-152 @ 6756c65, the PR's first commit) and still calls the
  hybrid APC an experiment (vllm/README.md L175).
"""

from __future__ import annotations

from pathlib import Path

from qbuild.backends.neuron.params import NeuronBlockKV, NeuronPackageParams
from qbuild.core.errors import BuildError, UserError
from qbuild.recipe import checks
from qbuild.recipe.schema import LoadedRecipe

# vLLM 0.16's --block-size choices: BlockSize = Literal[1, 8, 16, 32, 64, 128, 256] (vllm/config/cache.py L22), which
# literal_to_kwargs makes argparse choices (vllm/engine/arg_utils.py L164-178, L290-291).
VLLM_BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
# The compile script's defaults where the recipe has no prefix_cache: --block-size 256 (L1107),
# --max-gdn-checkpoint-slots 8 (L1384); the interval is the block size (its APC v0: see validate).
DEFAULT_BLOCK_SIZE = 256
DEFAULT_CHECKPOINT_SLOTS = 8
# The NxDI ChunkedPrefillConfig the launcher puts in override_neuron_config (L565-579, tile sizes L46-47): vllm-neuron's
# loader asserts one with chunked prefill (loader L1184-1186) and builds it from the dict (L1217-1220).
CHUNKED_PREFILL_TILES = {"tkg_model_enabled": True, "kernel_q_tile_size": 128, "kernel_kv_tile_size": 1024}
# The port's vLLM patch (scheduler, KV cache manager, vllm-neuron runner and loader: patch L24-33, L2693-2749), as the
# launcher installs it for chunked prefill and hybrid APC; relative to the port directory.
SERVING_PATCH = "vllm/qwen36_hybrid_apc_scheduler_patch.py"
SERVING_PATCH_HOOK = "install_import_hook"
# The port's guarded OpenAI front (vllm/qwen36_chat_proxy.py), which its README puts before vLLM for production
# (vllm/README.md L182-214, L251-253): it refuses raw /v1/completions with a 400, because "raw prompts bypass the Qwen
# chat template and can pollute the hybrid model state" (L204-206, proxy L359-375), turns thinking off unless started
# with --allow-thinking (proxy L241-266, L384-388), and hoists system messages (L139-164). Its arguments: --host,
# --port, --backend-url (L397-431). Relative to the port directory.
CHAT_PROXY = "vllm/qwen36_chat_proxy.py"
# vLLM's null block: vllm-neuron adds one block to --num-gpu-blocks-override for it (platform L318-332) and vLLM's block
# pool keeps it out of every block table, so vLLM's blocks are 1..N. NxDI's prefix-caching cache has pa_num_blocks
# + 1 blocks and writes every padded slot (NxDI's model wrapper pads a chunk's slot mapping to the CTE bucket with -1:
# models/model_wrapper.py L1512-1513 @ 03db3ef) into its last one (block_kv_cache_manager.py _NUM_EXTRA_RESERVED_BLOCK L21, shape L62-76, pad_dest_index L345-355). With
# pa_num_blocks = N + 1 that sink is block N + 1, which vLLM never hands out; the port's validated artifact is "pa1025"
# served with --num-gpu-blocks-override 1024 (vllm/README.md L146-151), whatever its comments call "identical"
# (compile script L430-434, launcher L172-176).
VLLM_NULL_BLOCKS = 1
# The GDN checkpoint cache dtypes the port accepts (modeling _normalize_hybrid_cache_dtype L543-564); the recurrent
# state must be float32 with the hybrid APC manager (modeling L2277-2283).
_CACHE_DTYPES = ("float32", "bfloat16")


# --- the recipe ----------------------------------------------------------------------------------------------------

def block_kv(loaded: LoadedRecipe) -> NeuronBlockKV | None:
    """The block KV layout a recipe's neuron compile builds (None: no chunked prefill, NxDI's contiguous cache).

    The blocks default as the compile script's _pa_min_blocks (L408-413): one sequence of seq_len per batch line. The
    one prefix bucket is the KV length: a chunk at position p is a CTE call with a cached prefix of p tokens, and NxDI
    picks the smallest compiled (active, prefix) bucket that holds both or raises (models/model_wrapper.py
    L1209-1254), so prompts up to the KV length need a prefix bucket that long. The compile script's own default, the
    CTE buckets (L262-263), holds two chunks; the port's validated 256K artifact compiled a 256K prefix bucket
    ("pfx256k" in its name: vllm/README.md L146)."""
    t = loaded.recipe.text
    if t.chunk_size is None:
        return None
    cache = t.prefix_cache
    block = cache.block_size if cache else DEFAULT_BLOCK_SIZE
    blocks = t.num_blocks if cache else -(-t.seq_len // block) * t.batch_size
    interval = t.checkpoint_interval if cache else block
    slots = cache.checkpoint_slots if cache else DEFAULT_CHECKPOINT_SLOTS
    return NeuronBlockKV(block, blocks, interval, slots, (t.token_buckets[-1],))


def serves_prefix_caching(loaded: LoadedRecipe) -> bool:
    """Whether vLLM serves the bundle with prefix caching: only where the recipe opts into the port's experiment."""
    cache = loaded.recipe.text.prefix_cache
    return cache is not None and cache.neuron_apc == "experimental"


def validate(loaded: LoadedRecipe, lineage: str) -> None:
    """What the port and vLLM require beyond the recipe checks every backend shares (qbuild.recipe.checks
    _check_long_context), one line naming the field."""
    r = loaded.recipe
    bk = block_kv(loaded)
    if bk is None:
        return
    field = "text.prefix_cache" if r.text.prefix_cache else "text.chunked_prefill"
    if lineage != "main":
        # Only the main lineage's Qwen3.6-27B port has the hybrid APC manager and its block KV manager; PR 128
        # (550e2ab) and PR 170 (753c7f5) only read is_block_kv_layout.
        checks.fail(loaded, "text.chunked_prefill", f"the {lineage}-lineage port has no block KV layout for its "
                                                    "DeltaNet layers; chunked prefill on neuron needs the main "
                                                    "lineage's Qwen3.6-27B port (NxDI PR 173)")
    if bk.block_size not in VLLM_BLOCK_SIZES:
        checks.fail(loaded, f"{field}.block_size", f"{bk.block_size}: vLLM 0.16 takes a --block-size of "
                                                   f"{', '.join(map(str, VLLM_BLOCK_SIZES))} only")
    if bk.checkpoint_interval != bk.block_size:
        checks.fail(loaded, "text.prefix_cache.checkpoint_interval",
                    f"{bk.checkpoint_interval}: the port's hybrid APC manager (v0) needs it equal to block_size "
                    f"{bk.block_size}")
    # With the recipe checks' KV length of whole chunks, this makes the prefix bucket (the KV length) whole blocks, as
    # the compile script requires (L270-273).
    if r.text.chunk_size % bk.checkpoint_interval:
        checks.fail(loaded, "text.chunked_prefill.chunk_size",
                    f"{r.text.chunk_size} is not a multiple of the DeltaNet checkpoint interval "
                    f"{bk.checkpoint_interval}: the port's launcher prefills hybrid APC in chunks of a CTE bucket "
                    "that is one")
    if r.text.batch_size != 1:
        checks.fail(loaded, "text.batch_size", f"{r.text.batch_size}: the port's hybrid APC manager keeps DeltaNet "
                                               "state per batch row and does not support continuous batching "
                                               "(its vllm/README.md L53); chunked prefill on neuron builds batch 1")
    if r.dtype not in _CACHE_DTYPES:
        checks.fail(loaded, "dtype", f"{r.dtype}: the port keeps DeltaNet checkpoints in float32 or bfloat16 only; "
                                     "chunked prefill on neuron builds in bfloat16 or float32")


def require_serving_patch(port: Path) -> None:
    """BuildError where the port lacks the vLLM patch or the chat proxy a long-context bundle is served with (checked
    before an hour of compile, and again where the bundle is packaged)."""
    for name, what in ((SERVING_PATCH, "vLLM patch"), (CHAT_PROXY, "chat proxy")):
        if not (port / name).is_file():
            raise BuildError(f"port: {name} is missing; chunked prefill on neuron is served with the Qwen3.6-27B "
                             f"port's own {what} (NxDI PR 173 @ 03db3ef): use that port")


# --- the compile ---------------------------------------------------------------------------------------------------

def max_context_length(cte_buckets: tuple[int, ...], tkg_buckets: tuple[int, ...], bk: NeuronBlockKV | None) -> int:
    """NeuronConfig max_context_length, which vllm-neuron's runner holds vLLM's prompt limit to (runner L604-694): the
    largest CTE bucket, or with chunked prefill the KV length, the longest prompt the chunks add up to (the compile
    script: "set higher when chunked prefill serves long contexts with smaller active chunks", L1054-1063; the
    launcher serves the compiled value as max_prompt_length, L386-391, L463, L581)."""
    return max(tkg_buckets) if bk is not None else max(cte_buckets)


def compiled_blocks(num_blocks: int) -> int:
    """NeuronConfig pa_num_blocks for `num_blocks` blocks vLLM addresses (--num-gpu-blocks-override): one more, so that
    NxDI's padding sink lies past vLLM's blocks (VLLM_NULL_BLOCKS)."""
    return num_blocks + VLLM_NULL_BLOCKS


def neuron_config(bk: NeuronBlockKV) -> dict:
    """NeuronConfig kwargs of the block KV layout (compile script L952-973), prefix-CTE attention as its default
    attention_cte (L1363-1372; NxDI models/config.py L198-207), and pa_num_blocks one more than vLLM's blocks
    (compiled_blocks)."""
    return {"is_block_kv_layout": True, "pa_block_size": bk.block_size, "pa_num_blocks": compiled_blocks(bk.num_blocks),
            "is_prefix_caching": True, "prefix_buckets": list(bk.prefix_buckets),
            "prefix_cte_attention_backend": "attention_cte"}


def port_config(bk: NeuronBlockKV, dtype: str) -> dict:
    """The port InferenceConfig's hybrid APC and chunking fields as the compile script sets them with
    --enable-hybrid-apc --enable-vllm-chunked-prefill and its defaults (L982-1010, argument defaults L1382-1403); the
    conv checkpoints in the model dtype (the port keeps the recurrent ones in float32, modeling L2277-2283)."""
    return {"use_hybrid_cache_manager": False, "use_hybrid_apc_manager": True,
            "gdn_checkpoint_interval": bk.checkpoint_interval, "max_gdn_checkpoint_slots": bk.checkpoint_slots,
            "gdn_recurrent_cache_dtype": "float32", "gdn_conv_cache_dtype": dtype,
            "hybrid_recurrent_cache_dtype": "float32", "hybrid_conv_cache_dtype": dtype, "hybrid_cache_mode": "all",
            "hybrid_apc_require_vllm_metadata": False, "hybrid_apc_allow_local_hash_fallback": True,
            "hybrid_apc_require_attention_block_refs": False, "hybrid_apc_enable_backed_prefix_reads": False,
            "hybrid_apc_commit_during_token_generation": False,
            "use_qwen_hybrid_chunked_prefill": True, "use_qwen_hybrid_chunked_prefill_nki": True}


def context_buckets(cte_buckets: tuple[int, ...], bk: NeuronBlockKV | None) -> list:
    """The context-encoding graphs NxDI compiles: one per CTE bucket, or with prefix caching one per (active, prefix)
    pair, prefix 0 first (autobucketing.py generate_buckets_for_cte L183-189, L45-62)."""
    if bk is None:
        return list(cte_buckets)
    return [[c, prefix] for c in cte_buckets for prefix in (0, *bk.prefix_buckets)]


def token_buckets(tkg_buckets: tuple[int, ...], bk: NeuronBlockKV | None) -> list:
    """The token-generation graphs: one per TKG bucket, as (1 active token, KV length) with prefix caching
    (autobucketing.py generate_buckets_for_tkg L258-264)."""
    return list(tkg_buckets) if bk is None else [[1, t] for t in tkg_buckets]


# --- serving -------------------------------------------------------------------------------------------------------

def serve_fields(p: NeuronPackageParams) -> dict:
    """vllm/serve.json's "long_context": the bundle's own facts its vLLM flags are made of, and "chat_proxy": the
    port's guarded front, relative to the bundle (both None: not chunked)."""
    bk, lc = p.block_kv, p.long_context
    if bk is None or lc is None:
        return {"chat_proxy": None, "long_context": None}
    return {"chat_proxy": f"port/{CHAT_PROXY}",
            "long_context": {"chunk_size": lc.chunk_size, "block_size": bk.block_size, "num_blocks": bk.num_blocks,
                             "checkpoint_interval": bk.checkpoint_interval, "checkpoint_slots": bk.checkpoint_slots,
                             "prefix_buckets": list(bk.prefix_buckets),
                             "prefix_caching": lc.prefix_cache is not None}}


def vllm_flags(lc: dict) -> list[tuple[str, str | None]]:
    """vLLM's flags for a long-context bundle, as the launcher passes them (L659-695): --block-size, the blocks vLLM
    addresses (its default, ceil(seq_len / block_size) * max_num_seqs, L172-176; the compile has one more,
    compiled_blocks), chunked prefill with a chunk of the compiled CTE bucket (L254-287), and `--generation-config
    vllm` (L656), so that the checkpoint's generation_config.json does not replace vLLM's sampling defaults (the port's
    vllm/README.md L106-109); with prefix caching the mamba-cache settings the launcher adds for hybrid APC
    (L187-199)."""
    flags = [("--block-size", str(lc["block_size"])), ("--num-gpu-blocks-override", str(lc["num_blocks"])),
             ("--enable-chunked-prefill", None), ("--max-num-batched-tokens", str(lc["chunk_size"])),
             ("--generation-config", "vllm")]
    if lc["prefix_caching"]:
        return flags + [("--enable-prefix-caching", None), ("--mamba-cache-mode", "all"),
                        ("--mamba-ssm-cache-dtype", "float32")]
    return flags + [("--no-enable-prefix-caching", None)]


def runtime_config(lc: dict, dtype: str) -> dict:
    """The port's runtime switches in --additional-config (launcher L580-605), which its patch copies onto every model
    config and the app itself around each execute_model (patch _HYBRID_APC_RUNTIME_CONFIG_KEYS L58-86,
    _runner_hybrid_apc_runtime_config and _apply_hybrid_apc_runtime_config L1355-1409, the execute_model wrapper
    L2494-2565).

    use_hybrid_apc_manager is always true: every long-context compile traces the hybrid APC graphs, 29 inputs each
    (modeling input_generator L6811 with _use_expanded_hybrid_args_for_tag L4491-4503), and the argument builders
    count the inputs of a call from this runtime flag (_qwen36_expected_arg_count L4546-4547, _build_qwen36_stage_args
    L4636-4647, the padding L7115-7150), so false would build 24-tensor calls for 29-input graphs. The launcher sends it
    only with --enable-hybrid-apc (L582), a flag qbuild's bundles need for every compile. What prefix caching turns on
    are the launcher's strict-metadata companions (L596-602): vLLM's prefix hashes and attention block refs required,
    no local hash fallback, and the chunk as hybrid_apc_prefill_chunk_tokens; without it they keep the values the
    compile set (compile script L994-1000), where the restore masks stay empty (vllm/README.md L80-86).

    With prefix caching, backed prefix reads too (the launcher's --hybrid-apc-enable-backed-prefix-reads, L92, L600):
    with strict metadata the port's scheduler patch marks every request skip_reading_prefix_cache
    (should_disable_unbacked_prefix_reads L993-1037, _unbacked_prefix_reads_disabled_requested L787-807) unless the
    artifact supports backed reads, which takes this key and use_qwen_hybrid_chunked_prefill
    (_supports_backed_prefix_reads L940-953), and a registered GDN checkpoint backs the hit (L817-853): without it a
    repeated prefix would be prefilled again in full. The launcher leaves it off by default (L39); the port reports its
    hybrid APC exactness (warm and partial-prefix runs reproducing the cold tokens) on its 128K hybrid-APC artifact
    (README.md L121-126), and still calls the path an experiment (vllm/README.md L175), which is what
    neuron_apc: experimental names."""
    apc = lc["prefix_caching"]
    return {"use_hybrid_apc_manager": True, "use_qwen_hybrid_chunked_prefill": True,
            "use_qwen_hybrid_chunked_prefill_nki": True, "gdn_checkpoint_interval": lc["checkpoint_interval"],
            "max_gdn_checkpoint_slots": lc["checkpoint_slots"], "gdn_recurrent_cache_dtype": "float32",
            "gdn_conv_cache_dtype": dtype, "hybrid_recurrent_cache_dtype": "float32", "hybrid_conv_cache_dtype": dtype,
            "hybrid_cache_mode": "all", "hybrid_apc_require_vllm_metadata": apc,
            "hybrid_apc_allow_local_hash_fallback": not apc, "hybrid_apc_require_attention_block_refs": apc,
            "hybrid_apc_enable_backed_prefix_reads": apc, "hybrid_apc_prefill_chunk_tokens": lc["chunk_size"] if apc else 0,
            "qwen_prefill_group_size": lc["chunk_size"]}


def additional_config(serve: dict) -> dict:
    """What the launcher puts in --additional-config besides max_prompt_length (L580-607): the port's runtime switches
    (runtime_config) and override_neuron_config (L512-579), of which vllm-neuron's loader reads what its default
    NeuronConfig must agree on before it loads the compiled directory (loader L1018-1045: chunked_prefill_config;
    pa_num_blocks equal to --num-gpu-blocks-override, which it then lifts by one for the null block, L1126-1171;
    max_context_length equal to max_prompt_length, L1248-1284). For a compiled directory the loader keeps the
    directory's own config (L242-255), whose pa_num_blocks is that lifted count (compiled_blocks)."""
    lc = serve["long_context"]
    override = {"max_context_length": serve["max_prompt_length"], "is_block_kv_layout": True,
                "is_prefix_caching": True, "pa_block_size": lc["block_size"], "pa_num_blocks": lc["num_blocks"],
                "prefix_buckets": lc["prefix_buckets"],
                "chunked_prefill_config": {"max_num_seqs": serve["max_num_seqs"], **CHUNKED_PREFILL_TILES}}
    return {**runtime_config(lc, serve["dtype"]), "override_neuron_config": override}


def serve_env(lc: dict) -> dict[str, str]:
    """vLLM's own chunked-prefill scheduler instead of vllm-neuron's, which turns chunked prefill off (platform
    L310-312, L342-358); the launcher sets it with chunked prefill (L135-137)."""
    return {"DISABLE_NEURON_CUSTOM_SCHEDULER": "1"}


def check_compiled(path: Path, nc: dict, serve: dict) -> None:
    """UserError where NxDI's compiled neuron_config.json (`nc`) does not hold the layout vLLM is told to use: vLLM
    computes every slot as block * --block-size + offset over blocks 1..--num-gpu-blocks-override (runner L1352-1363,
    L1401-1413), so another block size would address another cache than the compiled one, and a compiled block count
    other than compiled_blocks puts NxDI's padding sink on one of vLLM's blocks or leaves some of them outside the
    cache; and the blocks must hold max_model_len for every sequence (loader L1188-1204)."""
    lc = serve.get("long_context")
    want = {"is_block_kv_layout": lc is not None}
    if lc is not None:
        want.update(pa_block_size=lc["block_size"], pa_num_blocks=compiled_blocks(lc["num_blocks"]))
    for key, value in want.items():
        if (nc.get(key) or False) != value:
            raise UserError(f"{path}: neuron_config.{key} is {nc.get(key)!r} where vllm/serve.json needs {value!r}; "
                            "the bundle's files do not belong together: pull or build it again")
    if lc is not None and lc["num_blocks"] * lc["block_size"] < serve["max_model_len"] * serve["max_num_seqs"]:
        raise UserError(f"{path.parent / 'vllm' / 'serve.json'}: max_model_len {serve['max_model_len']} needs "
                        f"{-(-serve['max_model_len'] // lc['block_size']) * serve['max_num_seqs']} blocks of "
                        f"{lc['block_size']} tokens, the compiled layout holds {lc['num_blocks']}")
