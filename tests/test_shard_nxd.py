"""The nxd shard layouts against NxD's sharded-checkpoint format (docs/nxdi.md section 4).

The expected per-rank tensors are built here from the HF tensors, following the two ports' converters and NxD's
sharding as the reference describes them (head slots, channel lists, expert groups), without qbuild's placement
helpers; qbuild's convert -> shard path must reproduce them exactly: key sets, shapes, values and dtypes.
"""

from __future__ import annotations

import json

import pytest
import torch

from qbuild import backends
from qbuild.model.convert import CheckpointError, ShardError
from qbuild.model.convert.convert import convert_checkpoint, convert_state_dict
from qbuild.model.convert.shard import shard_checkpoint
from qbuild.model.convert.shard import shard_state_dict
from qbuild.model.ranks import RankLayout
from qbuild.model.tinymodel import FOUR_LAYERS, TP4_TEXT, write_tiny_checkpoint
from tests.conftest_convert import _ROOT, bits, hf_state_dict, load_config, load_dir, same_tensors, tiny

MODEL_DTYPE = torch.bfloat16
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

# Extra tiny checkpoints: 12 q heads over 2 kv heads split over 8 ranks (kv replicated 4x, q padded to 16), and an
# MHA model whose 6 heads are padded to 8 over 4 ranks (NxD's CONVERT_TO_MHA, since 4 % 6 != 0).
EXTRA = {
    "tp8_moe": ("qwen3_5_moe", dict(num_attention_heads=12, num_key_value_heads=2, linear_num_key_heads=8,
                                    linear_num_value_heads=8)),
    "tp8_next": ("qwen3_next", dict(num_attention_heads=12, num_key_value_heads=2)),
    "mha6": ("qwen3_5", dict(TP4_TEXT, num_attention_heads=6, num_key_value_heads=6)),
}
_extra: dict[str, tuple[dict, dict]] = {}


def checkpoint(variant: str) -> tuple[dict, dict[str, torch.Tensor]]:
    if variant not in EXTRA:
        return hf_state_dict(variant)
    if variant not in _extra:
        family, overrides = EXTRA[variant]
        src = write_tiny_checkpoint(_ROOT / "src" / variant, family, text_overrides=dict(FOUR_LAYERS, **overrides))
        _extra[variant] = (load_config(src), load_dir(src))
    return _extra[variant]


# --- The reference: HF tensors -> what NxD writes per rank ------------------------------------------------------

class Ref:
    """The HF checkpoint seen through the ports' converters: text fields, HF tensors by layer-relative name."""

    def __init__(self, config: dict, hf: dict[str, torch.Tensor]):
        self.c = config.get("text_config", config)
        prefix = "model.language_model." if "text_config" in config else "model."
        self.hf = {k.removeprefix(prefix): v for k, v in hf.items() if k.startswith(prefix) or k == "lm_head.weight"}
        c = self.c
        self.H, self.D, self.L = c["hidden_size"], c["head_dim"], c["num_hidden_layers"]
        self.nh, self.nkv = c["num_attention_heads"], c["num_key_value_heads"]
        self.hk, self.hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        self.dk, self.dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
        self.E = c.get("num_experts", 0)
        self.full = [t == "full_attention" for t in c["layer_types"]]

    def w(self, name: str) -> torch.Tensor:
        return self.hf[name].float()

    def deltanet(self, i: int) -> dict[str, torch.Tensor]:
        """in_proj_qkv (rows [Q all | K all | V all]), z, b, a of layer i; Qwen3-Next's grouped projections are
        de-interleaved per key head group [q | k | v (r heads) | z (r heads)] and [b (r) | a (r)]."""
        p = f"layers.{i}.linear_attn."
        if p + "in_proj_qkvz.weight" not in self.hf:
            return {x: self.w(f"{p}in_proj_{x}.weight") for x in ("qkv", "z", "b", "a")}
        r = self.hv // self.hk
        g = self.w(p + "in_proj_qkvz.weight").reshape(self.hk, -1, self.H)
        q, k, v, z = g.split([self.dk, self.dk, self.dv * r, self.dv * r], dim=1)
        ba = self.w(p + "in_proj_ba.weight").reshape(self.hk, 2 * r, self.H)
        flat = lambda t: t.reshape(-1, self.H)  # noqa: E731
        return {"qkv": torch.cat([flat(q), flat(k), flat(v)]), "z": flat(z), "b": flat(ba[:, :r]),
                "a": flat(ba[:, r:])}

    def experts(self, i: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Per expert gate (I, H), up (I, H), down (H, I), from either HF storage form."""
        p = f"layers.{i}.mlp.experts."
        if p + "gate_up_proj" in self.hf:
            gu, dn = self.w(p + "gate_up_proj"), self.w(p + "down_proj")
            i_ = gu.shape[1] // 2
            return list(gu[:, :i_]), list(gu[:, i_:]), list(dn)
        return ([self.w(f"{p}{e}.gate_proj.weight") for e in range(self.E)],
                [self.w(f"{p}{e}.up_proj.weight") for e in range(self.E)],
                [self.w(f"{p}{e}.down_proj.weight") for e in range(self.E)])


def q_slots(nh: int, nkv: int, tp: int) -> list[int | None]:
    """The source q head at each padded head position (None: a zero head). REPLICATE_TO_TP_DEGREE (tp % nkv == 0)
    puts the zero heads after each group of nh/nkv heads, CONVERT_TO_MHA at the tail."""
    padded = -(-nh // tp) * tp
    if tp % nkv == 0:
        g, extra = nh // nkv, (padded - nh) // nkv
        return [h for k in range(nkv) for h in [*range(k * g, (k + 1) * g), *[None] * extra]]
    return [*range(nh), *[None] * (padded - nh)]


def kv_slots(nh: int, nkv: int, tp: int) -> list[int | None]:
    """The source kv head at each position after NxD's replication / padding."""
    if nkv >= tp and nkv % tp == 0:
        return list(range(nkv))
    if tp % nkv == 0:
        return [r * nkv // tp for r in range(tp)]
    assert nh == nkv
    return [*range(nkv), *[None] * (-(-nh // tp) * tp - nkv)]


def heads(w: torch.Tensor, slots, size: int, dim: int) -> torch.Tensor:
    zero = torch.zeros_like(w.narrow(dim, 0, size))
    return torch.cat([w.narrow(dim, h * size, size) if h is not None else zero for h in slots], dim=dim)


def per_rank(slots: list, tp: int) -> list[list]:
    n = len(slots) // tp
    return [slots[r * n:(r + 1) * n] for r in range(tp)]


def expected(config: dict, hf: dict, lineage: str, tp: int, ep: int, fused: bool = False,
             dense_tp: int | None = None) -> list[dict]:
    """What NxD writes for `tp` ranks. Every non-expert parallel layer is split over dense_tp ranks (NxDI's
    tp_degree; default tp) and rank r holds its slice r % dense_tp; experts go by (r // moe_tp, r % moe_tp)."""
    ref = Ref(config, hf)
    main = lineage in ("nxd-main", "nxd-main-replicated")   # the main port's names
    tp_deltanet = lineage == "nxd-main"
    moe_tp = tp // ep
    dtp = dense_tp or tp
    H, D = ref.H, ref.D
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]

    def put(name, pieces):
        """`pieces`: one tensor per rank of the world, one per rank of the dense_tp group, or one for every rank."""
        for r in range(tp):
            if isinstance(pieces, list):
                out[r][name] = pieces[r] if len(pieces) == tp else pieces[r % dtp]
            else:
                out[r][name] = pieces

    def split(t, dim, n=dtp):
        return list(t.chunk(n, dim=dim))

    embed = ref.w("embed_tokens.weight").clone()
    if not main and ref.c.get("pad_token_id") is not None:
        embed[ref.c["pad_token_id"]] = 0
    put("embed_tokens.weight", split(embed, 1))
    put("lm_head.weight", split(ref.w("lm_head.weight"), 0))
    put("norm.weight", ref.w("norm.weight") + 1)
    put("rank_util.rank", [torch.tensor([r % dtp], dtype=torch.int32) for r in range(tp)])
    for i in range(ref.L):
        p = f"layers.{i}."
        put(p + "input_layernorm.weight", ref.w(p + "input_layernorm.weight") + 1)
        put(p + "post_attention_layernorm.weight", ref.w(p + "post_attention_layernorm.weight") + 1)
        if ref.full[i]:
            a = p + "self_attn."
            q_gate = ref.w(a + "q_proj.weight").reshape(ref.nh, 2 * D, H)
            q, gate = q_gate[:, :D].reshape(-1, H), q_gate[:, D:].reshape(-1, H)
            qs = [heads(q, s, D, 0) for s in per_rank(q_slots(ref.nh, ref.nkv, dtp), dtp)]
            ks = [heads(ref.w(a + "k_proj.weight"), s, D, 0) for s in per_rank(kv_slots(ref.nh, ref.nkv, dtp), dtp)]
            vs = [heads(ref.w(a + "v_proj.weight"), s, D, 0) for s in per_rank(kv_slots(ref.nh, ref.nkv, dtp), dtp)]
            if fused:
                put(a + "qkv_proj.Wqkv.weight", [torch.cat(x) for x in zip(qs, ks, vs)])
            else:
                put(a + "qkv_proj.q_proj.weight", qs)
                put(a + "qkv_proj.k_proj.weight", ks)
                put(a + "qkv_proj.v_proj.weight", vs)
            put(a + "o_proj.o_proj.weight", [heads(ref.w(a + "o_proj.weight"), s, D, 1)
                                             for s in per_rank(q_slots(ref.nh, ref.nkv, dtp), dtp)])
            put(a + "output_gate_proj.weight", split(gate, 0))
            put(a + "q_layernorm.weight", ref.w(a + "q_norm.weight") + 1)
            put(a + "k_layernorm.weight", ref.w(a + "k_norm.weight") + 1)
            put(a + "rank_util.rank", [torch.tensor([r % dtp], dtype=torch.int32) for r in range(tp)])
        else:
            la, dn = p + "linear_attn.", ref.deltanet(i)
            conv, key_dim = ref.w(la + "conv1d.weight"), ref.hk * ref.dk
            if tp_deltanet:  # rank r: its key heads' Q, its key heads' K, its value heads' V
                kq, vq = key_dim // dtp, ref.hv * ref.dv // dtp
                chans = [[*range(r * kq, (r + 1) * kq), *range(key_dim + r * kq, key_dim + (r + 1) * kq),
                          *range(2 * key_dim + r * vq, 2 * key_dim + (r + 1) * vq)] for r in range(dtp)]
                put(la + "in_proj_qkv.weight", [dn["qkv"][c] for c in chans])
                put(la + "conv1d_weight.weight", [conv[c, 0] for c in chans])
                for x in ("z", "a", "b"):
                    put(f"{la}in_proj_{x}.weight", split(dn[x], 0))
                put(la + "A_log_weight.weight", split(ref.w(la + "A_log")[:, None], 0))
                put(la + "dt_bias_weight.weight", split(ref.w(la + "dt_bias")[:, None], 0))
                put(la + "out_proj.weight", split(ref.w(la + "out_proj.weight"), 1))
            else:
                for x in ("qkv", "z", "a", "b"):
                    put(f"{la}in_proj_{x}.weight", dn[x])
                put(la + "conv1d.weight", conv)
                put(la + "A_log", ref.w(la + "A_log"))
                put(la + "dt_bias", ref.w(la + "dt_bias"))
                put(la + "out_proj.weight", ref.w(la + "out_proj.weight"))
            put(la + "norm.weight", ref.w(la + "norm.weight"))
        if not ref.E:
            put(p + "mlp.gate_proj.weight", split(ref.w(p + "mlp.gate_proj.weight"), 0))
            put(p + "mlp.up_proj.weight", split(ref.w(p + "mlp.up_proj.weight"), 0))
            put(p + "mlp.down_proj.weight", split(ref.w(p + "mlp.down_proj.weight"), 1))
            continue
        m = p + ("mlp.moe." if main else "mlp.")
        gates, ups, downs = ref.experts(i)
        local = ref.E // ep
        gu, dp = [], []
        for r in range(tp):
            g, j = r // moe_tp, r % moe_tp
            mine = range(g * local, (g + 1) * local)
            gu.append(torch.stack([torch.cat([gates[e].chunk(moe_tp)[j].T, ups[e].chunk(moe_tp)[j].T], 1)
                                   for e in mine]))
            dp.append(torch.stack([downs[e].chunk(moe_tp, dim=1)[j].T for e in mine]))
            out[r][m + "expert_mlps.spmd_rank.rank"] = torch.tensor([r], dtype=torch.int32)
            if ep > 1:
                out[r][m + "expert_mlps.spmd_rank.local_expert_indices"] = torch.tensor([list(mine)], dtype=torch.int32)
        put(m + "router.linear_router.weight", ref.w(p + "mlp.gate.weight"))
        put(m + "expert_mlps.mlp_op.gate_up_proj.weight", gu)
        put(m + "expert_mlps.mlp_op.down_proj.weight", dp)
        shared = p + ("mlp.shared_" if main else "mlp.shared_experts.shared_experts.")
        for x, dim in (("gate", 0), ("up", 0), ("down", 1)):
            put(f"{shared}{x}_proj.weight", split(ref.w(f"{p}mlp.shared_expert.{x}_proj.weight"), dim))
        put(p + ("mlp.shared_expert_gate.weight" if main else "mlp.shared_experts.sigmoid_gate.weight"),
            ref.w(p + "mlp.shared_expert_gate.weight"))
    return [{k: v.to(MODEL_DTYPE) if v.is_floating_point() else v for k, v in rank.items()} for rank in out]


def _ranks(tp: int, ep: int = 1, dense_tp: int | None = None) -> RankLayout:
    """`tp` ranks (NxD's world), experts in `ep` groups, non-expert layers over `dense_tp` (NxDI's tp_degree)."""
    return RankLayout(world=tp, dense_tp=dense_tp or tp, moe_tp=tp // ep, moe_ep=ep)


def _shard(config: dict, text: dict, tp: int, ep: int = 1, dense_tp: int | None = None, layout: str = "nxd-main",
           **options) -> list[dict]:
    return shard_state_dict(config, text, ranks=_ranks(tp, ep, dense_tp), layout=backends.shard_layout(layout),
                            **options)


def sharded(variant: str, lineage: str, tp: int, ep: int, fused: bool = False, fp8: str = "none",
            dense_tp: int | None = None):
    config, hf = checkpoint(variant)
    text, _ = convert_state_dict(config, hf, dtype="float32", fp8=fp8)
    return config, hf, text, _shard(config, text, tp, ep, dense_tp, lineage, fused_qkv=fused, dtype="bfloat16")


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys(), (sorted(got.keys() - want.keys()), sorted(want.keys() - got.keys()))
    for k in want:
        assert got[k].dtype == want[k].dtype, (k, got[k].dtype, want[k].dtype)
        assert got[k].shape == want[k].shape, (k, got[k].shape, want[k].shape)
        assert torch.equal(got[k], want[k]), k


CASES = [  # (variant, lineage, tp, ep, fused_qkv)
    ("qwen3_5", "nxd-main", 1, 1, False), ("qwen3_5", "nxd-main", 2, 1, True), ("qwen3_5_tp4", "nxd-main", 4, 1, False),
    ("qwen3_5_moe", "nxd-main", 1, 1, False), ("qwen3_5_moe", "nxd-main", 2, 2, False),
    ("qwen3_5_moe_tp4", "nxd-main", 4, 1, True), ("qwen3_5_moe_tp4", "nxd-main", 4, 2, False),
    ("tp8_moe", "nxd-main", 8, 1, False), ("tp8_moe", "nxd-main", 8, 2, True), ("mha6", "nxd-main", 4, 1, False),
    ("mha6", "nxd-main", 2, 1, True),
    ("qwen3_next", "nxd-moe", 1, 1, False), ("qwen3_next", "nxd-moe", 2, 1, True),
    ("qwen3_next", "nxd-moe", 2, 2, False),
    ("qwen3_next_tp4", "nxd-moe", 4, 1, False), ("qwen3_next_tp4", "nxd-moe", 4, 2, True),
    ("qwen3_5_moe", "nxd-moe", 2, 1, False), ("tp8_next", "nxd-moe", 8, 2, False),
    # The Qwen3.5-27B port: replicated DeltaNet, so tp 4 also works for 2 DeltaNet key heads.
    ("qwen3_5", "nxd-main-replicated", 1, 1, False), ("qwen3_5", "nxd-main-replicated", 2, 1, True),
    ("qwen3_5", "nxd-main-replicated", 4, 1, False),
]


@pytest.mark.parametrize("variant, lineage, tp, ep, fused", CASES)
def test_ranks_are_what_nxd_writes(variant, lineage, tp, ep, fused):
    config, hf, _, ranks = sharded(variant, lineage, tp, ep, fused)
    want = expected(config, hf, lineage, tp, ep, fused)
    assert len(ranks) == tp
    for r in range(tp):
        assert_same(ranks[r], want[r])


# NxD's EP world (NxDI world_size = tp_degree * ep_degree): the shard step's tp is the world, dense_tp is tp_degree.
EP_WORLD_CASES = [  # (variant, lineage, dense_tp, ep, fused_qkv); world = dense_tp * ep
    ("qwen3_next", "nxd-moe", 2, 2, False), ("qwen3_next", "nxd-moe", 1, 2, True),
    # 12 q heads over 2 kv heads: over tp_degree 4, kv replicated 2 -> 4 and q unpadded (over the world of 8 it
    # would be kv 2 -> 8 and q padded to 16).
    ("tp8_next", "nxd-moe", 4, 2, False),
    # The main port's tensor-parallel DeltaNet (2 key heads) splits over tp_degree 2; over the world of 4 it could not.
    ("qwen3_5_moe", "nxd-main", 2, 2, True),
]


@pytest.mark.parametrize("variant, lineage, dense_tp, ep, fused", EP_WORLD_CASES)
def test_ep_world_ranks_are_what_nxd_writes(variant, lineage, dense_tp, ep, fused):
    world = dense_tp * ep
    config, hf, _, ranks = sharded(variant, lineage, world, ep, fused, dense_tp=dense_tp)
    want = expected(config, hf, lineage, world, ep, fused, dense_tp=dense_tp)
    assert len(ranks) == world
    for r in range(world):
        assert_same(ranks[r], want[r])


def test_ep_world_tp2_ep2_moe_lineage():
    """Coder-Next's EP shape at tp_degree 2, ep_degree = moe_ep_degree 2, moe_tp_degree 2: world 4."""
    config, hf, _, ranks = sharded("qwen3_next", "nxd-moe", 4, 2, dense_tp=2)
    ref = Ref(config, hf)
    bf = lambda t: t.to(MODEL_DTYPE)  # noqa: E731
    assert len(ranks) == 4
    a = "layers.3.self_attn."  # the full-attention layer: 4 q heads, 2 kv heads, head_dim 32
    q = ref.w(a + "q_proj.weight").reshape(4, 64, 64)
    for r, rank in enumerate(ranks):
        j = r % 2  # this rank's slice of every non-expert parallel layer
        # Split over the dense_tp group, not the world: NxD's shard_children takes rank % num_partitions.
        assert torch.equal(rank["embed_tokens.weight"], bf(ref.w("embed_tokens.weight")[:, 32 * j:32 * j + 32]))
        assert torch.equal(rank["lm_head.weight"], bf(ref.w("lm_head.weight")[256 * j:256 * j + 256]))
        assert torch.equal(rank[a + "qkv_proj.q_proj.weight"], bf(q[2 * j:2 * j + 2, :32].reshape(64, 64)))
        assert torch.equal(rank[a + "output_gate_proj.weight"], bf(q[2 * j:2 * j + 2, 32:].reshape(64, 64)))
        # 2 kv heads over 2 ranks: split, one head each (over 4 ranks they would be replicated to 4).
        assert torch.equal(rank[a + "qkv_proj.k_proj.weight"], bf(ref.w(a + "k_proj.weight")[32 * j:32 * j + 32]))
        assert torch.equal(rank[a + "o_proj.o_proj.weight"], bf(ref.w(a + "o_proj.weight")[:, 64 * j:64 * j + 64]))
        # The shared expert runs over the full tp group, which is dense_tp ranks.
        sg = "layers.0.mlp.shared_experts.shared_experts."
        assert torch.equal(rank[sg + "gate_proj.weight"],
                           bf(ref.w("layers.0.mlp.shared_expert.gate_proj.weight")[16 * j:16 * j + 16]))
        assert torch.equal(rank[sg + "down_proj.weight"],
                           bf(ref.w("layers.0.mlp.shared_expert.down_proj.weight")[:, 16 * j:16 * j + 16]))
        # rank_util is SPMDRank(world_size=tp_degree); the experts' spmd_rank is over the whole world.
        assert rank["rank_util.rank"].tolist() == [j] and rank[a + "rank_util.rank"].tolist() == [j]
        assert rank["layers.0.mlp.expert_mlps.spmd_rank.rank"].tolist() == [r]
        # Experts: expert-parallel rank r // 2 holds experts [4g, 4g + 4), each cut to intermediate slice r % 2.
        g = r // 2
        idx = rank["layers.0.mlp.expert_mlps.spmd_rank.local_expert_indices"]
        assert idx.dtype == torch.int32 and idx.tolist() == [[4 * g, 4 * g + 1, 4 * g + 2, 4 * g + 3]]
        gates, ups, downs = ref.experts(0)
        gu = rank["layers.0.mlp.expert_mlps.mlp_op.gate_up_proj.weight"]
        dn = rank["layers.0.mlp.expert_mlps.mlp_op.down_proj.weight"]
        assert gu.shape == (4, 64, 32) and dn.shape == (4, 16, 64)
        for n, e in enumerate(range(4 * g, 4 * g + 4)):
            assert torch.equal(gu[n, :, :16], bf(gates[e][16 * j:16 * j + 16].T))
            assert torch.equal(gu[n, :, 16:], bf(ups[e][16 * j:16 * j + 16].T))
            assert torch.equal(dn[n], bf(downs[e][:, 16 * j:16 * j + 16].T))
    # Each expert-parallel copy of the dense_tp group holds the same non-expert tensors.
    for name in ranks[0]:
        if ".expert_mlps." not in name:
            assert torch.equal(ranks[0][name], ranks[2][name]) and torch.equal(ranks[1][name], ranks[3][name]), name


def test_ep_world_tp1_ep2_moe_lineage():
    """tp_degree 1, ep_degree 2: world 2, nothing but the experts split."""
    config, hf, _, ranks = sharded("qwen3_next", "nxd-moe", 2, 2, dense_tp=1)
    _, _, downs = Ref(config, hf).experts(1)
    assert len(ranks) == 2
    for r, rank in enumerate(ranks):
        assert rank["embed_tokens.weight"].shape == (512, 64) and rank["lm_head.weight"].shape == (512, 64)
        assert rank["layers.3.self_attn.qkv_proj.k_proj.weight"].shape == (64, 64)  # both kv heads
        assert rank["layers.1.mlp.shared_experts.shared_experts.up_proj.weight"].shape == (32, 64)
        assert rank["rank_util.rank"].tolist() == [0] and rank["layers.3.self_attn.rank_util.rank"].tolist() == [0]
        assert rank["layers.1.mlp.expert_mlps.spmd_rank.rank"].tolist() == [r]
        mine = [4 * r + e for e in range(4)]
        assert rank["layers.1.mlp.expert_mlps.spmd_rank.local_expert_indices"].tolist() == [mine]
        # moe_tp 1: whole experts, expert-parallel rank r holds experts [4r, 4r + 4).
        assert torch.equal(rank["layers.1.mlp.expert_mlps.mlp_op.down_proj.weight"],
                           torch.stack([downs[e].T for e in mine]).to(MODEL_DTYPE))
    assert all(torch.equal(ranks[0][n], ranks[1][n]) for n in ranks[0] if ".expert_mlps." not in n)


def test_kv_heads_replicate_to_tp8_and_q_heads_pad_after_each_group():
    config, hf, _, ranks = sharded("tp8_moe", "nxd-main", 8, 1)
    ref = Ref(config, hf)
    k = ref.w("layers.3.self_attn.k_proj.weight").to(MODEL_DTYPE)
    q = ref.w("layers.3.self_attn.q_proj.weight").reshape(12, 64, 64)[:, :32].reshape(-1, 64).to(MODEL_DTYPE)
    a = "layers.3.self_attn."
    for r, rank in enumerate(ranks):
        assert torch.equal(rank[a + "qkv_proj.k_proj.weight"], k[(r // 4) * 32:(r // 4 + 1) * 32])  # kv head r*2//8
        assert rank[a + "qkv_proj.q_proj.weight"].shape == (64, 64)  # 16 padded heads / 8 ranks
        assert rank[a + "o_proj.o_proj.weight"].shape == (64, 64)
    # group 0 = ranks 0-3: heads 0..5 then two zero heads; group 1 = ranks 4-7: heads 6..11 then two zero heads
    assert torch.equal(ranks[2][a + "qkv_proj.q_proj.weight"], q[4 * 32:6 * 32])
    assert ranks[3][a + "qkv_proj.q_proj.weight"].abs().sum() == 0
    assert ranks[3][a + "o_proj.o_proj.weight"].abs().sum() == 0
    assert torch.equal(ranks[4][a + "qkv_proj.q_proj.weight"], q[6 * 32:8 * 32])
    assert ranks[0][a + "output_gate_proj.weight"].shape == (48, 64)  # unpadded: 12 * 32 / 8


def test_embedding_splits_hidden_lm_head_splits_vocab_and_shared_expert_splits_over_full_tp():
    config, hf, _, ranks = sharded("qwen3_5_moe_tp4", "nxd-main", 4, 2)
    r1 = ranks[1]
    assert r1["embed_tokens.weight"].shape == (512, 16) and r1["lm_head.weight"].shape == (128, 64)
    assert r1["layers.0.mlp.shared_gate_proj.weight"].shape == (8, 64)  # Is 32 / tp 4, not / moe_tp 2
    assert r1["layers.0.mlp.shared_down_proj.weight"].shape == (64, 8)
    assert not torch.equal(r1["layers.0.mlp.shared_gate_proj.weight"], ranks[3]["layers.0.mlp.shared_gate_proj.weight"])
    gu = "layers.0.mlp.moe.expert_mlps.mlp_op.gate_up_proj.weight"
    assert r1[gu].shape == (4, 64, 32)  # E/ep, H, 2 * I/moe_tp: never padded
    assert r1["layers.0.mlp.moe.expert_mlps.spmd_rank.local_expert_indices"].tolist() == [[0, 1, 2, 3]]
    assert ranks[2]["layers.0.mlp.moe.expert_mlps.spmd_rank.local_expert_indices"].tolist() == [[4, 5, 6, 7]]


def test_moe_lineage_zeroes_the_pad_row_and_main_does_not():
    config, hf, _, moe_ranks = sharded("qwen3_5_moe", "nxd-moe", 2, 1)
    _, _, _, main_ranks = sharded("qwen3_5_moe", "nxd-main", 2, 1)
    pad = config["text_config"]["pad_token_id"]
    assert all(r["embed_tokens.weight"][pad].abs().sum() == 0 for r in moe_ranks)
    assert all(r["embed_tokens.weight"][pad].abs().sum() > 0 for r in main_ranks)


def _scale_rule_checks(text: dict, ranks: list[dict], tp: int) -> None:
    """Every FP8 weight stays FP8 and every scale is float32; every other float is the model dtype."""
    for rank in ranks:
        for name, t in rank.items():
            if name.endswith(".scale"):
                assert t.dtype == torch.float32, name
            elif t.is_floating_point():
                assert t.dtype in FP8 or t.dtype == MODEL_DTYPE, name
    fp8_in = {n for n, t in text.items() if t.dtype in FP8}
    fp8_out = {n for n, t in ranks[0].items() if t.dtype in FP8}
    assert len(fp8_in) == len(fp8_out) > 0


def test_fp8_full_main_lineage_scales():
    config, hf, text, ranks = sharded("qwen3_5_tp4", "nxd-main", 4, 1, fp8="full")
    _scale_rule_checks(text, ranks, 4)
    a, la = "layers.3.self_attn.", "layers.0.linear_attn."
    for r, rank in enumerate(ranks):
        # column: the per-channel scale (out, 1) is split on dim 0 with its weight
        assert torch.equal(rank[a + "qkv_proj.q_proj.scale"], text[a + "q_proj.scale"].chunk(4)[r])
        assert torch.equal(bits(rank[a + "qkv_proj.q_proj.weight"]), bits(text[a + "q_proj.weight"].chunk(4)[r]))
        assert torch.equal(rank[a + "output_gate_proj.scale"], text[a + "output_gate_proj.scale"].chunk(4)[r])
        # kv heads replicated to tp: scale rows follow the head, rank r holds head r*2//4
        assert torch.equal(rank[a + "qkv_proj.k_proj.scale"], text[a + "k_proj.scale"].chunk(2)[r // 2])
        # row: per-output-channel scale replicated
        assert torch.equal(rank[a + "o_proj.o_proj.scale"], text[a + "o_proj.scale"])
        assert torch.equal(rank[la + "out_proj.scale"], text[la + "out_proj.scale"])
        assert torch.equal(rank["layers.0.mlp.down_proj.scale"], text["layers.0.mlp.down_proj.scale"])
        assert torch.equal(rank["layers.0.mlp.gate_proj.scale"], text["layers.0.mlp.gate_proj.scale"].chunk(4)[r])
        # DeltaNet qkv scale: rank r's Q, K, V channels (key_dim 64, value_dim 128)
        s = text[la + "in_proj_qkv.scale"]
        assert torch.equal(rank[la + "in_proj_qkv.scale"],
                           torch.cat([s[16 * r:16 * r + 16], s[64 + 16 * r:80 + 16 * r], s[128 + 32 * r:160 + 32 * r]]))
        assert torch.equal(rank[la + "in_proj_z.scale"], text[la + "in_proj_z.scale"].chunk(4)[r])


def test_fp8_fused_qkv_scale_is_each_ranks_q_k_v():
    _, _, text, ranks = sharded("qwen3_5_tp4", "nxd-main", 4, 1, fused=True, fp8="full")
    a = "layers.3.self_attn."
    for r, rank in enumerate(ranks):
        want = torch.cat([text[a + "q_proj.scale"].chunk(4)[r], text[a + "k_proj.scale"].chunk(2)[r // 2],
                          text[a + "v_proj.scale"].chunk(2)[r // 2]])
        assert torch.equal(rank[a + "qkv_proj.Wqkv.scale"], want)
        assert rank[a + "qkv_proj.Wqkv.weight"].dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("lineage, variant, prefix", [("nxd-main", "qwen3_5_moe_tp4", "mlp.moe."),
                                                      ("nxd-moe", "qwen3_next_tp4", "mlp.")])
def test_fp8_expert_and_shared_scales(lineage, variant, prefix):
    _, _, text, ranks = sharded(variant, lineage, 4, 2, fp8="mlp_only")
    _scale_rule_checks(text, ranks, 4)
    gu, dn = (f"layers.1.mlp.moe.expert_mlps.mlp_op.{x}_proj.scale" for x in ("gate_up", "down"))
    shared = "mlp.shared_" if lineage == "nxd-main" else "mlp.shared_experts.shared_experts."
    for r, rank in enumerate(ranks):
        g, j = divmod(r, 2)
        s = text[gu][4 * g:4 * g + 4]  # (E_local, 1, 2I): this group's experts, then gate_j | up_j
        assert torch.equal(rank[f"layers.1.{prefix}expert_mlps.mlp_op.gate_up_proj.scale"],
                           torch.cat([s[..., 16 * j:16 * j + 16], s[..., 32 + 16 * j:48 + 16 * j]], dim=-1))
        assert torch.equal(rank[f"layers.1.{prefix}expert_mlps.mlp_op.down_proj.scale"], text[dn][4 * g:4 * g + 4])
        assert torch.equal(rank[f"layers.1.{shared}gate_proj.scale"],
                           text["layers.1.mlp.shared_gate_proj.scale"].chunk(4)[r])
        assert torch.equal(rank[f"layers.1.{shared}down_proj.scale"], text["layers.1.mlp.shared_down_proj.scale"])


def test_per_tensor_scales_are_replicated():
    config, hf = checkpoint("qwen3_5_moe")
    text, _ = convert_state_dict(config, hf, dtype="float32", fp8="mlp_only")
    text["layers.1.mlp.shared_gate_proj.scale"] = torch.tensor([0.5])
    ranks = _shard(config, text, 2, layout="nxd-main", dtype="bfloat16")
    assert all(torch.equal(r["layers.1.mlp.shared_gate_proj.scale"], torch.tensor([0.5])) for r in ranks)


def test_moe_lineage_refuses_what_its_port_cannot_load():
    config, hf = checkpoint("qwen3_next")
    full, _ = convert_state_dict(config, hf, dtype="float32", fp8="full")
    with pytest.raises(CheckpointError, match=r"linear_attn\.in_proj_qkv\.scale"):
        _shard(config, full, 2, layout="nxd-moe", dtype="bfloat16")
    with pytest.raises(CheckpointError, match="fuses Wqkv without its scales"):
        _shard(config, _without_deltanet_fp8(full), 2, layout="nxd-moe", fused_qkv=True, dtype="bfloat16")


def _without_deltanet_fp8(text: dict) -> dict:
    """`text` with its DeltaNet projections dequantized back to float32 and their scales dropped."""
    out = {}
    for n, t in text.items():
        if ".linear_attn." in n and n.endswith(".scale"):
            continue
        scale = n.removesuffix(".weight") + ".scale"
        out[n] = t.float() * text[scale] if ".linear_attn." in n and t.dtype in FP8 else t
    return out


def _config(variant: str, text: dict | None = None) -> dict:
    config = json.loads(json.dumps(checkpoint(variant)[0]))
    config.get("text_config", config).update(text or {})
    return config


@pytest.mark.parametrize("config, kwargs, match", [
    # NxD's ep_degree (world / dense_tp = 4) would differ from moe_ep_degree (2).
    (("qwen3_next",), dict(tp=4, ep=2, dense_tp=1, layout="nxd-moe"), "dense_tp must be the world .* or moe_tp"),
    (("qwen3_5_moe",), dict(tp=2, ep=2, dense_tp=1, layout="cpu"), "dense_tp = world"),
    # Attention is split over dense_tp 2, where 3 kv heads need CONVERT_TO_MHA, which NxD mis-sizes (over the
    # world of 6 they would replicate evenly).
    (("qwen3_next", dict(num_attention_heads=6, num_key_value_heads=3, num_experts=6)),
     dict(tp=6, ep=3, dense_tp=2, layout="nxd-moe"), "CONVERT_TO_MHA"),
    (("qwen3_5",), dict(tp=2, layout="nxd-moe"), "routed experts"),
    (("qwen3_5",), dict(tp=4), "DeltaNet"),
    (("qwen3_5_moe",), dict(tp=2, layout="nxd-main-replicated"), "dense MLP in every layer"),
    (("qwen3_5", dict(num_attention_heads=6, num_key_value_heads=3)), dict(tp=2), "CONVERT_TO_MHA"),
    (("qwen3_5_moe",), dict(tp=2, ep=2, layout="nxd-moe", dtype=None), "needs dtype"),
    (("qwen3_5_moe",), dict(tp=2, dtype="bf16"), "dtype must be one of"),
    (("qwen3_next", dict(tie_word_embeddings=True)), dict(tp=2, layout="nxd-moe"), "tied"),
])
def test_impossible_nxd_layouts_are_refused(config, kwargs, match):
    with pytest.raises(ShardError, match=match):
        _shard(_config(*config), {}, **{"dtype": "bfloat16", **kwargs})


def test_a_layout_no_backend_has_is_refused_by_name():
    with pytest.raises(ValueError, match="shard layout 'nxd' is not one of cpu, nxd-main"):
        backends.shard_layout("nxd")


@pytest.mark.parametrize("variant, lineage, tp, ep, fused, fp8, dense_tp", [
    ("qwen3_5_moe_tp4", "nxd-main", 4, 2, True, "mlp_only", None),
    ("qwen3_5_moe", "nxd-moe", 2, 2, True, "none", None),
    ("qwen3_next", "nxd-moe", 4, 2, False, "none", 2),
    ("qwen3_next", "nxd-moe", 2, 2, True, "none", 1),
])
def test_streaming_shard_matches_in_memory(tmp_path, variant, lineage, tp, ep, fused, fp8, dense_tp):
    convert_checkpoint(tiny(variant), tmp_path / "conv", dtype="bfloat16", fp8=fp8)
    report = shard_checkpoint(tmp_path / "conv", tmp_path / "shard", ranks=_ranks(tp, ep, dense_tp), fused_qkv=fused,
                              workers=2, layout=backends.shard_layout(lineage), dtype="bfloat16")
    assert report["layout"] == lineage and json.loads((tmp_path / "shard" / "shard.json").read_text()) == report
    assert report["ranks"] == {"world": tp, "dense_tp": dense_tp or tp, "moe_tp": tp // ep, "moe_ep": ep}
    # One file per rank of the world, named by global rank (NxD model_builder.py shard_weights_with_cache).
    names = sorted(f.name for f in (tmp_path / "shard" / "weights").iterdir())
    assert names == sorted(f"tp{r}_sharded_checkpoint.safetensors" for r in range(tp)) == sorted(report["files"])
    config, hf = checkpoint(variant)
    text, _ = convert_state_dict(config, hf, dtype="bfloat16", fp8=fp8)
    want = _shard(config, text, tp, ep, dense_tp, lineage, fused_qkv=fused, dtype="bfloat16")
    from safetensors.torch import load_file

    for r in range(tp):
        got = load_file(tmp_path / "shard" / "weights" / f"tp{r}_sharded_checkpoint.safetensors")
        assert same_tensors(got, want[r]), r


def test_cpu_layout_is_the_default(tmp_path):
    convert_checkpoint(tiny("qwen3_5"), tmp_path / "conv", dtype="bfloat16")
    report = shard_checkpoint(tmp_path / "conv", tmp_path / "shard", ranks=RankLayout.split(2), dtype="bfloat16")
    assert report["layout"] == "cpu"
    from safetensors.torch import load_file

    got = load_file(tmp_path / "shard" / "weights" / "tp0_sharded_checkpoint.safetensors")
    assert "layers.3.self_attn.q_proj.weight" in got and "embed_tokens.weight" in got
    assert got["embed_tokens.weight"].shape == (512, 64)  # replicated, qbuild's own names
