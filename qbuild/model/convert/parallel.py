"""The vocabulary shared by every shard layout: the parallel degrees, the unit of sharding (a step from a few
converted tensors to one {name: tensor} per rank) and the placements that are the same in every layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from qbuild.model.arch import Arch
from qbuild.model.convert.errors import CheckpointError


@dataclass(frozen=True)
class ParallelLayout:
    """`tp` is the number of ranks (one file each), `ep` the expert-parallel degree (moe_tp = tp // ep ranks per
    expert group). `dense_tp` is the tensor-parallel degree of every non-expert parallel layer (NxDI's tp_degree):
    None means tp, the only value the cpu layout takes; the nxd layouts also take tp // ep, NxD's EP world, where
    those layers are split over dense_tp ranks and repeated for each of the tp // dense_tp copies (nxd.py)."""
    tp: int
    ep: int = 1
    fused_qkv: bool = False
    pad_intermediate_to: int | None = None
    dense_tp: int | None = None

    def __post_init__(self) -> None:
        if self.dense_tp is None:
            object.__setattr__(self, "dense_tp", self.tp)

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep

    def group(self, rank: int) -> int:
        return rank // self.moe_tp

    def moe_rank(self, rank: int) -> int:
        return rank % self.moe_tp

    def dense_rank(self, rank: int) -> int:
        """The slice of a non-expert parallel layer that `rank` holds: its rank in its contiguous dense_tp group."""
        return rank % self.dense_tp


@dataclass(frozen=True)
class ShardStep:
    sources: tuple[str, ...]
    fn: Callable[..., Iterable[dict[str, torch.Tensor]]]  # (*tensors) -> per rank {name: tensor}, in rank order


# Placements: a canonical tensor -> one tensor per rank, in rank order. One whose ranks are copies (the expert
# slices) yields them one at a time, so a writer holds one rank's copy, not every rank's at once.
Placement = Callable[[torch.Tensor, Arch, ParallelLayout], Iterable[torch.Tensor]]


def replicate(t, d, p):
    return [t] * p.tp


def column(t, d, p):
    return list(t.chunk(p.tp, dim=0))


def row(t, d, p):
    return list(t.chunk(p.tp, dim=1))


def qkv_trios(d: Arch, names, label: str) -> list[tuple[int, str, list[str]]]:
    """(layer, "weight" | "scale", [q, k, v names]) of every q/k/v trio the converted tensors hold, to be fused into
    one Wqkv; CheckpointError naming the missing member of a partial trio."""
    out = []
    for i in (i for i in range(d.num_layers) if d.is_full_attention(i)):
        for kind in ("weight", "scale"):
            trio = [f"layers.{i}.self_attn.{x}_proj.{kind}" for x in "qkv"]
            present = [n for n in trio if n in names]
            if present and len(present) < 3:
                raise CheckpointError(label, "is needed to fuse Wqkv", next(n for n in trio if n not in names))
            if present:
                out.append((i, kind, trio))
    return out
