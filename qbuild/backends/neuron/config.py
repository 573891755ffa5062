"""The neuron backend's pure translation: a recipe's typed compile params -> the NxDI port's configuration.

Facts about NxDI, NxD and the ports come from their public source; docs/nxdi.md cites each one (NxDI main @ 4bcdc54,
models/config.py @ c63afe0; NxD @ fbac349; the Qwen3.5 ports on main @ 4bcdc54, Coder-Next PR 170 @ 753c7f5,
Qwen3.6-27B FP8 PR 173 @ 03db3ef). Where the code below depends on one, the comment names it.

Nothing here imports torch or the SDK: `qbuild plan --json` shows `neuron_config(params)` and the tests pin it.
"""

from __future__ import annotations

import re
from dataclasses import replace

from qbuild.backends.neuron import long_context
from qbuild.backends.neuron.params import CompilerSettings, NeuronCompile, NeuronTextCompile, NeuronVisionCompile
from qbuild.backends.neuron.ports import LINEAGES, VISION_COMPILER_ARGS
from qbuild.model.fp8 import FP8Policy, policy as fp8_policy
from qbuild.model.ranks import RankLayout
from qbuild.recipe.params import ParamsError, parse

FP8_ENV = {"XLA_HANDLE_SPECIAL_SCALAR": "1", "UNSAFE_FP8FNCAST": "1"}   # PR 173 qwen36_27b_compile_fp8.py
# NxDI's BlockwiseMatmulConfig per MoE backend (docs/nxdi.md section 3). shard_hidden is NxD's LNC=2 default kernel
# (_call_shard_hidden_kernel): it is selected by turning every alternative off, so a changed default cannot switch it.
BLOCKWISE = {
    "shard_on_intermediate": {"use_shard_on_intermediate_dynamic_while": True},
    "torch_blockwise": {"use_torch_block_wise": True},
    "shard_hidden": {"use_torch_block_wise": False, "use_shard_on_intermediate_dynamic_while": False,
                     "use_shard_on_block_dynamic_while": False},
    "shard_on_block": {"block_size": 128, "use_shard_on_block_dynamic_while": True,
                       "block_sharding_strategy": "PING_PONG"},
}
# FP8 mlp_only as PR 173 builds it (`_mlp_only_modules_to_not_convert`): WHOLE modules, each with and without the
# `model.` prefix, because NxD matches them as substrings of module paths (`self_attn.q_proj` would match nothing:
# the real path is `self_attn.qkv_proj.q_proj`).
_FP8_KEEP_TOP = ("embed_tokens", "lm_head", "norm", "rotary_emb")
_FP8_KEEP_LAYER = ("self_attn", "linear_attn", "input_layernorm", "post_attention_layernorm")
# PR 173 `_FP8_WLO_SKIP_PATTERNS`.
FP8_SKIP_LAYOUT_OPTIMIZATION = (r".*\.scale$", r".*\.weight_scale$", r".*linear_attn\.conv1d_weight\.weight$")


# --- the pure translation ----------------------------------------------------------------------------------------

def rank_layout(lineage: str, is_moe: bool, tp: int, ep: int) -> RankLayout:
    """NxD's world for a recipe's tp and ep: the number of ranks (shard files, NeuronCores) and how the layers are split
    over them. NxDI's degrees follow from it (nxd_degrees).

    NxDI: world_size = tp_degree * pp_degree * ep_degree (models/config.py). The moe lineage runs expert parallelism
    the way Coder-Next validated it: ep_degree = moe_ep_degree = ep, moe_tp_degree = tp (PR 170 README), so ep
    multiplies the ranks. Otherwise there is no EP (the backend refuses ep > 1): tp ranks, moe_tp_degree = tp.
    """
    if lineage == "moe" and is_moe and ep > 1:
        return RankLayout(world=tp * ep, dense_tp=tp, moe_tp=tp, moe_ep=ep)
    return RankLayout.split(tp)


def nxd_degrees(ranks: RankLayout, is_moe: bool) -> dict[str, int]:
    """NxDI's NeuronConfig parallel degrees of a world: tp_degree, ep_degree where NxD's world has expert-parallel
    copies of the tp group, and for a MoE model moe_tp_degree and moe_ep_degree."""
    degrees = {"tp_degree": ranks.dense_tp}
    if ranks.world > ranks.dense_tp:
        degrees["ep_degree"] = ranks.world // ranks.dense_tp
    if is_moe:
        degrees.update(moe_tp_degree=ranks.moe_tp, moe_ep_degree=ranks.moe_ep)
    return degrees


def modules_to_not_convert(policy: FP8Policy, num_layers: int) -> list[str]:
    """Every module but the MLPs that `policy` quantizes stays in the model dtype (PR 173 builds mlp_only so)."""
    keep = []
    for name in _FP8_KEEP_TOP:
        keep += [name, f"model.{name}"]
    for i in range(num_layers):
        for prefix in ("layers", "model.layers"):
            keep += [f"{prefix}.{i}.{m}" for m in _FP8_KEEP_LAYER]
    quantized = policy.mlp_layers(num_layers)
    for i in range(num_layers):
        if i not in quantized:
            keep += [f"layers.{i}.mlp", f"model.layers.{i}.mlp"]
    return keep


def options(tokens: list[str]) -> list[tuple[str, list[str]]]:
    """Command-line tokens grouped as (option name, its tokens): `--x=v` and `--x v` both name `--x`, `-O1` names
    `-O`; a token that does not start with "-" is the value of the option before it."""
    grouped: list[tuple[str, list[str]]] = []
    for token in tokens:
        if token.startswith("-") or not grouped:
            name = "-O" if re.fullmatch(r"-O\d", token) else token.split("=", 1)[0]
            grouped.append((name, [token]))
        else:
            grouped[-1][1].append(token)
    return grouped


def compiler_args(port_args: tuple[str, ...], compiler: CompilerSettings) -> str:
    """What the app's get_compiler_args() returns (or what the vision trace is given): the port's own arguments, the
    target and LNC (which NxDI adds only when get_compiler_args() returns None: model_wrapper.py), then the recipe's
    flags. A recipe flag REPLACES the port's option of the same name (`--auto-cast matmult` replaces the ports'
    `--auto-cast=none`): which of two values neuronx-cc would take is stated by no public source, so the arguments
    never hold an option twice (docs/nxdi.md section 7)."""
    flags = [t for flag in compiler.flags for t in flag.split()]
    overridden = {name for name, _ in options(flags)}
    kept = [t for name, tokens in options(list(port_args)) if name not in overridden for t in tokens]
    return " ".join((*kept, f"--target={compiler.target}", f"--lnc={compiler.lnc}", *flags))


def _text_neuron_config(p: NeuronTextCompile) -> tuple[str, dict, dict]:
    """(NeuronConfig class, constructor kwargs, attributes set after construction) of a text compile."""
    is_moe = p.text.num_experts is not None
    cfg = {
        **nxd_degrees(p.parallel, is_moe), "batch_size": p.batch_size, "max_batch_size": p.batch_size,
        "ctx_batch_size": p.batch_size, "tkg_batch_size": p.batch_size,
        "seq_len": p.seq_len, "max_length": p.seq_len,
        "max_context_length": long_context.max_context_length(p.cte_buckets, p.tkg_buckets, p.block_kv),
        "torch_dtype": p.dtype, "logical_nc_config": p.compiler.lnc, "fused_qkv": p.fused_qkv,
        # Both lists explicit: with one left None NxDI generates powers of two up to the max (autobucketing.py).
        "enable_bucketing": True, "context_encoding_buckets": list(p.cte_buckets),
        "token_generation_buckets": list(p.tkg_buckets),
        # qbuild's shard step writes weights/ in NxD's format; load() reads them from there.
        "save_sharded_checkpoint": True, "skip_sharding": True,
    }
    if p.block_kv is not None:
        cfg.update(long_context.neuron_config(p.block_kv))
    if p.sampling is not None:
        # The ports pass OnDeviceSamplingConfig(top_k=1) (run_text_smoke.py L47 (2B) / L52 (35B-A3B),
        # run_vl_benchmark.py L58 / L62 @ 4bcdc54); NeuronConfig builds that object from a dict of its arguments
        # (models/config.py L172-177 @ ef2731e), which is what JSON carries to the SDK worker (docs/nxdi.md section 21).
        cfg["on_device_sampling_config"] = {"top_k": p.sampling.top_k}
    attributes: dict = {}
    fp8 = fp8_policy(p.fp8)
    if fp8.quantizes:
        # NeuronConfig asserts a path when quantized (config.py @ c63afe0); with skip_sharding nothing reads it at
        # compile, and load() reads weights/ (save_sharded_checkpoint): it names the bundle's own FP8 shards.
        cfg.update(quantized=True, quantized_checkpoints_path="weights", quantization_type="per_channel_symmetric",
                   quantization_dtype="f8e4m3", kv_cache_quant=False, quantized_mlp_kernel_enabled=False,
                   activation_quantization_type=None,
                   modules_to_not_convert=modules_to_not_convert(fp8, p.text.num_layers),
                   weights_to_skip_layout_optimization=list(FP8_SKIP_LAYOUT_OPTIMIZATION))
    if not is_moe:
        return "NeuronConfig", cfg, attributes
    cfg.update(blockwise_matmul_config=dict(BLOCKWISE[p.moe_backend], logical_nc_config=p.compiler.lnc))
    # Router in fp32 with softmax, set as attributes after construction as the ports do (run_text_smoke.py @ 4bcdc54;
    # the moe lineage's config sets them itself). MoENeuronConfig has no normalize_top_k_affinities argument.
    attributes = {"router_config.dtype": "float32", "router_config.act_fn": "softmax"}
    return "MoENeuronConfig", cfg, attributes


def neuron_config(params: NeuronCompile) -> dict:
    """The NxDI configuration of one neuron compile node, from its planned params (pure; no torch, no SDK)."""
    lineage = LINEAGES[params.lineage]
    if isinstance(params, NeuronVisionCompile):
        return vision_config(params)
    cls, cfg, attributes = _text_neuron_config(params)
    env = dict(FP8_ENV) if fp8_policy(params.fp8).quantizes else {}
    env.update(params.port_env)
    env.update(NEURON_PLATFORM_TARGET_OVERRIDE=params.compiler.target,
               NEURON_LOGICAL_NC_CONFIG=str(params.compiler.lnc))
    buckets = {"context_encoding": long_context.context_buckets(params.cte_buckets, params.block_kv),
               "token_generation": long_context.token_buckets(params.tkg_buckets, params.block_kv)}
    return {"lineage": lineage.name, "module": lineage.text_module, "app_class": lineage.app_class,
            "config_class": lineage.config_class, "neuron_config_class": cls, "neuron_config": cfg,
            "attributes": attributes, "port_config": port_config(params),
            "compiler_args": compiler_args(lineage.compiler_args, params.compiler), "env": env, "buckets": buckets,
            "neffs": sum(len(b) for b in buckets.values()), "ranks": params.parallel.world}


def port_config(params: NeuronTextCompile) -> dict:
    """The port InferenceConfig's fields qbuild sets beyond the checkpoint's text config (inference_kwargs)."""
    if params.block_kv is None:
        return {}
    return long_context.port_config(params.block_kv, params.dtype)


def vision_config(params: NeuronVisionCompile) -> dict:
    """How one vision bucket is traced. tp 1: torch_neuronx.trace of the port's CPUVisionModel into one file, as
    compile_vision_encoder.py does; tp > 1: NxD's parallel_model_trace of the port's NeuronQwen35VisionModel (its
    linear layers NxD's Column/RowParallelLinear) over tp ranks, saved by parallel_model_save as one tp_<rank>.pt per
    rank in a directory of its own, as compile_vision_encoder_tp.py does (contrib/models/Qwen3.5-2B/test/integration/
    compile_vision_encoder_tp.py:149-212 @ 4bcdc54; docs/vision.md section 3). Both are where the port's
    NeuronQwen35VisionModelWrapper.load_compiled(dir) looks (modeling_qwen35_vision.py:429-529)."""
    lineage = LINEAGES[params.lineage]
    common = {"lineage": lineage.name, "module": lineage.vision_module, "bucket": params.bucket,
              "compiler_args": compiler_args(VISION_COMPILER_ARGS, params.compiler), "env": dict(params.port_env)}
    if params.tp == 1:
        return {**common, "model_class": "CPUVisionModel", "trace": "torch_neuronx.trace",
                "file": vision_file(params.bucket), "neffs": 1}
    return {**common, "model_class": "NeuronQwen35VisionModel", "trace": "parallel_model_trace", "tp_degree": params.tp,
            "file": vision_tp_dir(params.bucket), "shards": [f"tp_{r}.pt" for r in range(params.tp)],
            "neffs": params.tp}


def vision_file(bucket: int) -> str:
    """The name the port's NeuronQwen35VisionModelWrapper.load_compiled(dir) globs for (vision_encoder_<bucket>.pt)."""
    return f"vision_encoder_{bucket}.pt"


def vision_tp_dir(bucket: int) -> str:
    """The directory a TP-sharded vision bucket is saved in: load_compiled reads every `bucket_<N>/tp_*.pt` as bucket N
    (contrib/models/Qwen3.5-2B/src/modeling_qwen35_vision.py:455-485 @ 4bcdc54), and NxD's parallel_model_load reads
    every file of the directory as a rank (trace/trace.py:390-409 @ fbac349), so it holds nothing else."""
    return f"bucket_{bucket}"


def neff_reuse(old: dict, new: NeuronCompile) -> str | None:
    """What the Neuron compile cache will reuse when a text compile's only change is its bucket lists (else None).
    `old` is a neuron compile's params as locked (JSON), `new` as planned now.

    Each bucket's NEFF is cached under a hash of its HLO and flags (NxD trace/model_builder.py get_hash_module @
    fbac349), and every bucket's HLO carries the weight layout chosen by token-generation bucket 0, the priority
    model (model_builder.py _add_layout_optimization_to_remaining_hlo): so buckets added or removed cost one NEFF
    each, unless token-generation bucket 0 itself changed, which recompiles everything. The flags hashed include
    `--logfile=<work dir>/<tag>/_tp0_bk<i>/log-neuron-cc.txt` (model_builder.py L643-644, L721-722): a bucket keeps
    its NEFF only at the same index of its list, so a bucket inserted before others recompiles those after it.
    """
    a = _locked_text_compile(old)
    b = new
    if a is None or not isinstance(b, NeuronTextCompile) or \
            replace(a, cte_buckets=(), tkg_buckets=()) != replace(b, cte_buckets=(), tkg_buckets=()):
        return None
    cte_a, cte_b = (long_context.context_buckets(x.cte_buckets, x.block_kv) for x in (a, b))
    tkg_a, tkg_b = (long_context.token_buckets(x.tkg_buckets, x.block_kv) for x in (a, b))
    if tkg_a[0] != tkg_b[0]:
        return (f"token-generation bucket 0 changed ({_bucket(tkg_a[0])} -> {_bucket(tkg_b[0])}): its weight "
                f"layout feeds every bucket, so all {len(cte_b) + len(tkg_b)} NEFFs recompile")
    added = [f"cte-{_bucket(x)}" for i, x in enumerate(cte_b) if cte_a[i:i + 1] != [x]]
    added += [f"tkg-{_bucket(x)}" for i, x in enumerate(tkg_b) if tkg_a[i:i + 1] != [x]]
    kept = len(cte_b) + len(tkg_b) - len(added)
    return (f"{len(added)} new NEFF{'s' if len(added) != 1 else ''} ({', '.join(added) or 'none'}), {kept} reused from "
            "the Neuron compile cache")


def _bucket(bucket) -> str:
    """A bucket as NEFF names show it: 512, or an (active, prefix) pair of prefix caching as 512x131072."""
    return "x".join(map(str, bucket)) if isinstance(bucket, list) else str(bucket)


def _locked_text_compile(params: dict) -> NeuronTextCompile | None:
    """The locked params of a neuron text compile, or None where a lock written by another qbuild holds params this
    one does not read (then more than the bucket lists changed)."""
    try:
        return parse(NeuronTextCompile, params)
    except ParamsError:
        return None


def inference_kwargs(params: NeuronTextCompile) -> dict:
    """The port InferenceConfig's kwargs: the text config FLATTENED (NxDI's load_pretrained_config leaves text_config
    nested, and both ports require the text fields at the top: get_required_attributes of Qwen35InferenceConfig and
    Qwen35MoeInferenceConfig), with the RoPE fields and pad token the ports' scripts add (run_text_smoke.py @ 4bcdc54)."""
    hf = params.text.to_hf_config()
    text = dict(hf.get("text_config", hf))
    rope = text.get("rope_parameters", {})
    for key in ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"):
        if key in rope:
            text[key] = rope[key]
    text["pad_token_id"] = params.pad_token_id
    if params.lineage == "main":
        text["use_hybrid_cache_manager"] = False
        # The main ports trace context encoding without vision inputs unless told otherwise (Qwen35InferenceConfig
        # sets use_text_only_cte_inputs=True by default: 35B-A3B modeling_qwen35.py:2324, 2B :2230 @ 4bcdc54); their
        # VL flow compiles the text model with it False (35B-A3B test/integration/run_vl_smoke.py:97).
        text["use_text_only_cte_inputs"] = not params.vision_inputs
    text.update(port_config(params))
    return text
