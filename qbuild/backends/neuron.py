"""The Neuron backend: a recipe's compile params -> the NxDI port's configuration, and the compile through the SDK.

Facts about NxDI, NxD and the ports come from their public source; shared/reference/nxdi-api.md cites each one
(NxDI main @ 4bcdc54, models/config.py @ c63afe0; NxD @ fbac349; the Qwen3.5 ports on main @ 4bcdc54, Coder-Next
PR 170 @ 753c7f5, Qwen3.6-27B FP8 PR 173 @ 03db3ef). Where the code below depends on one, the comment names it.

- `neuron_config(params)` is pure (no torch, no SDK): `qbuild plan --json` shows it and the tests pin it. It and
  the compiles take the typed params of qbuild.recipe.params.
- `compile_text` runs ONE NxDI `compile()` for a recipe: NxDI always builds both submodels with every CTE and TKG
  bucket into one `model.pt` (application_base.py); per-bucket reuse is the Neuron compile cache's job.
- `compile_vision` traces the port's `CPUVisionModel` with the real vision weights, one bucket per node
  (contrib/models/Qwen3.5-35B-A3B/test/integration/compile_vision_encoder.py @ 4bcdc54).
Where the SDK does not import, the real paths fail with one line naming the missing package.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import sys
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

from qbuild.core import jsonio
from qbuild.core.errors import BuildError
from qbuild.model.families import LINEAGES, VISION_COMPILER_ARGS, fp8_mlp_layers
from qbuild.recipe.params import (CompilerSettings, NeuronCompile, NeuronTextCompile, NeuronVisionCompile, ParamsError, parse_compile, to_json)

FP8_ENV = {"XLA_HANDLE_SPECIAL_SCALAR": "1", "UNSAFE_FP8FNCAST": "1"}   # PR 173 qwen36_27b_compile_fp8.py
# NxDI's BlockwiseMatmulConfig per MoE backend (nxdi-api.md section 3). shard_hidden is NxD's LNC=2 default kernel
# (_call_shard_hidden_kernel): it is selected by turning every alternative off, so a changed default cannot switch it.
BLOCKWISE = {
    "shard_on_intermediate": {"use_shard_on_intermediate_dynamic_while": True},
    "torch_blockwise": {"use_torch_block_wise": True},
    "shard_hidden": {"use_torch_block_wise": False, "use_shard_on_intermediate_dynamic_while": False,
                     "use_shard_on_block_dynamic_while": False},
    "shard_on_block": {"block_size": 128, "use_shard_on_block_dynamic_while": True,
                       "block_sharding_strategy": "PING_PONG"},
}
REQUIRED_PACKAGES = (("neuronx_distributed_inference", "neuronx-distributed-inference"),
                     ("neuronx_distributed", "neuronx-distributed"),
                     ("torch_neuronx", "torch-neuronx"))
# FP8 mlp_only as PR 173 builds it (`_mlp_only_modules_to_not_convert`): WHOLE modules, each with and without the
# `model.` prefix, because NxD matches them as substrings of module paths (`self_attn.q_proj` would match nothing:
# the real path is `self_attn.qkv_proj.q_proj`).
_FP8_KEEP_TOP = ("embed_tokens", "lm_head", "norm", "rotary_emb")
_FP8_KEEP_LAYER = ("self_attn", "linear_attn", "input_layernorm", "post_attention_layernorm")
# PR 173 `_FP8_WLO_SKIP_PATTERNS`.
FP8_SKIP_LAYOUT_OPTIMIZATION = (r".*\.scale$", r".*\.weight_scale$", r".*linear_attn\.conv1d_weight\.weight$")
# Switches the ports read while tracing (contrib/models/Qwen3.5-35B-A3B/src/modeling_qwen35.py @ 4bcdc54 reads
# QWEN36_*, USE_NKI*, DELTANET_*, ...; the Coder-Next script sets NEURON_CC_FLAGS). A compile sees only the
# recipe's `port.env`, never the host's, so the compiled graph is a function of its key.
PORT_ENV_PREFIXES = ("QWEN36_", "USE_NKI", "DELTANET_", "USE_PYTORCH_CHUNK", "USE_NEWTON_RMSNORM",
                     "USE_PYTHON_RMSNORM", "NEURON_CC_FLAGS")
QBUILD_RECORD = "qbuild-neuron.json"   # qbuild's own record; NxDI's neuron_config.json is never touched


# --- the pure translation ----------------------------------------------------------------------------------------

def nxd_parallel(lineage: str, is_moe: bool, tp: int, ep: int) -> dict:
    """NxDI's parallel degrees for a recipe's tp/ep, and the number of ranks (shard files, NeuronCores).

    NxDI: world_size = tp_degree * pp_degree * ep_degree (models/config.py). The moe lineage runs expert parallelism
    the way Coder-Next validated it: ep_degree = moe_ep_degree = ep, moe_tp_degree = tp (PR 170 README), so ep
    multiplies the ranks. The main lineage has no EP (qbuild.recipe.checks refuses ep > 1 there): moe_tp_degree = tp.
    """
    if lineage == "moe" and is_moe and ep > 1:
        return {"tp_degree": tp, "ep_degree": ep, "moe_tp_degree": tp, "moe_ep_degree": ep, "world_size": tp * ep}
    return {"tp_degree": tp, "ep_degree": 1, "moe_tp_degree": tp if is_moe else None,
            "moe_ep_degree": 1 if is_moe else None, "world_size": tp}


def modules_to_not_convert(num_layers: int) -> list[str]:
    """FP8 mlp_only: every module but the MLPs that mlp_only quantises stays in the model dtype (PR 173)."""
    keep = []
    for name in _FP8_KEEP_TOP:
        keep += [name, f"model.{name}"]
    for i in range(num_layers):
        for prefix in ("layers", "model.layers"):
            keep += [f"{prefix}.{i}.{m}" for m in _FP8_KEEP_LAYER]
    quantised = fp8_mlp_layers("mlp_only", num_layers)
    for i in range(num_layers):
        if i not in quantised:
            keep += [f"layers.{i}.mlp", f"model.layers.{i}.mlp"]
    return keep


def compiler_args(port_args: tuple[str, ...], compiler: CompilerSettings) -> str:
    """What the app's get_compiler_args() returns (or what the vision trace is given): the port's own arguments, the
    target and LNC (which NxDI adds only when get_compiler_args() returns None: model_wrapper.py), then the recipe's
    flags."""
    return " ".join((*port_args, f"--target={compiler.target}", f"--lnc={compiler.lnc}", *compiler.flags))


def _text_neuron_config(p: NeuronTextCompile) -> tuple[str, dict, dict]:
    """(NeuronConfig class, constructor kwargs, attributes set after construction) of a text compile."""
    par = p.parallel
    cfg = {
        "tp_degree": par.tp_degree, "batch_size": p.batch_size, "max_batch_size": p.batch_size,
        "ctx_batch_size": p.batch_size, "tkg_batch_size": p.batch_size,
        "seq_len": p.seq_len, "max_length": p.seq_len, "max_context_length": max(p.cte_buckets),
        "torch_dtype": p.dtype, "logical_nc_config": p.compiler.lnc, "fused_qkv": p.fused_qkv,
        # Both lists explicit: with one left None NxDI generates powers of two up to the max (autobucketing.py).
        "enable_bucketing": True, "context_encoding_buckets": list(p.cte_buckets),
        "token_generation_buckets": list(p.tkg_buckets),
        # qbuild's shard step writes weights/ in NxD's format; load() reads them from there.
        "save_sharded_checkpoint": True, "skip_sharding": True,
    }
    if par.ep_degree > 1:
        cfg["ep_degree"] = par.ep_degree
    attributes: dict = {}
    if p.fp8 != "none":
        # NeuronConfig asserts a path when quantized (config.py @ c63afe0); with skip_sharding nothing reads it at
        # compile, and load() reads weights/ (save_sharded_checkpoint): it names the bundle's own FP8 shards.
        cfg.update(quantized=True, quantized_checkpoints_path="weights", quantization_type="per_channel_symmetric",
                   quantization_dtype="f8e4m3", kv_cache_quant=False, quantized_mlp_kernel_enabled=False,
                   activation_quantization_type=None,
                   modules_to_not_convert=modules_to_not_convert(p.text.num_layers),
                   weights_to_skip_layout_optimization=list(FP8_SKIP_LAYOUT_OPTIMIZATION))
    if p.text.num_experts is None:
        return "NeuronConfig", cfg, attributes
    cfg.update(moe_tp_degree=par.moe_tp_degree, moe_ep_degree=par.moe_ep_degree,
               blockwise_matmul_config=dict(BLOCKWISE[p.moe_backend], logical_nc_config=p.compiler.lnc))
    # Router in fp32 with softmax, set as attributes after construction as the ports do (run_text_smoke.py @ 4bcdc54;
    # the moe lineage's config sets them itself). MoENeuronConfig has no normalize_top_k_affinities argument.
    attributes = {"router_config.dtype": "float32", "router_config.act_fn": "softmax"}
    return "MoENeuronConfig", cfg, attributes


def neuron_config(params: NeuronCompile) -> dict:
    """The NxDI configuration of one neuron compile node, from its planned params (pure; no torch, no SDK)."""
    lineage = LINEAGES[params.lineage]
    if isinstance(params, NeuronVisionCompile):
        return {"lineage": lineage.name, "module": lineage.vision_module, "model_class": "CPUVisionModel",
                "bucket": params.bucket, "file": vision_file(params.bucket),
                "compiler_args": compiler_args(VISION_COMPILER_ARGS, params.compiler),
                "env": dict(params.port_env), "neffs": 1}
    cls, cfg, attributes = _text_neuron_config(params)
    env = dict(FP8_ENV) if params.fp8 != "none" else {}
    env.update(params.port_env)
    env.update(NEURON_PLATFORM_TARGET_OVERRIDE=params.compiler.target,
               NEURON_LOGICAL_NC_CONFIG=str(params.compiler.lnc))
    return {"lineage": lineage.name, "module": lineage.text_module, "app_class": lineage.app_class,
            "config_class": lineage.config_class, "neuron_config_class": cls, "neuron_config": cfg,
            "attributes": attributes, "compiler_args": compiler_args(lineage.compiler_args, params.compiler),
            "env": env, "buckets": {"context_encoding": cfg["context_encoding_buckets"],
                                    "token_generation": cfg["token_generation_buckets"]},
            "neffs": len(cfg["context_encoding_buckets"]) + len(cfg["token_generation_buckets"]),
            "ranks": params.parallel.world_size}


def vision_file(bucket: int) -> str:
    """The name the port's NeuronQwen35VisionModelWrapper.load_compiled(dir) globs for (vision_encoder_<bucket>.pt)."""
    return f"vision_encoder_{bucket}.pt"


def neff_reuse(old: dict, new: dict) -> str | None:
    """What the Neuron compile cache will reuse when a text compile's only change is its bucket lists (else None).
    `old` and `new` are a neuron text compile's params as locked and as planned now.

    Each bucket's NEFF is cached under a hash of its HLO and flags (NxD trace/model_builder.py get_hash_module @
    fbac349), and every bucket's HLO carries the weight layout chosen by token-generation bucket 0, the priority
    model (model_builder.py _add_layout_optimization_to_remaining_hlo): so buckets added or removed cost one NEFF
    each, unless token-generation bucket 0 itself changed, which recompiles everything. The flags hashed include
    `--logfile=<work dir>/<tag>/_tp0_bk<i>/log-neuron-cc.txt` (model_builder.py L643-644, L721-722): a bucket keeps
    its NEFF only at the same index of its list, so a bucket inserted before others recompiles those after it.
    """
    a = _locked_text_compile(old)
    b = parse_compile(new)
    if a is None or not isinstance(b, NeuronTextCompile) or \
            replace(a, cte_buckets=(), tkg_buckets=()) != replace(b, cte_buckets=(), tkg_buckets=()):
        return None
    if a.tkg_buckets[0] != b.tkg_buckets[0]:
        return (f"token-generation bucket 0 changed ({a.tkg_buckets[0]} -> {b.tkg_buckets[0]}): its weight "
                f"layout feeds every bucket, so all {len(b.cte_buckets) + len(b.tkg_buckets)} NEFFs recompile")
    added = [f"cte-{x}" for i, x in enumerate(b.cte_buckets) if a.cte_buckets[i:i + 1] != (x,)]
    added += [f"tkg-{x}" for i, x in enumerate(b.tkg_buckets) if a.tkg_buckets[i:i + 1] != (x,)]
    kept = len(b.cte_buckets) + len(b.tkg_buckets) - len(added)
    return (f"{len(added)} new NEFF{'s' if len(added) != 1 else ''} ({', '.join(added) or 'none'}), {kept} reused from "
            "the Neuron compile cache")


def _locked_text_compile(params: dict) -> NeuronTextCompile | None:
    """The locked params of a neuron text compile, or None where a lock written by another qbuild holds params this
    one does not read (then more than the bucket lists changed)."""
    try:
        p = parse_compile(params)
    except ParamsError:
        return None
    return p if isinstance(p, NeuronTextCompile) else None


# --- the real compile (Neuron SDK) --------------------------------------------------------------------------------

def require_sdk() -> None:
    """Raise one line naming the first Neuron SDK package that does not import here."""
    for module, dist in REQUIRED_PACKAGES:
        if importlib.util.find_spec(module) is None:
            raise BuildError(f"backend neuron: the Neuron SDK is not installed here ({dist} / `import {module}` "
                             "failed); build on a Neuron host, or pass --backend inductor for a CPU proof")


def _matches(installed: str, pin: str) -> bool:
    # Wheels carry a local suffix (0.10.18399+ed62453e: NxDI setup.py get_version @ c63afe0); a pin may name a
    # prefix of the release (2.25.3371 for 2.25.3371.0).
    public = installed.split("+", 1)[0]
    return public == pin or public.startswith(pin + ".")


def check_toolchain(pins: dict) -> None:
    """Raise one line where an installed SDK package differs from the recipe's pin (keys are made from the pins)."""
    for dist, pin in sorted(pins.items()):
        try:
            installed = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            raise BuildError(f"backend neuron: {dist} is not installed here; the recipe pins {dist} {pin}") from None
        if not _matches(installed, pin):
            raise BuildError(f"backend neuron: {dist} {installed} is installed, the recipe pins {pin} (toolchain."
                             f"{dist.replace('-', '_')}); use the pinned SDK or change the pin")


def compile_cache_url(store) -> str:
    """The Neuron persistent compile cache a build uses: a qbuild-owned folder of the store, or the remote's prefix
    (NEURON_COMPILE_CACHE_URL accepts s3:// URLs: aws-neuron-sdk neuron-caching.rst @ 539a73c5)."""
    if store is None:
        raise BuildError("backend neuron: no store to keep the Neuron compile cache in")
    if store.remote:
        return store.remote.rstrip("/") + "/neuron-compile-cache"
    return str(Path(store.local) / "neuron-compile-cache")


def work_dir(params: NeuronCompile) -> Path:
    """BASE_COMPILE_WORK_DIR of a compile: the same absolute path on every host and every run of an architecture.

    trace() wipes it (model_builder.py @ fbac349), so concurrent compiles each need their own; and NxD hashes a
    `--logfile=<absolute work dir>/...` flag into every NEFF's compile-cache key, so a path that changed with the
    buckets would make every bucket miss. The folder is therefore named by the params without the bucket lists,
    and held under a file lock while a compile uses it.
    """
    from qbuild.core.hashing import digest_json

    stable = {k: v for k, v in to_json(params).items() if k not in ("cte_buckets", "tkg_buckets")}
    root = Path(os.environ.get("QBUILD_NEURON_WORKDIR", "/tmp/qbuild-nxd"))
    return root / f"{params.graph}-{digest_json(stable)[:16]}"


@contextmanager
def _locked(path: Path):
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        yield path


def _run_sdk(op: str, request: dict, env: dict, cwd: Path, log) -> dict:
    """Run one SDK operation in a fresh interpreter (qbuild.backends.neuron_sdk), so that the environment NxD reads at
    import (NEURON_LOGICAL_NC_CONFIG, BASE_COMPILE_WORK_DIR, ...) and the port on sys.path are this node's alone."""
    import subprocess

    cwd.mkdir(parents=True, exist_ok=True)
    req = cwd / f"{op}-request.json"
    res = cwd / f"{op}-result.json"
    req.write_text(jsonio.dumps(request, indent=1, sort_keys=True))
    base = {k: v for k, v in os.environ.items() if not k.startswith(PORT_ENV_PREFIXES)}
    proc = subprocess.run([sys.executable, "-m", "qbuild.backends.neuron_sdk", op, str(req), str(res)],
                          cwd=cwd, env={**base, **env}, capture_output=True, text=True)
    for line in (proc.stdout + proc.stderr).splitlines()[-200:]:
        log(line)
    if proc.returncode != 0:
        last = next((line for line in reversed(proc.stderr.splitlines()) if line.strip()), "no output")
        raise BuildError(f"backend neuron: {op} failed: {last.removeprefix('error: ')}")
    return json.loads(res.read_text())


def compile_text(params: NeuronTextCompile, port: Path, out: Path, scratch: Path, cache_url: str, log) -> dict:
    """ONE NxDI compile of a recipe's text model: `out` becomes NxDI's compiled directory (model.pt and NxDI's own
    neuron_config.json), plus metaneff/ (each NEFF's expected weights) and qbuild-neuron.json."""
    require_sdk()
    check_toolchain(params.toolchain)
    cfg = neuron_config(params)
    model_dir = scratch / "hf"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(jsonio.dumps(inference_kwargs(params), indent=1, sort_keys=True))
    with _locked(work_dir(params)) as wd:
        env = {**cfg["env"], "BASE_COMPILE_WORK_DIR": f"{wd}/", "NEURON_COMPILE_CACHE_URL": cache_url}
        _run_sdk("text", text_request(params, cfg, port, model_dir, out, wd), env, scratch, log)
    write_record(out, {"params": to_json(params), "config": cfg})
    log(f"neuron: compiled {cfg['neffs']} NEFFs into model.pt ({cfg['app_class']})")
    return cfg


def compile_vision(params: NeuronVisionCompile, port: Path, weights: Path, out: Path, scratch: Path, cache_url: str,
                   log) -> dict:
    """Trace the port's CPUVisionModel at one patch bucket with the real weights inlined -> vision_encoder_<b>.pt."""
    require_sdk()
    check_toolchain(params.toolchain)
    cfg = neuron_config(params)
    with _locked(work_dir(params)) as wd:
        _run_sdk("vision", vision_request(params, cfg, port, weights, out, wd),
                 {**cfg["env"], "NEURON_COMPILE_CACHE_URL": cache_url,
                  "NEURON_PLATFORM_TARGET_OVERRIDE": params.compiler.target}, scratch, log)
    write_record(out, {"params": to_json(params), "config": cfg}, name=f"qbuild-vision-{params.bucket}.json")
    log(f"neuron: traced the vision encoder at bucket {params.bucket}")
    return cfg


# The requests of qbuild.backends.neuron_sdk (its functions name the fields they read): JSON, because the SDK side
# runs in a fresh interpreter; each is made here from the typed params and the NxDI configuration made from them.

def text_request(params: NeuronTextCompile, cfg: dict, port: Path, model_dir: Path, out: Path, wd: Path) -> dict:
    lineage = LINEAGES[params.lineage]
    return {"config": cfg, "kwargs": inference_kwargs(params), "port": str(lineage.module_dir(port)),
            "model_dir": str(model_dir), "out": str(out), "work_dir": str(wd)}


def vision_request(params: NeuronVisionCompile, cfg: dict, port: Path, weights: Path, out: Path, wd: Path) -> dict:
    lineage = LINEAGES[params.lineage]
    return {"config": cfg, "vision": asdict(params.vision), "dtype": params.dtype, "module": lineage.vision_module,
            "port": str(lineage.module_dir(port)), "weights": str(weights), "out": str(out / cfg["file"]),
            "work_dir": str(wd)}


def verify_request(params: NeuronTextCompile, bundle: Path, port: Path, prompts: list[list[int]], new_tokens: int,
                   logits: Path) -> dict:
    lineage = LINEAGES[params.lineage]
    return {"port": str(lineage.module_dir(port)), "module": lineage.text_module, "app_class": lineage.app_class,
            "bundle": str(bundle), "prompts": prompts, "new_tokens": new_tokens,
            "pad_token_id": params.pad_token_id or 0, "logits": str(logits)}


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
    return text


def write_record(out: Path, doc: dict, name: str = QBUILD_RECORD) -> None:
    (out / name).write_text(jsonio.dumps(doc, indent=1, sort_keys=True) + "\n")


# --- checking shards against what the compiled model expects -------------------------------------------------------

def expected_weights(compiled: Path) -> dict[str, tuple[int, ...]] | None:
    """{checkpoint key: per-rank shape} of the compiled model's INPUT_WEIGHT inputs, read from the metaneff.pb files
    the compile kept (torch_neuronx.proto.metaneff_pb2.MetaNeff; NxD trace/hlo_utils.py get_input_order @ fbac349).
    None where torch_neuronx is not installed (the check runs on hosts with the SDK)."""
    if importlib.util.find_spec("torch_neuronx") is None:
        return None
    from torch_neuronx.proto import metaneff_pb2

    expected: dict[str, tuple[int, ...]] = {}
    for path in sorted((compiled / "metaneff").rglob("*.pb")):
        meta = metaneff_pb2.MetaNeff()
        meta.ParseFromString(path.read_bytes())
        for tensor in meta.input_tensors:
            if tensor.type == metaneff_pb2.MetaTensor.Type.INPUT_WEIGHT:
                expected[tensor.checkpoint_key.decode()] = tuple(tensor.shape)
    return expected


def check_shards(expected: dict[str, tuple[int, ...]], shard: Path) -> None:
    """Raise one line naming the first weight the compiled model expects that a rank's shard lacks or shapes
    differently (every rank holds the same names and per-rank shapes)."""
    from qbuild.model.convert.safetensors_header import read_header

    header = read_header(shard, shard.name)
    extra = sorted(set(header) - set(expected))
    if extra:
        raise BuildError(f"{shard.name}: {extra[0]}: the shard holds it and the compiled model takes no such weight")
    for name, shape in sorted(expected.items()):
        entry = header.get(name)
        if entry is None:
            raise BuildError(f"{shard.name}: {name}: the compiled model expects it and the shard has no such tensor")
        if tuple(entry.shape) != shape:
            raise BuildError(f"{shard.name}: {name}: shape {list(entry.shape)}, the compiled model expects "
                             f"{list(shape)}")


# --- running a bundle (verify) -------------------------------------------------------------------------------------

def run_bundle(bundle: Path, port: Path, prompts: list[list[int]], new_tokens: int, scratch: Path, log):
    """Load a neuron bundle with its port's class on this host's NeuronCores and generate greedily on each prompt.
    Returns (greedy tokens per prompt, {"prompt<i>": first-step logits (1, V)})."""
    from safetensors.torch import load_file

    require_sdk()
    record = json.loads((bundle / QBUILD_RECORD).read_text())
    params = parse_compile(record["params"])
    if not isinstance(params, NeuronTextCompile):
        raise BuildError(f"{bundle / QBUILD_RECORD}: records a {params.backend} {params.graph} compile, not the "
                         "neuron text compile a neuron bundle runs")
    logits = scratch / "logits.safetensors"
    with neuron_cores(log):
        res = _run_sdk("verify", verify_request(params, bundle, port, prompts, new_tokens, logits),
                       record["config"]["env"], scratch, log)
    return res["greedy"], load_file(logits)


@contextmanager
def neuron_cores(log):
    """Hold this host's NeuronCores for one bundle run. The Neuron runtime gives a process every core of the host
    unless NEURON_RT_VISIBLE_CORES names some, and a core serves one process at a time (Neuron runtime configuration
    guide, awsdocs-neuron.readthedocs-hosted.com/en/latest/neuron-runtime/guides/configuration-guide.html), so a
    second verify of the same build (-j > 1) or of another build would fail as its runtime starts. Where the variable
    is set (Ray sets it for a task that asks for neuron_cores: ray/_private/accelerators/neuron.py
    set_current_process_visible_accelerator_ids, ray 2.60.0) the cores named are this process's own; elsewhere this
    user's runs take turns under one lock."""
    from filelock import FileLock, Timeout

    from qbuild.core.userdir import runtime_dir

    directory = runtime_dir()
    if os.environ.get("NEURON_RT_VISIBLE_CORES") or directory is None:
        yield
        return
    lock = FileLock(os.path.join(directory, "neuron-cores.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log("waiting for the NeuronCores: another bundle run on this host holds them")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


# --- serving a pulled bundle with vLLM ----------------------------------------------------------------------------

def serve_instructions(bundle: Path, manifest: dict) -> dict:
    """The environment and command line that serve a pulled neuron bundle with vLLM's Neuron plugin.

    vllm-neuron loads a precompiled directory only through NEURON_COMPILED_ARTIFACTS (otherwise it recompiles
    under <model>/neuron-compiled-artifacts: vllm_neuron/worker/neuronx_distributed_model_loader.py @ a5ef7c8, and
    the NxDI vLLM user guide), builds its config from --model's config.json, and finds the model class in NxDI's
    MODEL_TYPES under the lower-cased architecture name before "For" (the Coder-Next port registers itself so:
    vllm/register_model.py, PR 170). The values must match the compiled config: overrides are ignored on load.
    qbuild compiles a contiguous KV cache (no block KV layout): with prefix caching off the plugin sets block_size to
    max_model_len, that layout, and with it on it would page the cache (vllm_neuron/platform.py @ a5ef7c8 L203-210), so
    the command turns prefix caching and chunked prefill off, as the Coder-Next launcher does
    (vllm/start_vllm_server.sh @ 753c7f5).
    """
    record = json.loads((bundle / QBUILD_RECORD).read_text())
    lineage = LINEAGES[record["config"]["lineage"]]
    config = json.loads((bundle / "config.json").read_text())
    arch = (config.get("architectures") or ["?For"])[0]
    model_type = arch.split("For", 1)[0].lower()
    env = {"NEURON_COMPILED_ARTIFACTS": str(bundle), "VLLM_PLUGINS": "neuron",
           "VLLM_NEURON_FRAMEWORK": "neuronx-distributed-inference",
           "PYTHONPATH": str(lineage.module_dir(bundle / "port")), **record["config"]["env"]}
    batch = manifest["batch_size"]
    command = ["vllm", "serve", str(bundle), "--tensor-parallel-size", str(manifest["ranks"]),
               "--max-model-len", str(manifest["seq_len"]), "--max-num-seqs", str(batch),
               "--num-gpu-blocks-override", str(batch), "--no-enable-prefix-caching", "--no-enable-chunked-prefill"]
    register = (f"from neuronx_distributed_inference.utils.constants import MODEL_TYPES; "
                f"from {lineage.text_module} import {lineage.app_class}; "
                f"MODEL_TYPES[{model_type!r}] = {{'causal-lm': {lineage.app_class}}}")
    return {"env": env, "command": command, "register": register}
