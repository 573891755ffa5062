"""What NxD does to the weights the ports declare, as the double models it: per-rank shapes of the parallel layers,
the SPMD rank tensors, the MoE process groups, and ExpertMLPsV2's choice of forward (which can fail a trace).

Sources: docs/nxdi.md section 4 (@ NxD fbac349, NxDI 4bcdc54) and docs/nxdi.md section 14. A Weight is what one rank's
`tp{r}_sharded_checkpoint.safetensors` must hold under that name: shape, dtype and, for the int32 rank tensors, the
value (NxD's initialize does not check values; the double does, since a wrong rank tensor computes the wrong slice).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Weight:
    shape: tuple[int, ...]
    dtype: str                     # torch dtype name, as metaneff and safetensors report it
    value: dict | None = None      # rank tensors: {"kind": "tp_rank" | "global_rank" | "local_experts", ...}

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict) -> "Weight":
        return cls(tuple(doc["shape"]), doc["dtype"], doc["value"])


def split(total: int, parts: int, what: str) -> int:
    """One rank's share of a dimension. NxD pads nothing here (section 4: "no bias, no padding"), so an uneven split
    is an error."""
    if total % parts:
        raise ValueError(f"{what}: {total} does not split over {parts} ranks")
    return total // parts


def column(out: int, in_: int, tp: int, dtype: str) -> Weight:
    """ColumnParallelLinear: (out/tp, in), dim 0."""
    return Weight((split(out, tp, "column-parallel output"), in_), dtype)


def row(out: int, in_: int, tp: int, dtype: str) -> Weight:
    """RowParallelLinear: (out, in/tp), dim 1."""
    return Weight((out, split(in_, tp, "row-parallel input")), dtype)


def replicated(shape: tuple[int, ...], dtype: str) -> Weight:
    """Anything that is not an NxD parallel layer is copied whole to every rank (trace.py shard_children)."""
    return Weight(tuple(shape), dtype)


def replicated_deltanet(prefix: str, config, dtype: str) -> dict[str, Weight]:
    """A DeltaNet of plain nn.Linear / nn.Conv1d / nn.Parameter (no NxD parallel layer), copied whole to every rank
    under the HF names (EP facts Q2): the Coder-Next port (753c7f5) and the Qwen3.5-27B port (550e2ab L258-281)."""
    h, hk, hv = config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv, k = config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim
    conv_dim = 2 * hk * dk + hv * dv
    return {f"{prefix}.in_proj_qkv.weight": replicated((conv_dim, h), dtype),
            f"{prefix}.in_proj_z.weight": replicated((hv * dv, h), dtype),
            f"{prefix}.in_proj_a.weight": replicated((hv, h), dtype),
            f"{prefix}.in_proj_b.weight": replicated((hv, h), dtype),
            f"{prefix}.conv1d.weight": replicated((conv_dim, 1, k), dtype),
            f"{prefix}.A_log": replicated((hv,), dtype),
            f"{prefix}.dt_bias": replicated((hv,), dtype),
            f"{prefix}.norm.weight": replicated((dv,), dtype),
            f"{prefix}.out_proj.weight": replicated((h, hv * dv), dtype)}


def parallel_embedding(vocab: int, hidden: int, tp: int, dtype: str) -> Weight:
    """The ports' ParallelEmbedding: (V, H/tp), split on hidden (section 4)."""
    return Weight((vocab, split(hidden, tp, "embedding hidden")), dtype)


def tp_rank() -> Weight:
    """`rank_util.rank`: SPMDRank(world_size=tp), arange(tp) split on dim 0, so shard r holds [r % tp] (EP facts Q2)."""
    return Weight((1,), "int32", {"kind": "tp_rank"})


def global_rank() -> Weight:
    """`expert_mlps.spmd_rank.rank`: SPMDRank over the whole world, shard r holds [r] (EP facts Q3)."""
    return Weight((1,), "int32", {"kind": "global_rank"})


def local_expert_indices(experts: int, moe_tp: int, moe_ep: int) -> Weight:
    """`expert_mlps.spmd_rank.local_expert_indices` (only with a MoE EP group > 1): (1, E/ep) int32 (EP facts Q3)."""
    return Weight((1, split(experts, moe_ep, "experts")), "int32",
                  {"kind": "local_experts", "experts": experts, "moe_tp": moe_tp, "moe_ep": moe_ep})


def zeros(shape: tuple[int, ...], dtype: str) -> Weight:
    """A weight every rank holds as zeros: the port's DeltaNet checkpoint banks, which the port's compile script writes
    zeroed into every shard (qwen36_27b_compile_fp8.py L135-212 @ 03db3ef)."""
    return Weight(tuple(shape), dtype, {"kind": "zeros"})


def _zeros(shape: tuple[int, ...]) -> list:
    return [0] * shape[0] if len(shape) == 1 else [_zeros(shape[1:]) for _ in range(shape[0])]


def rank_value(weight: Weight, rank: int, tp: int) -> list:
    """The value a rank tensor must hold in shard `rank`."""
    kind = weight.value["kind"]
    if kind == "zeros":
        return _zeros(weight.shape)
    if kind == "tp_rank":
        return [rank % tp]
    if kind == "global_rank":
        return [rank]
    e, moe_tp, moe_ep = weight.value["experts"], weight.value["moe_tp"], weight.value["moe_ep"]
    # ep_rank = (r // moe_tp) % moe_ep; experts held: the contiguous block of that EP rank (EP facts Q3, summary 5).
    ep_rank = (rank // moe_tp) % moe_ep
    n = e // moe_ep
    return [[ep_rank * n + i for i in range(n)]]


def check_moe_groups(nc) -> None:
    """The MoE process groups the sharding can build (EP facts Q1): with ep_degree > 1 the README's setup
    (moe_ep_degree = ep_degree, moe_tp_degree = tp_degree; "Must match"), otherwise moe_tp * moe_ep = tp (the in-tree
    pattern). Anything else is not in the facts; the double refuses it."""
    tp, ep, moe_tp, moe_ep = nc.tp_degree, nc.ep_degree, nc.moe_tp_degree, nc.moe_ep_degree
    if ep > 1 and (moe_ep != ep or moe_tp != tp):
        raise ValueError(f"ep_degree={ep} needs moe_ep_degree={ep} and moe_tp_degree={tp} (Coder-Next README: "
                         f"\"Must match\"), got moe_ep_degree={moe_ep}, moe_tp_degree={moe_tp}")
    if ep == 1 and moe_tp * moe_ep != tp:
        raise ValueError(f"moe_tp_degree={moe_tp} x moe_ep_degree={moe_ep} must equal tp_degree={tp} when "
                         "ep_degree is 1")


def experts(prefix: str, nc, num_experts: int, hidden: int, intermediate: int, dtype: str) -> dict:
    """ExpertMLPsV2 per rank (section 4, EP facts Q3): gate_up (E/moe_ep, H, 2I/moe_tp) laid out [gate_j | up_j],
    down (E/moe_ep, I/moe_tp, H), the SPMD rank when parallelize_token_to_block_mapping (default True) enables it,
    and the local expert indices when the MoE EP group is larger than one."""
    check_moe_groups(nc)
    moe_tp, moe_ep = nc.moe_tp_degree, nc.moe_ep_degree
    local = split(num_experts, moe_ep, "experts")
    i_local = split(intermediate, moe_tp, "expert intermediate")
    out = {f"{prefix}.mlp_op.gate_up_proj.weight": Weight((local, hidden, 2 * i_local), dtype),
           f"{prefix}.mlp_op.down_proj.weight": Weight((local, i_local, hidden), dtype)}
    if nc.blockwise_matmul_config.parallelize_token_to_block_mapping:
        out[f"{prefix}.spmd_rank.rank"] = global_rank()
        if moe_ep > 1:
            out[f"{prefix}.spmd_rank.local_expert_indices"] = local_expert_indices(num_experts, moe_tp, moe_ep)
    return out


# modules/moe/model_utils.py:93.
DEFAULT_SELECTIVE_LOADING_THRESHOLD = 1.0


def expert_dispatch(nc, tokens: int, top_k: int, num_experts: int, seq_len: int) -> str:
    """ExpertMLPsV2.forward's choice for one traced bucket (NxD expert_mlps_v2.py @ fbac349, EP facts Q4), and the
    paths that cannot run under expert parallelism: token generation with selective loading raises
    NotImplementedError in NxD itself; context encoding with selective loading or all-experts indexes all E experts
    although a rank holds E/ep (the Coder-Next README's reason for patching forward), which the double refuses
    rather than trace a silently wrong graph."""
    ep = nc.moe_ep_degree > 1
    loaded = tokens * top_k / num_experts
    if seq_len == 1:
        if loaded >= DEFAULT_SELECTIVE_LOADING_THRESHOLD:
            return "forward_all_experts_EP" if ep else "forward_all_experts"
        if ep:
            raise NotImplementedError("Selective Loading with Expert parallelism is not supported in token generation.")
        return "forward_selective_loading"
    if nc.capacity_factor is not None:
        path = "forward_capacity_factor"   # not in the facts: refused under EP below
    elif loaded < DEFAULT_SELECTIVE_LOADING_THRESHOLD:
        path = "forward_selective_loading"
    elif tokens * top_k < nc.blockwise_matmul_config.block_size:
        path = "forward_all_experts"
    else:
        path = "forward_blockwise"
    if ep and path != "forward_blockwise":
        raise NotImplementedError(f"{path} with expert parallelism indexes all {num_experts} experts, a rank holds "
                                  f"{num_experts // nc.moe_ep_degree} (Coder-Next README: patch ExpertMLPsV2.forward "
                                  "to use forward_blockwise for context encoding)")
    return path
