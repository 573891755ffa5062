"""Sharding per tensor-parallel rank: shapes, and that the ranks' pieces reconstruct the canonical tensors under the
convention documented in qbuild/model/convert/shard.py (restated independently here, per tensor kind)."""

from __future__ import annotations

import re

import pytest
import torch

from qbuild.model.arch import arch_from_config
from qbuild.model.convert import ShardError
from qbuild.model.convert.convert import convert_checkpoint, convert_state_dict
from qbuild.model.convert.shard import shard_checkpoint, shard_state_dict
from qbuild.model.ranks import RankLayout
from tests.conftest_convert import hf_state_dict, load_dir, same_tensors, tiny

COLUMN = re.compile(r".*(self_attn\.(q_proj|output_gate_proj)|linear_attn\.(in_proj_z|in_proj_a|in_proj_b|A_log_weight"
                    r"|dt_bias_weight))\.weight")
ROW = re.compile(r".*(self_attn\.o_proj|linear_attn\.out_proj)\.weight")
KV = re.compile(r".*self_attn\.[kv]_proj\.weight")
QKV_CHANNELS = re.compile(r".*linear_attn\.(in_proj_qkv|conv1d_weight)\.weight")
MOE_TP_COLUMN = re.compile(r".*mlp\.(gate_proj|up_proj|shared_gate_proj|shared_up_proj)\.weight")
MOE_TP_ROW = re.compile(r".*mlp\.(down_proj|shared_down_proj)\.weight")
GATE_UP = re.compile(r".*expert_mlps\.mlp_op\.gate_up_proj\.weight")
DOWN = re.compile(r".*expert_mlps\.mlp_op\.down_proj\.weight")
REPLICATED = re.compile(r"(embed_tokens|lm_head|norm)\.weight|.*(layernorm|linear_attn\.norm|shared_expert_gate"
                        r"|linear_router)\.weight")

CASES = [  # (tiny variant, tp, ep)
    ("qwen3_5", 1, 1), ("qwen3_5", 2, 1), ("qwen3_5_tp4", 4, 1),
    ("qwen3_5_moe", 1, 1), ("qwen3_5_moe", 2, 1), ("qwen3_5_moe", 2, 2),
    ("qwen3_5_moe_tp4", 4, 1), ("qwen3_5_moe_tp4", 4, 2),
    ("qwen3_next", 2, 1), ("qwen3_next", 2, 2), ("qwen3_next_tp4", 4, 1), ("qwen3_next_tp4", 4, 2),
]


def _converted(variant: str, fp8: str = "none"):
    config, hf = hf_state_dict(variant)
    text, _ = convert_state_dict(config, hf, dtype="float32", fp8=fp8)
    return config, arch_from_config(config), text


def check_rank_pieces(name: str, full: torch.Tensor, pieces: list[torch.Tensor], d, tp: int, ep: int) -> None:
    moe_tp = tp // ep
    groups = [pieces[g * moe_tp:(g + 1) * moe_tp] for g in range(ep)]
    if REPLICATED.fullmatch(name):
        assert all(torch.equal(p, full) for p in pieces)
    elif COLUMN.fullmatch(name):
        assert torch.equal(torch.cat(pieces, 0), full) and len({p.shape for p in pieces}) == 1
    elif ROW.fullmatch(name):
        assert torch.equal(torch.cat(pieces, 1), full)
    elif KV.fullmatch(name):
        heads = full.chunk(d.num_kv_heads)
        if tp <= d.num_kv_heads:
            assert torch.equal(torch.cat(pieces, 0), full)
        else:
            assert all(torch.equal(p, heads[r * d.num_kv_heads // tp]) for r, p in enumerate(pieces))
    elif QKV_CHANNELS.fullmatch(name):
        kq, vq, kd = d.key_dim // tp, d.value_dim // tp, d.key_dim
        for r, p in enumerate(pieces):
            assert torch.equal(p[:kq], full[r * kq:(r + 1) * kq])
            assert torch.equal(p[kq:2 * kq], full[kd + r * kq:kd + (r + 1) * kq])
            assert torch.equal(p[2 * kq:], full[2 * kd + r * vq:2 * kd + (r + 1) * vq])
    elif MOE_TP_COLUMN.fullmatch(name):  # split over moe_tp, replicated over ep groups
        assert all(torch.equal(torch.cat(g, 0), full) for g in groups)
    elif MOE_TP_ROW.fullmatch(name):
        assert all(torch.equal(torch.cat(g, 1), full) for g in groups)
    elif GATE_UP.fullmatch(name):
        i = full.shape[-1] // 2
        for k, g in enumerate(groups):
            mine = full.chunk(ep)[k]
            assert torch.equal(torch.cat([p[..., :p.shape[-1] // 2] for p in g], -1), mine[..., :i])  # gate
            assert torch.equal(torch.cat([p[..., p.shape[-1] // 2:] for p in g], -1), mine[..., i:])  # up
    elif DOWN.fullmatch(name):
        assert all(torch.equal(torch.cat(g, 1), full.chunk(ep)[k]) for k, g in enumerate(groups))
    else:
        raise AssertionError(f"no expectation for {name}")


@pytest.mark.parametrize("variant, tp, ep", CASES)
def test_ranks_reconstruct_the_canonical_tensors(variant, tp, ep):
    config, d, text = _converted(variant)
    ranks = shard_state_dict(config, text, ranks=RankLayout.split(tp, ep))
    assert len(ranks) == tp
    rank_names = {"rank_util.rank"} | {f"layers.{i}.self_attn.rank_util.rank"
                                       for i in range(d.num_layers) if d.is_full_attention(i)}
    for r, rank in enumerate(ranks):
        assert rank.keys() == text.keys() | rank_names
        assert all(torch.equal(rank[n], torch.tensor([r], dtype=torch.int32)) for n in rank_names)
    for name, full in text.items():
        check_rank_pieces(name, full, [rank[name] for rank in ranks], d, tp, ep)


def test_rank_shapes_of_a_moe_layer_at_tp4_ep2():
    config, d, text = _converted("qwen3_5_moe_tp4")
    r = shard_state_dict(config, text, ranks=RankLayout.split(4, 2))[3]
    shapes = {n.removeprefix("layers.3."): tuple(t.shape) for n, t in r.items() if n.startswith("layers.3.")}
    assert shapes["mlp.moe.expert_mlps.mlp_op.gate_up_proj.weight"] == (4, 64, 32)  # E/ep, H, 2*I/moe_tp
    assert shapes["mlp.moe.expert_mlps.mlp_op.down_proj.weight"] == (4, 16, 64)
    assert shapes["mlp.shared_gate_proj.weight"] == (16, 64) and shapes["mlp.shared_down_proj.weight"] == (64, 16)
    assert shapes["self_attn.q_proj.weight"] == (64, 64)  # 8 heads / 4 ranks * 32
    assert shapes["self_attn.k_proj.weight"] == (32, 64)  # one replicated kv head
    assert shapes["self_attn.o_proj.weight"] == (64, 64)
    r0 = shard_state_dict(config, text, ranks=RankLayout.split(4, 2))[0]
    assert r0["layers.0.linear_attn.in_proj_qkv.weight"].shape == (16 + 16 + 32, 64)
    assert r0["layers.0.linear_attn.conv1d_weight.weight"].shape == (64, 4)
    assert r0["layers.0.linear_attn.A_log_weight.weight"].shape == (2, 1)


def test_fused_qkv_concatenates_each_ranks_query_k_v():
    config, d, text = _converted("qwen3_5_tp4")
    plain = shard_state_dict(config, text, ranks=RankLayout.split(4))
    fused = shard_state_dict(config, text, ranks=RankLayout.split(4), fused_qkv=True)
    a = "layers.3.self_attn."
    for p, f in zip(plain, fused):
        assert torch.equal(f[f"{a}Wqkv.weight"], torch.cat([p[f"{a}q_proj.weight"], p[f"{a}k_proj.weight"],
                                                            p[f"{a}v_proj.weight"]]))
        assert not {f"{a}q_proj.weight", f"{a}k_proj.weight", f"{a}v_proj.weight"} & f.keys()
        assert torch.equal(f[f"{a}output_gate_proj.weight"], p[f"{a}output_gate_proj.weight"])


@pytest.mark.parametrize("variant, ranks, match", [
    ("qwen3_5", RankLayout.split(3), "attention heads"),
    ("qwen3_5", RankLayout.split(4), "DeltaNet"),
    ("qwen3_5", RankLayout.split(2, 2), "mixture-of-experts"),
    ("qwen3_5_moe_tp4", RankLayout(world=4, dense_tp=2, moe_tp=2, moe_ep=2), "dense_tp = world"),
])
def test_impossible_layouts_are_refused(variant, ranks, match):
    config, d, text = _converted(variant)
    with pytest.raises(ShardError, match=match):
        shard_state_dict(config, text, ranks=ranks)


@pytest.mark.parametrize("make, match", [
    (lambda: RankLayout.split(2, 3), "ep must divide tp"),
    (lambda: RankLayout(world=4, dense_tp=4, moe_tp=2, moe_ep=1), "moe_tp \\* moe_ep"),
    (lambda: RankLayout(world=4, dense_tp=3, moe_tp=4, moe_ep=1), "dense_tp must divide"),
    (lambda: RankLayout(world=0, dense_tp=1, moe_tp=0, moe_ep=1), "positive"),
])
def test_inconsistent_rank_layouts_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("variant, tp, ep, fp8, fused_qkv", [
    ("qwen3_5_moe_tp4", 4, 2, "mlp_only", True),
    ("qwen3_next", 2, 1, "full", False),
    ("qwen3_5", 2, 1, "none", True),
])
def test_streaming_shard_matches_in_memory(tmp_path, variant, tp, ep, fp8, fused_qkv):
    src = tiny(variant)
    convert_checkpoint(src, tmp_path / "conv", fp8=fp8)
    report = shard_checkpoint(tmp_path / "conv", tmp_path / "shard", ranks=RankLayout.split(tp, ep),
                              fused_qkv=fused_qkv, workers=2)
    config, hf = hf_state_dict(variant)
    text, _ = convert_state_dict(config, hf, fp8=fp8)
    want = shard_state_dict(config, text, ranks=RankLayout.split(tp, ep), fused_qkv=fused_qkv)
    files = sorted(p.name for p in (tmp_path / "shard" / "weights").iterdir())
    assert files == sorted(f"tp{r}_sharded_checkpoint.safetensors" for r in range(tp)) == sorted(report["files"])
    assert report["ranks"] == {"world": tp, "dense_tp": tp, "moe_tp": tp // ep, "moe_ep": ep}
    assert (tmp_path / "shard" / "shard.json").is_file()
    for r in range(tp):
        from safetensors.torch import load_file

        got = load_file(tmp_path / "shard" / "weights" / f"tp{r}_sharded_checkpoint.safetensors")
        assert same_tensors(got, want[r]), r


def test_shard_of_a_missing_directory_names_the_file(tmp_path):
    from qbuild.model.convert import CheckpointError

    with pytest.raises(CheckpointError, match="config.json"):
        shard_checkpoint(tmp_path / "nope", tmp_path / "out", ranks=RankLayout.split(2))
    assert not (tmp_path / "out").exists()
    assert load_dir(tmp_path) == {}
