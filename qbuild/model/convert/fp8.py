"""Offline FP8 weight quantization (docs/nxd-layout.md section 5): per-channel symmetric float8 e4m3.

scale = max |w| over a channel's inputs / 240, floored at 1e-5, float32, stored as `<name>.scale` next to the fp8
`<name>.weight`. 240, not e4m3fn's 448: Neuron's FP8 saturates at the IEEE-style e4m3 range.
The reduction is over dim 1 in both weight layouts: a linear (out, in) gets a scale (out, 1), an NxDI expert tensor
(E, in, out) gets (E, 1, out), one scale per output channel of each expert.

Policies (qbuild.model.fp8: which layers; here: which tensors, by layer-relative NxDI name):
- "mlp_only", the validated 128K serving path: the MLP of every layer but the first and the last. For the MoE
  families "the MLP" is the routed experts (gate_up, down) and the shared expert (shared_{gate,up,down}_proj): they
  hold nearly all of an MoE layer's bytes and are the same SwiGLU matmuls as a dense MLP. The router and
  shared_expert_gate stay unquantized: they are tiny, and top-k selection is sensitive to router precision (NxDI runs
  the router in float32).
- "full": that set plus the attention and DeltaNet projections (q, output gate, k, v, o, in_proj_qkv, in_proj_z,
  out_proj), in EVERY layer: the first/last-layer exemption belongs to the mlp_only recipe. in_proj_a/b, lm_head,
  embeddings, conv1d, A_log, dt_bias, norms and the vision encoder are never quantized.
"""

from __future__ import annotations

import re

import torch

from qbuild.model.convert.experts import DOWN, GATE_UP
from qbuild.model.fp8 import FP8PolicyName, policy as fp8_policy

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 240.0
SCALE_FLOOR = 1e-5

MLP_WEIGHTS = frozenset({
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    f"{GATE_UP}.weight", f"{DOWN}.weight",
    "mlp.shared_gate_proj.weight", "mlp.shared_up_proj.weight", "mlp.shared_down_proj.weight",
})
ATTENTION_WEIGHTS = frozenset({
    "self_attn.q_proj.weight", "self_attn.output_gate_proj.weight", "self_attn.k_proj.weight",
    "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.out_proj.weight",
})
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def is_quantized(name: str, policy: FP8PolicyName, num_layers: int) -> bool:
    """Whether the NxDI tensor `name` is stored as FP8 under `policy`."""
    m = _LAYER.fullmatch(name)
    if m is None:
        return False
    layer, rest, rules = int(m[1]), m[2], fp8_policy(policy)
    if rest in MLP_WEIGHTS:
        return layer in rules.mlp_layers(num_layers)
    return rest in ATTENTION_WEIGHTS and rules.quantizes_attention


def scale_name(weight_name: str) -> str:
    return weight_name.removesuffix(".weight") + ".scale"


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (out, in) or (E, in, out) -> (fp8 weight of the same shape, float32 scale with dim 1 reduced to 1)."""
    if w.ndim == 3:  # one expert at a time: the float32 working copy stays one expert's size
        pairs = [_quantize_2d_rows(x) for x in w.unbind(0)]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    return _quantize_linear(w)


def _quantize_linear(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    wf = w.float()
    scale = (wf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(SCALE_FLOOR)
    return (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def _quantize_2d_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert (in, out): its channels are the columns, so the scale is (1, out)."""
    q, s = _quantize_linear(x.T)
    return q.T, s.T


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


def apply_policy(name: str, tensor: torch.Tensor, policy: FP8PolicyName, num_layers: int) -> dict[str, torch.Tensor]:
    """{name: tensor}, or {name: fp8 weight, <name>.scale: scale} when the policy quantizes it."""
    if not is_quantized(name, policy, num_layers):
        return {name: tensor}
    q, s = quantize(tensor)
    return {name: q, scale_name(name): s}
