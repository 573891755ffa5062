"""How a model's weights are laid out over ranks: the one vocabulary the shard layouts, the backends and the shard
step's params share. No torch.

    world      the number of ranks, one weights file each (NxD's world size)
    dense_tp   the ranks every non-expert parallel layer (attention, embeddings, head, dense and shared MLPs) is split
               over: a contiguous group of dense_tp ranks, repeated world / dense_tp times (NxDI's tp_degree). It is
               the world unless a backend runs expert parallelism as ranks of their own (NxD's EP world).
    moe_tp     the ranks one expert's intermediate is split over (NxD's moe_tp_degree)
    moe_ep     the groups the experts are split into (NxD's moe_ep_degree); moe_tp * moe_ep = world

Rank r is moe-tp rank r % moe_tp of expert group r // moe_tp, and holds slice r % dense_tp of every non-expert
layer. A dense model has one expert group of the whole world (moe_tp = world, moe_ep = 1), which nothing reads.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankLayout:
    world: int
    dense_tp: int
    moe_tp: int
    moe_ep: int

    def __post_init__(self) -> None:
        if min(self.world, self.dense_tp, self.moe_tp, self.moe_ep) < 1:
            raise ValueError(f"{self.describe()}: every degree must be positive")
        if self.moe_tp * self.moe_ep != self.world:
            raise ValueError(f"{self.describe()}: moe_tp * moe_ep must be the world")
        if self.world % self.dense_tp:
            raise ValueError(f"{self.describe()}: dense_tp must divide the world")

    @classmethod
    def split(cls, tp: int, ep: int = 1) -> "RankLayout":
        """`tp` ranks, every non-expert layer split over all of them and the experts in `ep` groups of tp / ep ranks:
        a recipe's parallelism as qbuild's reference model runs it. ValueError unless ep divides tp."""
        if tp < 1 or ep < 1 or tp % ep:
            raise ValueError(f"tp={tp} ep={ep}: tp and ep must be positive and ep must divide tp")
        return cls(world=tp, dense_tp=tp, moe_tp=tp // ep, moe_ep=ep)

    def group(self, rank: int) -> int:
        """The expert group `rank` belongs to."""
        return rank // self.moe_tp

    def moe_rank(self, rank: int) -> int:
        """The slice of its group's experts' intermediate that `rank` holds."""
        return rank % self.moe_tp

    def dense_rank(self, rank: int) -> int:
        """The slice of a non-expert parallel layer that `rank` holds."""
        return rank % self.dense_tp

    def describe(self) -> str:
        """What a person reads: "8 ranks", "4 ranks, experts moe_tp 2 x moe_ep 2", "32 ranks, dense_tp 8, ..."."""
        parts = [f"{self.world} rank{'' if self.world == 1 else 's'}"]
        if self.dense_tp != self.world:
            parts.append(f"dense_tp {self.dense_tp}")
        if self.moe_ep != 1:
            parts.append(f"experts moe_tp {self.moe_tp} x moe_ep {self.moe_ep}")
        return ", ".join(parts)
