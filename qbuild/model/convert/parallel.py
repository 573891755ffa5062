"""The vocabulary shared by every shard layout: the unit of sharding (a step from a few converted tensors to one
{name: tensor} per rank), the placements that are the same in every layout, and what a layout is. The ranks are a
RankLayout (qbuild.model.ranks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Protocol

import torch

from qbuild.model.arch import Arch
from qbuild.model.convert.errors import CheckpointError
from qbuild.model.ranks import RankLayout

if TYPE_CHECKING:
    from qbuild.model.convert.safetensors_io import Deferred


@dataclass(frozen=True)
class ShardStep:
    sources: tuple[str, ...]
    fn: Callable[..., Iterable[dict[str, torch.Tensor]]]  # (*tensors) -> per rank {name: tensor}, in rank order


# Placements: a canonical tensor -> one tensor per rank, in rank order. The streaming writer takes every rank's at
# once and writes them side by side, so a big tensor's ranks are views of it, or Deferred where no view expresses
# the slice (the expert gate_up: safetensors_io.Deferred), made piece by piece as they are written; only small
# tensors are copied whole.
Placement = Callable[[torch.Tensor, Arch, RankLayout], Iterable["torch.Tensor | Deferred"]]


def replicate(t, d, p):
    return [t] * p.world


def column(t, d, p):
    return list(t.chunk(p.world, dim=0))


def row(t, d, p):
    return list(t.chunk(p.world, dim=1))


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


class ShardLayout(Protocol):
    """A shard layout's rules: the reference model's ("cpu", qbuild.model.convert.shard) or a backend's own, which
    the shard step reaches through qbuild.backends.shard_layout by the name its params hold."""

    name: str

    def program(self, d: Arch, names, ranks: RankLayout, fused_qkv: bool, dtype: str | None,
                label: str) -> list[ShardStep]:
        """The checked shard program of the converted tensors `names` (ShardError for a split the layout cannot
        make); `dtype` is the model dtype where the layout casts to it."""
