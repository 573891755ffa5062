"""The shard step: converted (tp-independent) NxDI text weights -> one safetensors file per tensor-parallel rank.

Output: dst/weights/tp{r}_sharded_checkpoint.safetensors for r in range(world), and dst/shard.json. The ranks are a
RankLayout (qbuild.model.ranks); which tensor goes where is a layout's rules (qbuild.model.convert.parallel.ShardLayout):
`CPU` below, the layout qbuild's reference model reads, or a backend's own (the files its runtime loads), which the
shard step reaches through the backend registry. qbuild.model.convert.unpack reads a "cpu" rank back as qbuild's
reference model holds it (FP8 dequantized, a fused Wqkv split).

Rank convention of the "cpu" layout (tp = world = dense_tp, ep = moe_ep):
- Attention: q heads (q_proj, output_gate_proj) split contiguously; k/v heads split contiguously when tp <= nKV,
  else rank r holds kv head r * nKV // tp (replicated); o_proj split on its input dim; q/k_layernorm replicated.
  With fused_qkv, each rank's Wqkv = cat(its q, its k, its v) and the separate q/k/v keys are dropped.
- DeltaNet: in_proj_qkv and conv1d_weight hold each rank's [Q_r | K_r | V_r] channels (deltanet.reorder_qkv_channels);
  in_proj_z, in_proj_a/b, A_log_weight, dt_bias_weight split by value heads; out_proj on its input dim;
  linear_attn.norm (per head dim) replicated. Hk and Hv must be divisible by tp.
- MoE: moe_tp = tp // ep (ep divides tp and the expert count). Rank r is in expert-parallel group g = r // moe_tp
  with moe_tp-rank j = r % moe_tp; it holds experts [g*E/ep, (g+1)*E/ep), each cut to intermediate slice j
  (gate_up keeps [gate_j | up_j]; down keeps rows j). The shared expert, and the dense MLP, are split on their
  intermediate dim across the moe_tp ranks (slice j) and REPLICATED across the ep groups, so a sum over all tp ranks
  counts them ep times: the model divides their output by ep before the cross-rank reduction. Router and
  shared_expert_gate are replicated.
- Embeddings, lm_head and the final norm are replicated on every rank: the simplest correct layout (no vocab-parallel
  gather needed), at the cost of one embedding + head per rank.
- Layer norms are replicated. rank_util.rank and layers.{i}.self_attn.rank_util.rank (full-attention layers) are the
  canonical arange(tp) int32 split on dim 0: rank r's file holds [r], as NxD's SPMDRank parameter expects.
- FP8 scales follow their weight where the weight's output channels are split (column, kv heads, DeltaNet channels,
  experts) and are replicated where only the input dim is split (o_proj, out_proj, down projections): a per-output-
  channel scale is valid for any slice of its row.
"""

from __future__ import annotations

import re
from functools import partial
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import torch

from qbuild.model.arch import Arch
from qbuild.model.convert import attention, deltanet, experts
from qbuild.model.convert.checkpoint import arch_of, load_config
from qbuild.core.dtypes import DTYPES
from qbuild.model.convert.errors import CheckpointError, ShardError
from qbuild.model.convert.parallel import Placement, ShardLayout, ShardStep, column, qkv_trios, replicate, row
from qbuild.model.ranks import RankLayout
from qbuild.model.convert.converted import open_converted
from qbuild.model.convert.description import Producer
from qbuild.model.convert.safetensors_io import Deferred, MappedSources, PlannedFile
from qbuild.model.convert.writer import torch_ops_in_caller_threads, write_json
from qbuild.core.files import staged
from qbuild.core.threads import run_grouped

if TYPE_CHECKING:
    from qbuild.core.progress import Meter

FORMAT_VERSION = 2


def check_layout(d: Arch, p: RankLayout) -> None:
    """ShardError unless every tensor of a model of architecture `d` splits evenly under `p` in the cpu layout."""
    def need(ok: bool, why: str) -> None:
        if not ok:
            raise ShardError(f"{p.describe()}: {why}")

    need(p.dense_tp == p.world, "the cpu layout splits every non-expert layer over all ranks (dense_tp = world)")
    need(p.moe_ep == 1 or bool(d.moe_layers), "expert groups (moe_ep > 1) need a mixture-of-experts model")
    need(d.num_heads % p.world == 0, f"{d.num_heads} attention heads do not split into {p.world} ranks")
    need(d.num_kv_heads % p.world == 0 if p.world <= d.num_kv_heads else p.world % d.num_kv_heads == 0,
         f"{d.num_kv_heads} kv heads can be neither split nor evenly replicated over {p.world} ranks")
    if "linear_attention" in d.layer_types:
        need(d.num_k_heads % p.world == 0 and d.num_v_heads % p.world == 0,
             f"DeltaNet key/value heads ({d.num_k_heads}/{d.num_v_heads}) must both be divisible by the ranks")
    if d.intermediate_size is not None and len(d.moe_layers) < d.num_layers:
        need(d.intermediate_size % p.moe_tp == 0,
             f"dense intermediate {d.intermediate_size} does not split into {p.moe_tp}")
    if d.moe_layers:
        need(d.num_experts % p.moe_ep == 0, f"{d.num_experts} experts do not split into {p.moe_ep} groups")
        need(d.moe_intermediate_size % p.moe_tp == 0 and d.shared_intermediate_size % p.moe_tp == 0,
             f"expert / shared intermediate ({d.moe_intermediate_size}/{d.shared_intermediate_size}) must divide by "
             f"moe_tp {p.moe_tp}")


def kv_heads(t, d, p):
    return attention.kv_head_shards(t, d.num_kv_heads, p.world)


def deltanet_qkv(t, d, p):
    return deltanet.qkv_shards(t, d, p.world)


def moe_column(t, d, p):
    parts = t.chunk(p.moe_tp, dim=0)
    return [parts[p.moe_rank(r)] for r in range(p.world)]


def moe_row(t, d, p):
    parts = t.chunk(p.moe_tp, dim=1)
    return [parts[p.moe_rank(r)] for r in range(p.world)]


def experts_gate_up(t, d, p):
    return (experts.gate_up_shard(t, p.moe_ep, p.moe_tp, p.group(r), p.moe_rank(r)) for r in range(p.world))


def experts_down(t, d, p):
    return (experts.down_shard(t, p.moe_ep, p.moe_tp, p.group(r), p.moe_rank(r)) for r in range(p.world))


def experts_only(t, d, p):
    return [experts.expert_group(t, p.moe_ep, p.group(r)) for r in range(p.world)]


# Layer-relative module name -> (placement of `.weight`, placement of its FP8 `.scale`; None: never quantized).
PLACEMENTS: dict[str, tuple[Placement, Placement | None]] = {
    "embed_tokens": (replicate, None),
    "lm_head": (replicate, None),
    "norm": (replicate, None),
    "input_layernorm": (replicate, None),
    "post_attention_layernorm": (replicate, None),
    "self_attn.q_proj": (column, column),
    "self_attn.output_gate_proj": (column, column),
    "self_attn.k_proj": (kv_heads, kv_heads),
    "self_attn.v_proj": (kv_heads, kv_heads),
    "self_attn.o_proj": (row, replicate),
    "self_attn.q_layernorm": (replicate, None),
    "self_attn.k_layernorm": (replicate, None),
    "linear_attn.in_proj_qkv": (deltanet_qkv, deltanet_qkv),
    "linear_attn.conv1d_weight": (deltanet_qkv, None),
    "linear_attn.in_proj_z": (column, column),
    "linear_attn.in_proj_a": (column, column),
    "linear_attn.in_proj_b": (column, column),
    "linear_attn.A_log_weight": (column, None),
    "linear_attn.dt_bias_weight": (column, None),
    "linear_attn.norm": (replicate, None),
    "linear_attn.out_proj": (row, replicate),
    "mlp.gate_proj": (moe_column, moe_column),
    "mlp.up_proj": (moe_column, moe_column),
    "mlp.down_proj": (moe_row, replicate),
    "mlp.shared_gate_proj": (moe_column, moe_column),
    "mlp.shared_up_proj": (moe_column, moe_column),
    "mlp.shared_down_proj": (moe_row, replicate),
    "mlp.shared_expert_gate": (replicate, None),
    "mlp.moe.router.linear_router": (replicate, None),
    experts.GATE_UP: (experts_gate_up, experts_gate_up),
    experts.DOWN: (experts_down, experts_only),
}
_LAYER = re.compile(r"layers\.\d+\.(.+)")


def placement_of(name: str, label: str) -> Placement:
    m = _LAYER.fullmatch(name)
    module, _, kind = (m[1] if m else name).rpartition(".")
    weight, scale = PLACEMENTS.get(module, (None, None))
    chosen = weight if kind == "weight" else scale if kind == "scale" else None
    if chosen is None:
        raise CheckpointError(label, "has no shard rule (not a tensor of the converted NxDI layout)", name)
    return chosen


def _single(name: str, place: Placement, d: Arch, p: RankLayout) -> ShardStep:
    return ShardStep((name,), lambda t: ({name: x} for x in place(t, d, p)))


def _fused_qkv(layer: int, kind: str, d: Arch, p: RankLayout) -> ShardStep:
    base = f"layers.{layer}.self_attn."
    names = tuple(f"{base}{x}_proj.{kind}" for x in "qkv")

    def fn(q, k, v):
        parts = zip(column(q, d, p), kv_heads(k, d, p), kv_heads(v, d, p))
        return [{f"{base}Wqkv.{kind}": attention.fuse_qkv(*qkv)} for qkv in parts]
    return ShardStep(names, fn)


def _rank_util(d: Arch, p: RankLayout) -> ShardStep:
    names = ["rank_util.rank"] + [f"layers.{i}.self_attn.rank_util.rank"
                                  for i in range(d.num_layers) if d.is_full_attention(i)]
    ranks = torch.arange(p.world, dtype=torch.int32).chunk(p.world)
    return ShardStep((), lambda: [{n: ranks[r].clone() for n in names} for r in range(p.world)])


class CpuLayout:
    """The layout qbuild's reference model reads (the module docstring): qbuild's names, the converted dtypes."""

    name = "cpu"

    def program(self, d: Arch, names, ranks: RankLayout, fused_qkv: bool, dtype: str | None,
                label: str) -> list[ShardStep]:
        check_layout(d, ranks)
        steps = [_rank_util(d, ranks)]
        fused: set[str] = set()
        for i, kind, trio in (qkv_trios(d, names, label) if fused_qkv else []):
            steps.append(_fused_qkv(i, kind, d, ranks))
            fused.update(trio)
        for name in names:
            if name not in fused:
                steps.append(_single(name, placement_of(name, label), d, ranks))
        return steps


CPU = CpuLayout()


def _program(d: Arch, names, layout: ShardLayout, ranks: RankLayout, fused_qkv: bool, dtype: str | None,
             label: str) -> list[ShardStep]:
    if dtype is not None and dtype not in DTYPES:
        raise ShardError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return layout.program(d, names, ranks, fused_qkv, dtype, label)


def shard_state_dict(config: dict, text: Mapping[str, torch.Tensor], *, ranks: RankLayout, layout: ShardLayout = CPU,
                     fused_qkv: bool = False, dtype: str | None = None) -> list[dict[str, torch.Tensor]]:
    """Converted NxDI text tensors -> one {name: tensor} per rank, in memory (same rules as shard_checkpoint)."""
    _, d = arch_of(config, "config")
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(ranks.world)]
    for step in _program(d, list(text), layout, ranks, fused_qkv, dtype, "<state dict>"):
        for r, outs in enumerate(step.fn(*(text[n] for n in step.sources))):
            out[r].update({n: t.materialize() if isinstance(t, Deferred) else t.clone() for n, t in outs.items()})
    return out


def shard_checkpoint(converted: Path, dst: Path, *, ranks: RankLayout, layout: ShardLayout = CPU,
                     fused_qkv: bool = False, dtype: str | None = None, workers: int = 1,
                     files: Mapping[str, Path] | None = None, digests: Mapping[str, str] | None = None,
                     meter: Meter | None = None) -> dict:
    """A convert output directory -> dst/weights/tp{r}_sharded_checkpoint.safetensors (r < ranks.world) and
    dst/shard.json (returned). Described text weights are made from the checkpoint `files` locates (with the
    snapshot's `digests`; converted.open_converted), materialized ones read from the directory. Streams unit by
    unit (a canonical tensor, or the few a conversion step or a fused q/k/v makes together; _write_units), every rank
    tensor straight to its offset; dst appears only when done. `layout` picks the rules (module docstring); `dtype`
    is the model dtype, which a layout that casts to it requires. `meter` counts the tensor bytes written into the
    rank files, against all of them."""
    converted = Path(converted)
    config = load_config(converted / "config.json")
    _, d = arch_of(config)
    source = open_converted(converted, files, digests)
    try:
        steps = _program(d, list(source.specs), layout, ranks, fused_qkv, dtype, source.label)
        plans = _rank_plans(steps, source.specs, ranks.world)
        with staged(Path(dst), directory=True) as tmp:
            (tmp / "weights").mkdir()
            out = [PlannedFile(tmp / "weights" / f"tp{r}_sharded_checkpoint.safetensors", plans[r])
                   for r in range(ranks.world)]
            if meter is not None:
                meter.set_total(sum(slot.nbytes for f in out for slot in f.slots.values()))
            try:
                with torch_ops_in_caller_threads():
                    _write_units(_units(source.producers(), steps), out, workers, meter)
            except BaseException:
                for f in out:
                    f.discard()
                raise
            for f in out:
                f.close()
            report = {
                "format": FORMAT_VERSION, "layout": layout.name, "dtype": dtype, "ranks": asdict(ranks),
                "fused_qkv": fused_qkv, "files": [f.path.name for f in out], "tensors_per_rank": len(plans[0]),
                "bytes_per_rank": [sum(s.nbytes for s in f.slots.values()) for f in out],
            }
            write_json(tmp / "shard.json", report)
    finally:
        source.close()
    return report


def _rank_plans(steps: list[ShardStep], specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
                tp: int) -> list[list[tuple[str, torch.dtype, tuple[int, ...]]]]:
    """Every rank file's tensors (name, dtype, shape), learnt by running the shard steps on meta tensors."""
    plans: list[list[tuple[str, torch.dtype, tuple[int, ...]]]] = [[] for _ in range(tp)]
    for step in steps:
        metas = [torch.empty(specs[n][1], dtype=specs[n][0], device="meta") for n in step.sources]
        for r, outs in enumerate(step.fn(*metas)):
            plans[r] += [(n, t.dtype, tuple(t.shape)) for n, t in outs.items()]
    return plans


@dataclass
class _Unit:
    """Producers and the shard steps that read what they make, run together: what they hold in memory at once."""
    producers: list[Producer] = field(default_factory=list)
    steps: list[ShardStep] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.producers)


def _units(producers: list[Producer], steps: list[ShardStep]) -> list[_Unit]:
    """Group producers with the shard steps that read their tensors: a step reading the outputs of several producers
    (a fused Wqkv) joins them, and a producer making the inputs of several steps (the q/gate split, FP8 weight and
    scale) runs once for all of them. Steps without sources (rank tensors) make units of their own."""
    owner = {n: i for i, prod in enumerate(producers) for n in prod.names}
    root = list(range(len(producers)))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    for step in steps:
        first, *rest = [owner[n] for n in step.sources] or [None]
        for other in rest:
            root[find(other)] = find(first)
    units: dict[object, _Unit] = {}
    for i, prod in enumerate(producers):
        units.setdefault(find(i), _Unit()).producers.append(prod)
    for k, step in enumerate(steps):
        group = find(owner[step.sources[0]]) if step.sources else ("alone", k)
        units.setdefault(group, _Unit()).steps.append(step)
    return [u for u in units.values() if u.steps]


# Units run side by side while their inputs total at most this many times the biggest unit's: the biggest never
# runs beside another as big (peak memory stays under 2x the largest tensor: each unit holds its mapped inputs and
# the writers' small buffers), while a big unit and a smaller one overlap their copies and their writes.
_UNITS_BUDGET = 1.5


def _write_units(units: list[_Unit], files: list[PlannedFile], workers: int, meter: Meter | None = None) -> None:
    """Write every unit into the rank files, biggest first, on `workers` threads within the memory budget; `meter`
    counts the bytes of each tensor written. A unit's rank tensors are views of its inputs or Deferred (made as they
    are written), so each rank tensor is a job of its own: the ranks of a unit too big to share the budget are still
    written side by side (writing to the page cache costs as much CPU as laying the bytes out)."""
    def open_unit(unit: _Unit):
        def open_() -> list:  # replicated and dim-0 slices of mapped bytes are byte ranges: the kernel copies them
            mapped = MappedSources()
            tensors: dict[str, torch.Tensor] = {}
            for prod in unit.producers:
                tensors.update(prod.run(mapped))
            return [partial(_write_one, f, n, t, mapped, meter) for step in unit.steps
                    for f, outs in zip(files, step.fn(*(tensors[n] for n in step.sources)))
                    for n, t in outs.items()]
        return open_

    units = sorted(units, key=lambda u: -u.nbytes)
    budget = int(_UNITS_BUDGET * max((u.nbytes for u in units), default=0))
    run_grouped([(u.nbytes, open_unit(u)) for u in units], workers, budget)


def _write_one(f: PlannedFile, name: str, t, mapped: MappedSources, meter: Meter | None) -> None:
    f.write(name, t, mapped)
    if meter is not None:
        meter.advance(f.slots[name].nbytes)
