"""The DeltaNet / conv / attention reference kernels: every fast form against the naive one, and against
transformers' own torch implementations (the oracle nobody here wrote)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qbuild.model.kernels import (
    CHUNK_SIZE,
    causal_conv1d,
    causal_conv1d_update,
    chunk_gated_delta_rule,
    gqa_attention,
    naive_gqa_attention,
    naive_recurrent,
    recurrent_gated_delta_rule,
    unit_lower_triangular_inverse,
)

# float32 forms against the float64 naive oracle: a few ulps of accumulated rounding over ~128 steps.
FP32_VS_FP64_ATOL = 2e-5
# Our float32 forms against transformers' float32 forms (different summation orders).
VS_HF_ATOL = 5e-5
# bfloat16 attention (8 mantissa bits) of values ~1: two orders of summation agree to a few bf16 ulps.
BF16_ATOL = 3e-2

B, HK, HV, DK, DV = 2, 2, 4, 16, 16


def _inputs(length: int, seed: int = 0, g_scale: float = 1.0, dtype=torch.float32):
    """Random DeltaNet inputs of a tiny model's shape: L2-normalised q/k, g <= 0, beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, length, HK, DK, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, length, HK, DK, generator=gen), dim=-1)
    v = torch.randn(B, length, HV, DV, generator=gen)
    g = -torch.rand(B, length, HV, generator=gen) * g_scale
    beta = torch.rand(B, length, HV, generator=gen)
    state = torch.randn(B, HV, DK, DV, generator=gen)
    return tuple(x.to(dtype) for x in (q, k, v, g, beta, state))


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("length", [1, 63, 64, 75, 128])
@pytest.mark.parametrize("form", [chunk_gated_delta_rule, recurrent_gated_delta_rule])
def test_forms_match_naive_float64(form, length):
    inputs = _inputs(length, seed=length)
    ref_out, ref_state = naive_recurrent(*(x.double() for x in inputs))
    out, state = form(*inputs)
    assert out.dtype == torch.float32 and state.dtype == torch.float32
    assert out.shape == (B, length, HV, DV) and state.shape == (B, HV, DK, DV)
    assert _max_err(out, ref_out) < FP32_VS_FP64_ATOL
    assert _max_err(state, ref_state) < FP32_VS_FP64_ATOL


def test_zero_initial_state_is_the_default():
    q, k, v, g, beta, _ = _inputs(70)
    zeros = torch.zeros(B, HV, DK, DV)
    for form in (naive_recurrent, chunk_gated_delta_rule, recurrent_gated_delta_rule):
        out_none, state_none = form(q, k, v, g, beta, None)
        out_zero, state_zero = form(q, k, v, g, beta, zeros)
        assert torch.equal(out_none, out_zero) and torch.equal(state_none, state_zero)


@pytest.mark.parametrize("prefix", [5, 64, 70])
def test_chunk_prefix_then_recurrent_rest_equals_full_run(prefix):
    length = 80
    q, k, v, g, beta, state0 = _inputs(length, seed=3)
    full_out, full_state = chunk_gated_delta_rule(q, k, v, g, beta, state0)
    head = slice(0, prefix)
    out, state = chunk_gated_delta_rule(q[:, head], k[:, head], v[:, head], g[:, head], beta[:, head], state0)
    outs = [out]
    for t in range(prefix, length):  # one decode step at a time, as the decode graph runs
        step = slice(t, t + 1)
        out, state = recurrent_gated_delta_rule(q[:, step], k[:, step], v[:, step], g[:, step], beta[:, step], state)
        outs.append(out)
    assert _max_err(torch.cat(outs, dim=1), full_out) < FP32_VS_FP64_ATOL
    assert _max_err(state, full_state) < FP32_VS_FP64_ATOL


@pytest.mark.parametrize("g_scale", [1e3, 1e5, 1e30])
def test_very_negative_decay_stays_finite(g_scale):
    q, k, v, g, beta, state0 = _inputs(130, seed=5, g_scale=g_scale)
    g[:, ::7] = 0.0  # mix no-decay steps between the huge ones, so cumulative sums span a vast range
    ref_out, ref_state = naive_recurrent(*(x.double() for x in (q, k, v, g, beta, state0)))
    for form in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        out, state = form(q, k, v, g, beta, state0)
        assert torch.isfinite(out).all() and torch.isfinite(state).all()
        assert _max_err(out, ref_out) < FP32_VS_FP64_ATOL


def test_padded_steps_leave_the_state_untouched():
    """Right-padding is masked with beta = 0 and g = 0; garbage q/k/v there must not reach the state."""
    q, k, v, g, beta, state0 = _inputs(90, seed=7)
    real = 70
    _, ref_state = chunk_gated_delta_rule(q[:, :real], k[:, :real], v[:, :real], g[:, :real], beta[:, :real], state0)
    g, beta, v = g.clone(), beta.clone(), v.clone()
    g[:, real:], beta[:, real:] = 0.0, 0.0
    v[:, real:] = 1e4  # garbage values in the padding
    for form in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        _, state = form(q, k, v, g, beta, state0)
        assert _max_err(state, ref_state) < FP32_VS_FP64_ATOL


def test_unit_lower_triangular_inverse_matches_solve_triangular():
    gen = torch.Generator().manual_seed(0)
    keys = F.normalize(torch.randn(6, CHUNK_SIZE, DK, generator=gen), dim=-1)
    beta = torch.rand(6, CHUNK_SIZE, generator=gen)
    strict = ((keys * beta[..., None]) @ keys.transpose(-1, -2)).tril(-1)
    eye = torch.eye(CHUNK_SIZE)
    expected = torch.linalg.solve_triangular(eye + strict, eye.expand(6, -1, -1), upper=False, unitriangular=True)
    assert _max_err(unit_lower_triangular_inverse(strict), expected) < FP32_VS_FP64_ATOL
    with pytest.raises(ValueError, match="power of two"):
        unit_lower_triangular_inverse(torch.zeros(48, 48))


@pytest.mark.parametrize("length", [63, 64, 75])
def test_against_transformers_delta_rule(length):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    q, k, v, g, beta, state0 = _inputs(length, seed=11)
    hf_out, hf_state = hf.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state0,
                                                       output_final_state=True, use_qk_l2norm_in_kernel=False)
    out, state = chunk_gated_delta_rule(q, k, v, g, beta, state0)
    assert _max_err(out, hf_out) < VS_HF_ATOL and _max_err(state, hf_state) < VS_HF_ATOL
    step = slice(0, 1)
    hf_out, hf_state = hf.torch_recurrent_gated_delta_rule(
        q[:, step], k[:, step], v[:, step], g=g[:, step], beta=beta[:, step], initial_state=state0,
        output_final_state=True, use_qk_l2norm_in_kernel=False)
    out, state = recurrent_gated_delta_rule(q[:, step], k[:, step], v[:, step], g[:, step], beta[:, step], state0)
    assert _max_err(out, hf_out) < VS_HF_ATOL and _max_err(state, hf_state) < VS_HF_ATOL


CHANNELS, TAPS = 24, 4


def _conv_inputs(length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, CHANNELS, length, generator=gen), torch.randn(CHANNELS, TAPS, generator=gen)


@pytest.mark.parametrize("length", [1, 2, 9])
def test_conv_against_transformers(length):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    x, weight = _conv_inputs(length)
    out, state = causal_conv1d(x, weight)
    assert _max_err(out, hf.causal_conv1d_fn(x, weight, activation=None)) < VS_HF_ATOL
    hf_state = F.pad(x, (TAPS - 1, 0))[:, :, -(TAPS - 1):]  # HF keeps the last K-1 inputs, zero-filled
    assert torch.equal(state, hf_state)
    step = torch.randn(B, CHANNELS, 1)
    hf_conv_state = hf_state.clone()
    hf_out = hf.causal_conv1d_update(step, hf_conv_state, weight, activation=None)  # updates its state in place
    out, state = causal_conv1d_update(step[:, :, 0], hf_state, weight)
    assert _max_err(out, hf_out[:, :, 0]) < VS_HF_ATOL and torch.equal(state, hf_conv_state)


def test_conv_prefill_then_steps_equals_full_and_padding_is_ignored():
    x, weight = _conv_inputs(12, seed=1)
    full, full_state = causal_conv1d(x, weight)
    out, state = causal_conv1d(x[:, :, :5], weight)
    outs = [out]
    for t in range(5, 12):
        out, state = causal_conv1d_update(x[:, :, t], state, weight)
        outs.append(out[:, :, None])
    assert _max_err(torch.cat(outs, dim=-1), full) < VS_HF_ATOL and torch.equal(state, full_state)
    # Right-padded rows: the state is gathered at each row's last real inputs (with zeros before the start).
    seq_lens = torch.tensor([7, 2])
    padded = x.clone()
    padded[0, :, 7:], padded[1, :, 2:] = 99.0, 99.0
    _, state = causal_conv1d(padded, weight, seq_lens=seq_lens)
    assert torch.equal(state[0], x[0, :, 4:7])
    assert torch.equal(state[1], F.pad(x[1, :, :2], (1, 0)))


def test_gqa_attention_matches_sdpa():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, 4, 9, 32, generator=gen)
    k, v = torch.randn(B, 2, 9, 32, generator=gen), torch.randn(B, 2, 9, 32, generator=gen)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    assert _max_err(gqa_attention(q, k, v, causal[None, None], 32**-0.5), expected) < VS_HF_ATOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_attention_matches_the_plain_form_on_a_chunk_over_a_kv_bucket(dtype):
    """What extend runs: 5 queries at slots 11..15 attending to the slots at or before theirs in a bucket of 24 (the
    slots past them hold garbage, which the mask must keep out), two query heads per kv head."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(B, 4, 5, 32, generator=gen).to(dtype)
    k, v = (torch.randn(B, 2, 24, 32, generator=gen).to(dtype) for _ in range(2))
    k[:, :, 16:], v[:, :, 16:] = 1e4, -1e4
    allowed = (torch.arange(24)[None, :] <= torch.arange(11, 16)[:, None])[None, None]
    out, expected = gqa_attention(q, k, v, allowed, 32**-0.5), naive_gqa_attention(q, k, v, allowed, 32**-0.5)
    assert out.dtype == dtype and out.shape == (B, 4, 5, 32)
    assert _max_err(out, expected) < (VS_HF_ATOL if dtype == torch.float32 else BF16_ATOL)
