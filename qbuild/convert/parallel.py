"""The vocabulary shared by every shard layout: the parallel degrees, the unit of sharding (a step from a few
converted tensors to one {name: tensor} per rank) and the placements that are the same in every layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from qbuild.convert.dims import TextDims


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    ep: int = 1
    fused_qkv: bool = False
    pad_intermediate_to: int | None = None

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep

    def group(self, rank: int) -> int:
        return rank // self.moe_tp

    def moe_rank(self, rank: int) -> int:
        return rank % self.moe_tp


@dataclass(frozen=True)
class ShardStep:
    sources: tuple[str, ...]
    fn: Callable[..., list[dict[str, torch.Tensor]]]  # (*tensors) -> per rank {name: tensor}


# Placements: a canonical tensor -> one tensor per rank.
Placement = Callable[[torch.Tensor, TextDims, ParallelLayout], list[torch.Tensor]]


def replicate(t, d, p):
    return [t] * p.tp


def column(t, d, p):
    return list(t.chunk(p.tp, dim=0))


def row(t, d, p):
    return list(t.chunk(p.tp, dim=1))
