"""The FP8 policies a recipe's `fp8:` names, as one object per policy that every stage asks: the recipe checks and the
estimates (bytes per weight), the converter (which tensors it stores as FP8: qbuild.model.convert.fp8) and the
Neuron backend (which modules NxD leaves unconverted).

Plain data only: the planner imports it, so it must stay free of torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

FP8PolicyName = Literal["none", "mlp_only", "full"]
FP8_BYTES = 1   # a quantized weight is one float8 e4m3 byte (its per-channel scale is negligible)


@dataclass(frozen=True)
class FP8Policy:
    name: FP8PolicyName
    quantizes_mlp: bool
    keeps_edge_mlps: bool          # the first and the last layer's MLP stay in the model dtype
    quantizes_attention: bool      # the attention and DeltaNet projections too, in every layer

    @property
    def quantizes(self) -> bool:
        """Whether the policy stores any weight as FP8."""
        return self.quantizes_mlp or self.quantizes_attention

    def mlp_layers(self, num_layers: int) -> range:
        """The layers whose MLP weights the policy stores as FP8."""
        if not self.quantizes_mlp:
            return range(0)
        return range(1, num_layers - 1) if self.keeps_edge_mlps else range(num_layers)

    def mlp_bytes(self, dtype_bytes: int) -> int:
        """Bytes per MLP weight in the estimates: FP8's byte where the policy quantizes MLPs (the first and the last
        layer's are too few to count), else the model dtype's."""
        return FP8_BYTES if self.quantizes_mlp else dtype_bytes


# mlp_only is the validated 128K serving recipe (PR 173): every layer's MLP but the first and the last. full quantizes
# every layer's MLP and its attention and DeltaNet projections.
POLICIES: dict[str, FP8Policy] = {p.name: p for p in (
    FP8Policy("none", quantizes_mlp=False, keeps_edge_mlps=False, quantizes_attention=False),
    FP8Policy("mlp_only", quantizes_mlp=True, keeps_edge_mlps=True, quantizes_attention=False),
    FP8Policy("full", quantizes_mlp=True, keeps_edge_mlps=False, quantizes_attention=True),
)}
NAMES: tuple[FP8PolicyName, ...] = get_args(FP8PolicyName)


def policy(name: str) -> FP8Policy:
    """The policy a recipe's `fp8:` names; ValueError naming the valid ones for any other name."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"fp8 must be one of {', '.join(NAMES)}, got {name!r}") from None
