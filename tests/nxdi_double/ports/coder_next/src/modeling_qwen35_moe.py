"""Fake of the moe-lineage port module contrib/models/Qwen3-Coder-Next/src/modeling_qwen35_moe.py (NxDI PR 170 @
753c7f5), for the NxDI contract double.

It keeps what qbuild depends on (docs/nxdi.md section 15): FLAT imports of its siblings (src/ on sys.path),
Qwen35MoeInferenceConfig's required attributes, text_config flattening and the router settings it forces, the app's
get_compiler_args() (with the DGE flag), and, in NeuronQwen35MoeModel.rank_weights, the weights the compiled model
takes per rank: fully replicated DeltaNet (plain nn.Linear / nn.Conv1d / nn.Parameter), MoE directly under `mlp.`,
the sigmoid-gated shared expert around NxD's SharedExperts (docs/nxdi.md sections 1 and 4, docs/nxdi.md section 14).
Key names are completed from the port's converter (docs/nxdi.md section 15: router.linear_router.weight,
sigmoid_gate.weight, q_layernorm / k_layernorm, conv1d.weight, A_log, dt_bias, norm.weight).
"""

from __future__ import annotations

import os

import torch
from nki_deltanet import deltanet_recurrent_fwd as _deltanet_nki_kernel  # noqa: F401  (l.50: flat import)

from neuronx_distributed_inference._nxd import (
    Weight,
    column,
    expert_dispatch,
    experts,
    parallel_embedding,
    replicated,
    replicated_deltanet,
    row,
    tp_rank,
)
from neuronx_distributed_inference.models.config import InferenceConfig, MoENeuronConfig
from neuronx_distributed_inference.models.model_base import NeuronBaseForCausalLM
from neuronx_distributed_inference.modules.attention.gqa import attention_weights


# The switches the real module reads from the environment while tracing, each of which changes the traced graph:
# DELTANET_FP32 (l.643), SKIP_CONV1D (l.723), SKIP_LAYER_COMPUTE (l.1713), DELTANET_PROJ_ONLY (l.1734),
# SKIP_ATTN_COMPUTE (l.1771), SKIP_MOE_COMPUTE (l.1854) (docs/nxdi.md section 19).
TRACE_SWITCHES = ("DELTANET_FP32", "SKIP_CONV1D", "SKIP_LAYER_COMPUTE", "DELTANET_PROJ_ONLY", "SKIP_ATTN_COMPUTE",
                  "SKIP_MOE_COMPUTE")


class Qwen35MoeInferenceConfig(InferenceConfig):
    def __init__(self, neuron_config=None, fused_spec_config=None, load_config=None, metadata=None, **kwargs):
        super().__init__(neuron_config, fused_spec_config=fused_spec_config, load_config=load_config,
                         metadata=metadata, **kwargs)
        # Tail of __init__: the sigmoid-gated shared expert is the port's own (n_shared_experts 0), the experts are
        # built from intermediate_size, and the router settings are forced whatever the caller passed.
        # maybe_pad_intermediate() is left out: the port computes a pad that neither its converter nor its modules
        # use (docs/nxdi.md section 14).
        self.num_local_experts = self.num_experts
        self.n_shared_experts = 0
        self.intermediate_size = self.moe_intermediate_size
        self.neuron_config.router_config.dtype = torch.float32
        self.neuron_config.router_config.act_fn = "softmax"
        self.neuron_config.disable_numeric_cc_token = True
        self.neuron_config.normalize_top_k_affinities = True

    def add_derived_config(self) -> None:
        # "When loaded via vLLM ... model fields live inside text_config": flatten what is not set at the top.
        if hasattr(self, "text_config") and not hasattr(self, "hidden_size"):
            tc = self.text_config
            for attr in dir(tc):
                if not attr.startswith("_") and not hasattr(self, attr):
                    setattr(self, attr, getattr(tc, attr))
        if not hasattr(self, "rope_theta"):
            self.rope_theta = (getattr(self, "rope_parameters", None) or {}).get("rope_theta", 10000000)
        super().add_derived_config()

    def get_required_attributes(self) -> list[str]:
        return ["head_dim", "hidden_act", "hidden_size", "max_position_embeddings", "moe_intermediate_size",
                "num_attention_heads", "num_experts", "num_experts_per_tok", "num_hidden_layers",
                "num_key_value_heads", "rms_norm_eps", "rope_theta", "vocab_size", "linear_num_value_heads",
                "linear_num_key_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
                "layer_types"]

    @classmethod
    def get_neuron_config_cls(cls):
        return MoENeuronConfig


def _dtype(config) -> str:
    return str(config.neuron_config.torch_dtype).split(".")[1]


class NeuronQwen35MoeModel:
    """The traced model, reduced to what the double needs from it."""

    LINEAGE = "moe"   # docs/nxdi.md section 1: the double's value check at load lays shards out for this lineage

    @staticmethod
    def rank_weights(config) -> dict[str, Weight]:
        nc = config.neuron_config
        if nc.quantized or getattr(config, "moe_fused_nki_kernel_enabled", False):
            raise NotImplementedError("the contract double models neither quantized weights nor the fused MoE TKG "
                                      "kernel's extra tensors")
        tp, dt, h = nc.tp_degree, _dtype(config), config.hidden_size
        out = {"embed_tokens.weight": parallel_embedding(config.vocab_size, h, tp, dt),
               "lm_head.weight": column(config.vocab_size, h, tp, dt),
               "norm.weight": replicated((h,), dt),
               "rank_util.rank": tp_rank()}
        for i, kind in enumerate(config.layer_types):
            p = f"layers.{i}"
            out[f"{p}.input_layernorm.weight"] = replicated((h,), dt)
            out[f"{p}.post_attention_layernorm.weight"] = replicated((h,), dt)
            if kind == "full_attention":
                heads, d = config.num_attention_heads, config.head_dim
                a = f"{p}.self_attn"
                out.update(attention_weights(a, tp, heads, config.num_key_value_heads, d, h, dt, nc.fused_qkv))
                out[f"{a}.output_gate_proj.weight"] = column(heads * d, h, tp, dt)
                out[f"{a}.q_layernorm.weight"] = replicated((d,), dt)
                out[f"{a}.k_layernorm.weight"] = replicated((d,), dt)
                out[f"{a}.rank_util.rank"] = tp_rank()
            elif kind == "linear_attention":
                out.update(replicated_deltanet(f"{p}.linear_attn", config, dt))
            else:
                raise ValueError(f"layer_types[{i}]: {kind!r}")
            out.update(_moe(f"{p}.mlp", config, tp, dt))
        return out

    @staticmethod
    def trace(config, tag: str, bucket: int, tokens: int, seq_len: int) -> dict:
        """NxD's expert dispatch, and the switches read while tracing ("env": each one's value, None where unset),
        both in the bucket's "HLO": with SKIP_MOE_COMPUTE=1 the layers trace no MoE (l.1854-1858)."""
        switches = {name: os.environ.get(name) for name in TRACE_SWITCHES}
        experts_path = None if switches["SKIP_MOE_COMPUTE"] == "1" else expert_dispatch(
            config.neuron_config, tokens, config.num_experts_per_tok, config.num_experts, seq_len)
        return {"experts": experts_path, "env": switches}


def _moe(prefix: str, config, tp: int, dt: str) -> dict:
    """Router replicated, experts under `mlp.expert_mlps`, the shared expert Column/RowParallel over the tp group,
    its sigmoid gate a plain nn.Linear(H, 1)."""
    h, e, shared = config.hidden_size, config.num_experts, config.shared_expert_intermediate_size
    out = {f"{prefix}.router.linear_router.weight": replicated((e, h), dt)}
    out.update(experts(f"{prefix}.expert_mlps", config.neuron_config, e, h, config.intermediate_size, dt))
    s = f"{prefix}.shared_experts"
    out[f"{s}.shared_experts.gate_proj.weight"] = column(shared, h, tp, dt)
    out[f"{s}.shared_experts.up_proj.weight"] = column(shared, h, tp, dt)
    out[f"{s}.shared_experts.down_proj.weight"] = row(h, shared, tp, dt)
    out[f"{s}.sigmoid_gate.weight"] = replicated((1, h), dt)
    return out


class NeuronQwen35MoeForCausalLM(NeuronBaseForCausalLM):
    _model_cls = NeuronQwen35MoeModel

    @classmethod
    def get_config_cls(cls):
        return Qwen35MoeInferenceConfig

    def get_compiler_args(self):   # l.3763
        optimization_level = "-O1"
        compiler_args = (
            "--enable-saturate-infinity "
            "--enable-mixed-precision-accumulation "
            f"--model-type transformer {optimization_level} "
            "--auto-cast=none "
            "--internal-enable-dge-levels vector_dynamic_offsets "
        )
        return compiler_args
