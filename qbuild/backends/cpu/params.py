"""The compile params of the CPU backends: one text graph (cte, tkg or extend) or the vision encoder at one bucket."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

from qbuild.core.dtypes import DType
from qbuild.model.arch import Arch, VisionArch
from qbuild.model.families import MoEBackend
from qbuild.model.fp8 import FP8PolicyName

CpuBackendName = Literal["inductor", "export"]
TextGraph = Literal["cte", "tkg", "extend"]


@dataclass(frozen=True)
class CpuTextCompile:
    graph: TextGraph
    bucket: int                      # cte: the prompt bucket; tkg, extend: the KV length
    backend: CpuBackendName
    dtype: DType
    text: Arch                       # the text model's fingerprint (no vision encoder)
    tp: int                          # the ranks the graph computes over (qbuild's reference model, one file each)
    ep: int                          # the expert groups among them
    batch_size: int
    seq_len: int
    fp8: FP8PolicyName
    moe_backend: MoEBackend | None   # None for a dense model
    fused_qkv: bool
    chunk: int | None = None         # extend: the tokens of one prefill piece (qbuild.model.chunking); else None


@dataclass(frozen=True)
class CpuVisionCompile:
    graph: Literal["vision"]
    bucket: int
    backend: CpuBackendName
    dtype: DType
    vision: VisionArch
    tp: int                          # the encoder's linear layers computed as over tp ranks (recipe vision.tp)


CpuCompile = Union[CpuTextCompile, CpuVisionCompile]


def graph_file(graph: str, bucket: int) -> str:
    """The file name of a compiled CPU graph, inside a compile output and under a bundle's graphs/."""
    return f"{graph}-{bucket}.pt2"
