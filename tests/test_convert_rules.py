"""Each layout rule of docs/nxd-layout.md, on its worked example or on hand-made tensors, then on a tiny checkpoint."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from qbuild.model.arch import arch_from_config
from qbuild.model.convert import CheckpointError
from qbuild.model.convert.convert import convert_state_dict
from qbuild.model.convert.attention import kv_head_shards, split_query_gate
from qbuild.model.convert.deltanet import rank_channels, reorder_qkv_channels, split_ba, split_qkvz
from qbuild.model.convert.moe import down_from_experts, down_from_fused, gate_up_from_experts, gate_up_from_fused
from tests.conftest_convert import hf_state_dict

VL, TEXT = "model.language_model.", "model."


def test_query_gate_split_deinterleaves_per_head():
    # nH=2, D=2: rows are [h0 query (2) | h0 gate (2) | h1 query (2) | h1 gate (2)]
    w = torch.arange(8.0).reshape(8, 1).expand(8, 3)
    q, gate = split_query_gate(SimpleNamespace(head_dim=2), w)
    assert q[:, 0].tolist() == [0, 1, 4, 5]
    assert gate[:, 0].tolist() == [2, 3, 6, 7]
    # the same split applies to an FP8 scale (nH*2D, 1)
    qs, gs = split_query_gate(SimpleNamespace(head_dim=2), torch.arange(8.0).reshape(8, 1))
    assert qs.flatten().tolist() == [0, 1, 4, 5] and gs.flatten().tolist() == [2, 3, 6, 7]


def test_deltanet_tp2_reorder_matches_the_worked_example():
    config, _ = hf_state_dict("qwen3_next")
    # key_dim 128, value_dim 256
    dims = replace(arch_from_config(config), num_k_heads=2, k_head_dim=64, num_v_heads=4, v_head_dim=64)
    s = torch.arange(512)
    expected = torch.cat([s[0:64], s[128:192], s[256:384], s[64:128], s[192:256], s[384:512]])
    assert torch.equal(reorder_qkv_channels(s, dims, tp=2), expected)
    assert torch.equal(reorder_qkv_channels(s, dims, tp=1), s)
    assert torch.equal(s[rank_channels(dims, 2, 1)], expected[256:])


def test_kv_heads_split_then_replicate():
    k = torch.arange(4.0).repeat_interleave(3).reshape(12, 1)  # 4 kv heads of 3 rows, row value = head index
    heads = lambda parts: [p[:, 0].unique().tolist() for p in parts]  # noqa: E731
    assert heads(kv_head_shards(k, 4, 2)) == [[0, 1], [2, 3]]
    assert heads(kv_head_shards(k, 4, 8)) == [[0], [0], [1], [1], [2], [2], [3], [3]]


def test_experts_are_transposed_with_gate_before_up_in_both_storage_forms():
    e, i, h = 3, 2, 4
    gate = torch.randn(e, i, h)
    up = torch.randn(e, i, h)
    down = torch.randn(e, h, i)
    (fused,) = gate_up_from_fused(torch.cat([gate, up], dim=1))
    assert fused.shape == (e, h, 2 * i)
    assert torch.equal(fused[:, :, :i], gate.transpose(1, 2)) and torch.equal(fused[:, :, i:], up.transpose(1, 2))
    per_expert = [t for x in range(e) for t in (gate[x], up[x])]
    assert torch.equal(gate_up_from_experts(*per_expert)[0], fused)
    assert torch.equal(down_from_fused(down)[0], down.transpose(1, 2))
    assert torch.equal(down_from_experts(*down.unbind(0))[0], down.transpose(1, 2))


def test_qkvz_ba_deinterleave_matches_transformers():
    """Oracle: transformers' own fix_query_key_value_ordering on the projected activations."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    from qbuild.model.tinymodel import make_config

    config = make_config("qwen3_next", vision=False)
    layer = Qwen3NextGatedDeltaNet(config, layer_idx=0)
    dims = SimpleNamespace(num_k_heads=2, num_v_heads=4, k_head_dim=16, v_head_dim=16)
    wqkvz, wba = torch.randn(192, 64), torch.randn(8, 64)
    x = torch.randn(1, 5, 64)
    q, k, v, z, b, a = layer.fix_query_key_value_ordering(x @ wqkvz.T, x @ wba.T)
    qkv, z_w = split_qkvz(dims, wqkvz)
    b_w, a_w = split_ba(dims, wba)
    ours_q, ours_k, ours_v = (x @ qkv.T).split([32, 32, 64], dim=-1)
    torch.testing.assert_close(ours_q, q.reshape(1, 5, -1))
    torch.testing.assert_close(ours_k, k.reshape(1, 5, -1))
    torch.testing.assert_close(ours_v, v.reshape(1, 5, -1))
    torch.testing.assert_close(x @ z_w.T, z.reshape(1, 5, -1))
    torch.testing.assert_close(x @ b_w.T, b)
    torch.testing.assert_close(x @ a_w.T, a)


@pytest.fixture(scope="module")
def dense():
    config, hf = hf_state_dict("qwen3_5")
    text, vision = convert_state_dict(config, hf, dtype="bfloat16")
    return config, hf, text, vision


def test_vl_prefixes_and_names(dense):
    config, hf, text, vision = dense
    assert not any(n.startswith("model.") for n in text) and not any(n.startswith("model.") for n in vision)
    assert {"embed_tokens.weight", "lm_head.weight", "norm.weight", "layers.3.self_attn.q_proj.weight",
            "layers.3.self_attn.output_gate_proj.weight", "layers.3.self_attn.q_layernorm.weight",
            "layers.0.linear_attn.conv1d_weight.weight", "layers.0.linear_attn.A_log_weight.weight",
            "layers.0.mlp.gate_proj.weight"} <= text.keys()
    assert not {"layers.3.self_attn.q_norm.weight", "layers.0.linear_attn.A_log"} & text.keys()
    assert {"blocks.1.attn.qkv.weight", "merger_norm.weight", "merger_fc1.weight", "merger_fc2.bias",
            "patch_embed.proj.weight", "pos_embed.weight"} <= vision.keys()
    assert not any(n.startswith("merger.") for n in vision)


def test_text_only_prefix():
    config, hf = hf_state_dict("qwen3_next")
    text, vision = convert_state_dict(config, hf)
    assert vision == {} and "layers.3.self_attn.k_proj.weight" in text
    assert not any(n.startswith("model.") for n in text)


def test_norms_get_plus_one_in_float32_and_only_the_listed_ones(dense):
    config, hf, text, vision = dense
    for hf_name, nx_name in [(f"{VL}norm.weight", "norm.weight"),
                             (f"{VL}layers.0.input_layernorm.weight", "layers.0.input_layernorm.weight"),
                             (f"{VL}layers.2.post_attention_layernorm.weight", "layers.2.post_attention_layernorm.weight"),
                             (f"{VL}layers.3.self_attn.q_norm.weight", "layers.3.self_attn.q_layernorm.weight"),
                             (f"{VL}layers.3.self_attn.k_norm.weight", "layers.3.self_attn.k_layernorm.weight")]:
        assert text[nx_name].dtype == torch.float32, nx_name
        assert torch.equal(text[nx_name], hf[hf_name].float() + 1.0), nx_name
    # DeltaNet's gated norm and the vision LayerNorms are standard norms: cast only
    dn = text["layers.0.linear_attn.norm.weight"]
    assert dn.dtype == torch.bfloat16 and torch.equal(dn, hf[f"{VL}layers.0.linear_attn.norm.weight"].bfloat16())
    assert torch.equal(vision["blocks.0.norm1.weight"], hf["model.visual.blocks.0.norm1.weight"].bfloat16())
    assert torch.equal(vision["merger_norm.weight"], hf["model.visual.merger.norm.weight"].bfloat16())


def test_other_tensors_are_cast_and_reshaped(dense):
    config, hf, text, vision = dense
    assert text["layers.0.linear_attn.conv1d_weight.weight"].shape == (128, 4)
    assert torch.equal(text["layers.0.linear_attn.conv1d_weight.weight"],
                       hf[f"{VL}layers.0.linear_attn.conv1d.weight"][:, 0].bfloat16())
    assert torch.equal(text["layers.0.linear_attn.A_log_weight.weight"],
                       hf[f"{VL}layers.0.linear_attn.A_log"].bfloat16().reshape(4, 1))
    assert text["layers.0.linear_attn.dt_bias_weight.weight"].shape == (4, 1)
    # DeltaNet in_proj_qkv stays in HF order at convert time: the per-rank reorder is a shard-time rule
    assert torch.equal(text["layers.0.linear_attn.in_proj_qkv.weight"],
                       hf[f"{VL}layers.0.linear_attn.in_proj_qkv.weight"].bfloat16())
    assert all(t.dtype in (torch.bfloat16, torch.float32) for t in text.values())
    assert all(t.dtype == torch.bfloat16 for t in vision.values())


def test_mtp_tensors_are_dropped():
    config, hf = hf_state_dict("qwen3_5")
    hf = dict(hf, **{"mtp.fc.weight": torch.zeros(64, 128), "mtp.layers.0.input_layernorm.weight": torch.zeros(64)})
    text, vision = convert_state_dict(config, hf)
    assert not any("mtp" in n for n in list(text) + list(vision))


def test_tied_embeddings_copy_the_embedding_into_lm_head():
    config, hf = hf_state_dict("qwen3_5")
    del hf["lm_head.weight"]
    with pytest.raises(CheckpointError, match="'lm_head.weight' is missing"):
        convert_state_dict(config, hf)
    config = dict(config, tie_word_embeddings=True)
    text, _ = convert_state_dict(config, hf)
    assert torch.equal(text["lm_head.weight"], text["embed_tokens.weight"])
    assert torch.equal(text["lm_head.weight"], hf[f"{VL}embed_tokens.weight"].bfloat16())


def test_pad_row_is_zeroed_for_qwen3_next_only():
    config, hf = hf_state_dict("qwen3_next")
    src = hf[f"{TEXT}embed_tokens.weight"]
    no_pad = {k: v for k, v in config.items() if k != "pad_token_id"}
    assert torch.equal(convert_state_dict(no_pad, hf, dtype="float32")[0]["embed_tokens.weight"], src)
    pad = 7
    text, _ = convert_state_dict(dict(config, pad_token_id=pad), hf, dtype="float32")
    embed = text["embed_tokens.weight"]
    assert src[pad].abs().sum() > 0 and embed[pad].abs().sum() == 0
    keep = torch.arange(embed.shape[0]) != pad
    assert torch.equal(embed[keep], src[keep])
    assert torch.equal(text["lm_head.weight"], hf["lm_head.weight"])  # the head is untouched
    config_vl, hf_vl = hf_state_dict("qwen3_5")  # main lineage: never zeroed, even with a pad token
    config_vl["text_config"]["pad_token_id"] = pad
    text_vl, _ = convert_state_dict(config_vl, hf_vl, dtype="float32")
    assert torch.equal(text_vl["embed_tokens.weight"], hf_vl[f"{VL}embed_tokens.weight"])


def test_qwen3_next_grouped_projections_become_qkv_z_b_a():
    config, hf = hf_state_dict("qwen3_next")
    text, _ = convert_state_dict(config, hf, dtype="float32")
    dims = SimpleNamespace(num_k_heads=2, num_v_heads=4, k_head_dim=16, v_head_dim=16)
    qkv, z = split_qkvz(dims, hf[f"{TEXT}layers.0.linear_attn.in_proj_qkvz.weight"])
    b, a = split_ba(dims, hf[f"{TEXT}layers.0.linear_attn.in_proj_ba.weight"])
    for name, want in [("in_proj_qkv", qkv), ("in_proj_z", z), ("in_proj_b", b), ("in_proj_a", a)]:
        assert torch.equal(text[f"layers.0.linear_attn.{name}.weight"], want), name
    assert "layers.0.linear_attn.in_proj_qkvz.weight" not in text


def test_query_gate_split_on_a_real_layer(dense):
    config, hf, text, _ = dense
    w = hf[f"{VL}layers.3.self_attn.q_proj.weight"].bfloat16().reshape(4, 64, 64)
    assert torch.equal(text["layers.3.self_attn.q_proj.weight"], w[:, :32].reshape(128, 64))
    assert torch.equal(text["layers.3.self_attn.output_gate_proj.weight"], w[:, 32:].reshape(128, 64))


@pytest.mark.parametrize("variant", ["qwen3_5_moe", "qwen3_next"])
def test_moe_names_and_both_storage_forms_agree(variant):
    config, per_expert = hf_state_dict(variant)
    _, fused = hf_state_dict(variant + "_fused")
    a, _ = convert_state_dict(config, per_expert)
    b, _ = convert_state_dict(config, fused)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    p = "layers.1.mlp."
    assert a[f"{p}moe.expert_mlps.mlp_op.gate_up_proj.weight"].shape == (8, 64, 64)
    assert a[f"{p}moe.expert_mlps.mlp_op.down_proj.weight"].shape == (8, 32, 64)
    assert {f"{p}moe.router.linear_router.weight", f"{p}shared_gate_proj.weight", f"{p}shared_up_proj.weight",
            f"{p}shared_down_proj.weight", f"{p}shared_expert_gate.weight"} <= a.keys()
    prefix = VL if variant == "qwen3_5_moe" else TEXT
    gate = per_expert[f"{prefix}layers.1.mlp.experts.5.gate_proj.weight"].bfloat16()
    assert torch.equal(a[f"{p}moe.expert_mlps.mlp_op.gate_up_proj.weight"][5, :, :32], gate.T)


def test_qwen3_next_mlp_only_layers_are_dense_and_qwen3_5_moe_is_moe_everywhere():
    config, hf = hf_state_dict("qwen3_next")
    config = dict(config, mlp_only_layers=[1])
    with pytest.raises(CheckpointError, match="'model.layers.1.mlp.gate_proj.weight' is missing"):
        convert_state_dict(config, hf)
    hf = {k: v for k, v in hf.items() if not k.startswith("model.layers.1.mlp.")}
    hf.update({f"model.layers.1.mlp.{p}_proj.weight": torch.randn(96, 64) for p in ("gate", "up")})
    hf["model.layers.1.mlp.down_proj.weight"] = torch.randn(64, 96)
    text, _ = convert_state_dict(config, hf)
    assert "layers.1.mlp.gate_proj.weight" in text and "layers.1.mlp.moe.router.linear_router.weight" not in text
    vl_config, vl_hf = hf_state_dict("qwen3_5_moe")
    vl_config["text_config"]["mlp_only_layers"] = [1]  # not a Qwen3.5-MoE field: ignored, as transformers does
    assert "layers.1.mlp.moe.router.linear_router.weight" in convert_state_dict(vl_config, vl_hf)[0]
