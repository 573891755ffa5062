"""FP8 per-channel quantization: the scale formula, its floor, the error bound, and which tensors each policy picks."""

from __future__ import annotations

import re

import pytest
import torch

from qbuild.model.arch import arch_from_config
from qbuild.model.convert.convert import convert_state_dict
from qbuild.model.convert.shard import shard_state_dict
from qbuild.model.convert.deltanet import reorder_qkv_channels
from qbuild.model.convert.fp8 import FP8_DTYPE, FP8_MAX, SCALE_FLOOR, dequantize, quantize
from qbuild.model.ranks import RankLayout
from tests.conftest_convert import hf_state_dict

# e4m3 keeps 3 mantissa bits: round-to-nearest is within 2^-4 relative for normals; below the smallest normal
# (2^-6) the spacing is 2^-9, so the absolute error there is at most 2^-10, in units of the scale.
E4M3_REL = 2.0 ** -4
E4M3_SUBNORMAL_ABS = 2.0 ** -10


def test_scale_is_row_absmax_over_240_in_float32():
    w = torch.randn(16, 40, dtype=torch.bfloat16)
    q, s = quantize(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (16, 1)
    torch.testing.assert_close(s, w.float().abs().amax(dim=1, keepdim=True) / FP8_MAX, rtol=0, atol=0)
    assert q.float().abs().amax() <= FP8_MAX


def test_scale_floor_keeps_zero_rows_finite():
    w = torch.zeros(3, 8)
    w[1] = 1e-9
    q, s = quantize(w)
    assert torch.equal(s, torch.full((3, 1), SCALE_FLOOR))
    assert torch.isfinite(q.float()).all() and q.float()[0].abs().sum() == 0


def test_dequantized_error_within_e4m3_bound():
    w = torch.randn(64, 256) * torch.logspace(-4, 1, 64).unsqueeze(1)  # rows over five decades
    q, s = quantize(w)
    err = (dequantize(q, s) - w).abs()
    bound = w.abs() * E4M3_REL + s * E4M3_SUBNORMAL_ABS
    assert (err <= bound * (1 + 1e-6)).all()
    assert err.max() > 0  # it really is quantized


def test_expert_tensors_get_one_scale_per_output_channel_of_each_expert():
    w = torch.randn(4, 32, 10)  # NxDI (E, in, out)
    q, s = quantize(w)
    assert q.shape == w.shape and s.shape == (4, 1, 10)
    torch.testing.assert_close(s, w.abs().amax(dim=1, keepdim=True) / FP8_MAX, rtol=0, atol=0)
    assert ((dequantize(q, s) - w).abs() <= w.abs() * E4M3_REL + s * E4M3_SUBNORMAL_ABS + 1e-12).all()


def _quantized(text: dict) -> set[str]:
    assert all((n.removesuffix(".scale") + ".weight") in text for n in text if n.endswith(".scale"))
    return {n for n, t in text.items() if t.dtype == FP8_DTYPE}


DENSE_MLP = {f"layers.{i}.mlp.{p}_proj.weight" for i in (1, 2) for p in ("gate", "up", "down")}
MOE_MLP = {f"layers.{i}.mlp.{p}.weight" for i in (1, 2)
           for p in ("moe.expert_mlps.mlp_op.gate_up_proj", "moe.expert_mlps.mlp_op.down_proj",
                     "shared_gate_proj", "shared_up_proj", "shared_down_proj")}


@pytest.mark.parametrize("variant, expected", [("qwen3_5", DENSE_MLP), ("qwen3_5_moe", MOE_MLP),
                                               ("qwen3_next", MOE_MLP)])
def test_mlp_only_quantizes_the_mlp_of_the_middle_layers(variant, expected):
    config, hf = hf_state_dict(variant)
    assert _quantized(convert_state_dict(config, hf, fp8="none")[0]) == set()
    text, vision = convert_state_dict(config, hf, fp8="mlp_only")
    assert _quantized(text) == expected  # not layer 0, not layer 3 (the last), not the router
    assert all(text[n.removesuffix(".weight") + ".scale"].dtype == torch.float32 for n in expected)
    assert not _quantized(vision)


def test_full_adds_attention_and_deltanet_projections_in_every_layer():
    config, hf = hf_state_dict("qwen3_5")
    text, _ = convert_state_dict(config, hf, fp8="full")
    got = _quantized(text)
    attn = {f"layers.3.self_attn.{p}.weight" for p in ("q_proj", "output_gate_proj", "k_proj", "v_proj", "o_proj")}
    dn = {f"layers.{i}.linear_attn.{p}.weight" for i in (0, 1, 2) for p in ("in_proj_qkv", "in_proj_z", "out_proj")}
    mlp = {f"layers.{i}.mlp.{p}_proj.weight" for i in range(4) for p in ("gate", "up", "down")}
    assert got == attn | dn | mlp
    never = re.compile(r".*(norm|layernorm|conv1d|A_log|dt_bias|in_proj_a|in_proj_b|embed|lm_head).*")
    assert not any(never.fullmatch(n) for n in got)


def test_query_gate_scales_split_like_their_weights():
    config, hf = hf_state_dict("qwen3_5")
    text, _ = convert_state_dict(config, hf, fp8="full")
    qw = hf["model.language_model.layers.3.self_attn.q_proj.weight"].reshape(4, 64, 64)
    _, q_scale = quantize(qw[:, :32].reshape(128, 64))
    _, g_scale = quantize(qw[:, 32:].reshape(128, 64))
    assert torch.equal(text["layers.3.self_attn.q_proj.scale"], q_scale)
    assert torch.equal(text["layers.3.self_attn.output_gate_proj.scale"], g_scale)


def test_sharded_scales_follow_fused_qkv_reorder_and_row_splits():
    config, hf = hf_state_dict("qwen3_5")
    text, _ = convert_state_dict(config, hf, fp8="full")
    ranks = shard_state_dict(config, text, ranks=RankLayout.split(2), fused_qkv=True)
    a = "layers.3.self_attn."
    for r, rank in enumerate(ranks):
        want = torch.cat([text[f"{a}q_proj.scale"].chunk(2)[r], text[f"{a}k_proj.scale"].chunk(2)[r],
                          text[f"{a}v_proj.scale"].chunk(2)[r]])
        assert torch.equal(rank[f"{a}Wqkv.scale"], want)
        assert rank[f"{a}Wqkv.weight"].dtype == FP8_DTYPE and f"{a}q_proj.scale" not in rank
        assert torch.equal(rank[f"{a}o_proj.scale"], text[f"{a}o_proj.scale"])  # row split: scale replicated
    arch = arch_from_config(config)
    s = text["layers.0.linear_attn.in_proj_qkv.scale"]
    assert torch.equal(torch.cat([r["layers.0.linear_attn.in_proj_qkv.scale"] for r in ranks]),
                       reorder_qkv_channels(s, arch, 2))


def test_each_policy_is_one_object_every_stage_asks():
    """The recipe's fp8 names one policy: which layers' MLPs it quantizes, whether attention too, and what a weight
    costs in the estimates; the converter's rule for a tensor follows it."""
    from qbuild.model.convert.fp8 import is_quantized
    from qbuild.model.fp8 import NAMES, policy

    assert NAMES == ("none", "mlp_only", "full")
    none, mlp_only, full = (policy(n) for n in NAMES)
    assert not none.quantizes and none.mlp_layers(4) == range(0) and none.mlp_bytes(2) == 2
    assert mlp_only.mlp_layers(4) == range(1, 3) and not mlp_only.quantizes_attention and mlp_only.mlp_bytes(2) == 1
    assert full.mlp_layers(4) == range(4) and full.quantizes_attention
    for p in (none, mlp_only, full):
        for layer in range(4):
            assert is_quantized(f"layers.{layer}.mlp.down_proj.weight", p.name, 4) == (layer in p.mlp_layers(4))
            assert is_quantized(f"layers.{layer}.self_attn.o_proj.weight", p.name, 4) == p.quantizes_attention
    with pytest.raises(ValueError, match="fp8 must be one of none, mlp_only, full, got 'half'"):
        policy("half")
