"""The unit of conversion: a Step turns a few HF tensors into a few NxDI tensors by one rule.

Rule modules declare their key maps as tables of `Row`s (HF suffix and shape, NxDI suffixes, transform) with the
layer prefix left out; `layout.py` instantiates them per layer into Steps. The same Steps drive validation (their
sources and shapes are exactly what a checkpoint must hold), the in-memory conversion, the streaming conversion,
output planning (run on meta tensors to learn every output's shape and dtype before any data is read), and the
description a build stores instead of the converted weights, which names each Step's rule (description.py).

Invariant: a rule never modifies its inputs in place (it may return them, or views of them). Streaming inputs are
copy-on-write mappings of the checkpoint, and an output that is a view of an input is copied from the file itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:   # the rules import torch where they run it: a header check builds their tables without it
    import torch

Shape = tuple[int, ...]
Transform = Callable[..., tuple["torch.Tensor", ...]]  # (Arch, *tensors) -> one tensor per target


@dataclass(frozen=True)
class Step:
    sources: tuple[str, ...]
    shapes: tuple[Shape, ...]     # the shape each source must have
    targets: tuple[str, ...]
    fn: Callable[..., tuple[torch.Tensor, ...]]  # (*tensors) -> one tensor per target, the Arch already bound
    keep_fp32: bool = False       # outputs stay float32 instead of being cast to the target dtype
    rule: str = ""                # the rule's name as a description records it ("attention.split_query_gate")
    args: tuple[tuple[str, object], ...] = ()  # what the rule is bound with besides the Arch (config.json's)

    def __call__(self, *tensors: torch.Tensor) -> dict[str, torch.Tensor]:
        outs = self.fn(*tensors)
        assert len(outs) == len(self.targets), (self.targets, len(outs))
        return dict(zip(self.targets, outs))


@dataclass(frozen=True)
class Row:
    """One line of a key map: HF suffix, its shape as a function of the Arch, NxDI suffixes, transform."""
    source: str
    shape: Callable[[object], Shape]
    targets: tuple[str, ...]
    transform: Transform
    keep_fp32: bool = False

    def step(self, arch, hf_prefix: str, nx_prefix: str) -> Step:
        transform = self.transform
        return Step((hf_prefix + self.source,), (tuple(self.shape(arch)),),
                    tuple(nx_prefix + t for t in self.targets), lambda *ts: transform(arch, *ts), self.keep_fp32,
                    rule_name(transform))


def rule_name(fn: Callable) -> str:
    """How a description names a rule: its module in this package and its function, e.g. "norms.plus_one". The
    name says which code runs; the code itself stays in its module (and in the key of every step that runs it)."""
    return f"{fn.__module__.rpartition('.')[2]}.{fn.__qualname__}"


def same(arch, w: torch.Tensor) -> tuple[torch.Tensor]:
    """The identity rule: renamed (by the row), otherwise unchanged."""
    return (w,)
