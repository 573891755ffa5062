"""The Neuron backend: recipe compile params -> an NxDI NeuronConfig, and the compile through the Neuron SDK.

`neuron_config(params)` is a pure function (no torch, no SDK): it is what `qbuild plan --json` shows for each
compile node and what the unit tests pin against the configurations the public NxDI ports used (models.md).
`compile_graph` is the real path; it needs neuronx_distributed_inference + torch_neuronx and, where they do not
import, fails with one line naming the missing package.

Each compile node builds one submodel at one bucket (context encoding at a CTE bucket, token generation at a TKG
bucket, or the vision encoder at a patch bucket); the package step merges the per-node configs into the bundle's
neuron_config.json with every bucket (`bundle_neuron_config`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .. import jsonio
from ..errors import BuildError
from . import hf_config

# The ports' compiler defaults (nxdi-layout.md section 7); recipe flags are appended after them.
DEFAULT_COMPILER_ARGS = ("--enable-saturate-infinity", "--enable-mixed-precision-accumulation",
                         "--model-type transformer", "-O1", "--auto-cast=none")
FP8_ENV = {"XLA_HANDLE_SPECIAL_SCALAR": "1", "UNSAFE_FP8FNCAST": "1"}
SUBMODEL = {"cte": "context_encoding_model", "tkg": "token_generation_model", "vision": "vision_encoder"}
# NxDI's BlockwiseMatmulConfig per MoE backend. shard_hidden is NxDI's default LNC=2 blockwise kernel
# (_call_shard_hidden_kernel): it is selected by turning every alternative off explicitly, so a changed NxDI
# default cannot silently switch the kernel.
BLOCKWISE = {
    "shard_on_intermediate": {"use_shard_on_intermediate_dynamic_while": True},
    "torch_blockwise": {"use_torch_block_wise": True},
    "shard_hidden": {"use_torch_block_wise": False, "use_shard_on_intermediate_dynamic_while": False,
                     "use_shard_on_block_dynamic_while": False},
    "shard_on_block": {"block_size": 128, "use_shard_on_block_dynamic_while": True,
                       "block_sharding_strategy": "PING_PONG"},
}
ROUTER = {"dtype": "float32", "act_fn": "softmax"}
REQUIRED_PACKAGES = (("neuronx_distributed_inference", "neuronx-distributed-inference"),
                     ("torch_neuronx", "torch-neuronx"))

# FP8 policy, as qbuild.convert.fp8 applies it (layer-relative NxDI module names; kept torch-free here).
_MLP_MODULES = {"dense": ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
                "moe": ("mlp.moe.expert_mlps.mlp_op.gate_up_proj", "mlp.moe.expert_mlps.mlp_op.down_proj",
                        "mlp.shared_gate_proj", "mlp.shared_up_proj", "mlp.shared_down_proj")}
_MOE_FLOAT_MODULES = ("mlp.moe.router.linear_router", "mlp.shared_expert_gate")
_ATTN_QUANTISED = ("self_attn.q_proj", "self_attn.output_gate_proj", "self_attn.k_proj", "self_attn.v_proj",
                   "self_attn.o_proj")
_DELTANET_QUANTISED = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj")
_DELTANET_FLOAT = ("linear_attn.in_proj_a", "linear_attn.in_proj_b")


def compiler_args(flags: list[str] | tuple[str, ...]) -> str:
    return " ".join((*DEFAULT_COMPILER_ARGS, *flags))


def _layer_modules(text: dict, layer: int, fused_qkv: bool) -> list[tuple[str, bool]]:
    """(module, quantisable under "full") of one layer's linear modules; MLP modules are handled separately."""
    if text["layer_types"][layer] == "full_attention":
        attn = [m for m in _ATTN_QUANTISED if not (fused_qkv and m.split(".")[1] in ("q_proj", "k_proj", "v_proj"))]
        if fused_qkv:
            attn.insert(0, "self_attn.Wqkv")
        return [(m, True) for m in attn]
    return [(m, True) for m in _DELTANET_QUANTISED] + [(m, False) for m in _DELTANET_FLOAT]


def modules_to_not_convert(text: dict, policy: str, fused_qkv: bool) -> list[str]:
    """Every linear module of the text model that stays in the compute dtype under an FP8 policy."""
    moe = text["num_experts"] is not None
    n = text["num_layers"]
    keep = ["lm_head"]
    for i in range(n):
        for module, quantisable in _layer_modules(text, i, fused_qkv):
            if not (policy == "full" and quantisable):
                keep.append(f"layers.{i}.{module}")
        if policy == "mlp_only" and i in (0, n - 1):
            keep += [f"layers.{i}.{m}" for m in _MLP_MODULES["moe" if moe else "dense"]]
        if moe:
            keep += [f"layers.{i}.{m}" for m in _MOE_FLOAT_MODULES]
    return keep


def _text_config(p: dict) -> tuple[str, dict]:
    text, cte = p["text"], p["cte_buckets"] or [p["bucket"]]
    cfg = {
        "tp_degree": p["tp"], "batch_size": p["batch_size"], "max_batch_size": p["batch_size"],
        "ctx_batch_size": p["batch_size"], "tkg_batch_size": p["batch_size"],
        "seq_len": p["seq_len"], "n_positions": p["seq_len"], "max_context_length": max(cte),
        "torch_dtype": p["dtype"], "logical_nc_config": p["compiler"]["lnc"], "target": p["compiler"]["target"],
        "fused_qkv": p["fused_qkv"], "enable_bucketing": True, "save_sharded_checkpoint": True,
        "skip_sharding": True,  # qbuild's shard step writes the per-rank weights
    }
    if p["graph"] == "cte":
        cfg["context_encoding_buckets"] = [p["bucket"]]
    else:
        cfg["token_generation_buckets"] = [p["bucket"]]
    if p["fp8"] != "none":
        cfg.update(quantized=True, quantization_type="per_channel_symmetric", quantization_dtype="f8e4m3",
                   modules_to_not_convert=modules_to_not_convert(text, p["fp8"], p["fused_qkv"]))
    if text["num_experts"] is None:
        return "NeuronConfig", cfg
    cfg.update(moe_tp_degree=p["moe_tp"], moe_ep_degree=p["ep"], router_config=dict(ROUTER),
               normalize_top_k_affinities=True, blockwise_matmul_config=dict(BLOCKWISE[p["moe_backend"]]))
    return "MoENeuronConfig", cfg


def _vision_config(p: dict) -> dict:
    # The vision encoder is compiled unsharded (the ports' default): one traced module per patch bucket.
    return {"tp_degree": 1, "batch_size": 1, "torch_dtype": p["dtype"], "logical_nc_config": p["compiler"]["lnc"],
            "target": p["compiler"]["target"], "buckets": [p["bucket"]]}


def neuron_config(params: dict) -> dict:
    """The NxDI configuration of one compile node, from its planned params (pure; no torch, no SDK).

    Returns {"config_class", "neuron_config" (the NeuronConfig / MoENeuronConfig fields), "submodel", "bucket",
    "compiler_args", "env"}.
    """
    p = params
    if p["compiler"] is None:
        raise ValueError(f"compile params of backend {p['backend']!r} carry no Neuron compiler settings")
    if p["graph"] == "vision":
        cls, cfg = "NeuronConfig", _vision_config(p)
    else:
        cls, cfg = _text_config(p)
    fp8 = p.get("fp8", "none") != "none" and p["graph"] != "vision"
    return {"config_class": cls, "neuron_config": cfg, "submodel": SUBMODEL[p["graph"]], "bucket": p["bucket"],
            "compiler_args": compiler_args(p["compiler"]["flags"]), "env": dict(FP8_ENV) if fp8 else {}}


def bundle_neuron_config(node_configs: list[dict]) -> dict:
    """Merge the per-node configs of one recipe into the bundle's neuron_config.json (every bucket, sorted)."""
    text = [c for c in node_configs if c["submodel"] != "vision_encoder"]
    if not text:
        raise ValueError("a bundle needs at least one text graph")
    merged = {k: v for k, v in text[0]["neuron_config"].items()
              if k not in ("context_encoding_buckets", "token_generation_buckets")}
    merged["context_encoding_buckets"] = sorted(c["bucket"] for c in text if c["submodel"] == SUBMODEL["cte"])
    merged["token_generation_buckets"] = sorted(c["bucket"] for c in text if c["submodel"] == SUBMODEL["tkg"])
    vision = sorted(c["bucket"] for c in node_configs if c["submodel"] == "vision_encoder")
    return {"config_class": text[0]["config_class"], "neuron_config": merged, "vision_buckets": vision,
            "compiler_args": text[0]["compiler_args"], "env": text[0]["env"]}


# --- the real compile (Neuron SDK) -----------------------------------------------------------------------------

def require_sdk() -> None:
    """Raise one line naming the first Neuron SDK package that does not import here."""
    for module, dist in REQUIRED_PACKAGES:
        if importlib.util.find_spec(module) is None:
            raise BuildError(f"backend neuron: the Neuron SDK is not installed here ({dist} / `import {module}` "
                             "failed); build on a Neuron host, or set `backend: inductor` in the recipe")


def compile_graph(params: dict, out: Path, scratch: Path, log) -> dict:
    """Compile one submodel x bucket with NxDI into `out` (nxdi-layout.md section 7). Returns the node config.

    The NEFF takes its weights as inputs, so the compile needs the architecture only: an HF config.json is
    written from the allow-listed fingerprint in `params` (never from a checkpoint), and the family's NxDI port
    (QBUILD_NXDI_PORT="module:ModelClass:ConfigClass", else the ports' names) builds the application.
    """
    require_sdk()
    import os

    cfg = neuron_config(params)
    os.environ.update(cfg["env"])
    os.environ["NEURON_CC_FLAGS"] = cfg["compiler_args"]
    from neuronx_distributed_inference.models import config as nxdi_config
    from neuronx_distributed_inference.utils.hf_adapter import load_pretrained_config

    model_dir = scratch / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(jsonio.dumps(hf_config(params), indent=1, sort_keys=True))
    nc = getattr(nxdi_config, cfg["config_class"])(**cfg["neuron_config"])
    model_cls, config_cls = _port_classes(params)
    app = model_cls(str(model_dir), config_cls(nc, load_config=load_pretrained_config(str(model_dir))))
    out.mkdir(parents=True, exist_ok=True)
    app.compile(str(out))
    (out / "neuron_config.json").write_text(jsonio.dumps(cfg, indent=1, sort_keys=True))
    log(f"neuron: compiled {cfg['submodel']} bucket {cfg['bucket']}")
    return cfg


# The public ports' module and class names, per family and submodel.
_PORTS = {("qwen3_5", "text"): "modeling_qwen35:NeuronQwen35ForCausalLM:Qwen35InferenceConfig",
          ("qwen3_5_moe", "text"): "modeling_qwen35:NeuronQwen35ForCausalLM:Qwen35InferenceConfig",
          ("qwen3_next", "text"): "modeling_qwen3_next:NeuronQwen3NextForCausalLM:Qwen3NextInferenceConfig",
          ("vision", "vision"): "modeling_qwen35_vision:NeuronQwen35VisionModel:Qwen35VisionInferenceConfig"}


def _port_classes(params: dict):
    import importlib
    import os

    key = ("vision", "vision") if params["graph"] == "vision" else (params["text"]["family"], "text")
    spec = os.environ.get("QBUILD_NXDI_PORT") or _PORTS[key]
    module, model_cls, config_cls = spec.split(":")
    if importlib.util.find_spec(module) is None:
        raise BuildError(f"backend neuron: the NxDI port module `{module}` is not importable; put the port's src/ "
                         "on PYTHONPATH or set QBUILD_NXDI_PORT=module:ModelClass:ConfigClass")
    mod = importlib.import_module(module)
    try:
        return getattr(mod, model_cls), getattr(mod, config_cls)
    except AttributeError as e:
        raise BuildError(f"backend neuron: port module `{module}` has no {e.name}") from None
