"""Compile backends: how one graph (a submodel at a bucket) becomes an artifact.

- export: a torch.export program (.pt2), weights as graph inputs; fast, for tests and for inspecting graphs.
- inductor: an AOTInductor package (.pt2) compiled to native CPU code from the same exported program.
- neuron: NxDI / neuronx-cc where the Neuron SDK is installed (neuron.py; its config translation is pure).

Each backend takes the typed compile params of qbuild.recipe.params. Nothing here imports torch at module level: the planner
imports qbuild.backends.neuron for `plan --json`.
"""

from __future__ import annotations

from typing import Literal

Backend = Literal["neuron", "inductor", "export"]
NAMES: tuple[str, ...] = ("neuron", "inductor", "export")   # what a recipe's `backend:` and `--backend` may name
CpuBackend = Literal["inductor", "export"]
Target = Literal["trn2", "trn1", "inf2"]


def graph_file(graph: str, bucket: int) -> str:
    """The file name of a compiled CPU graph, inside a compile output and under a bundle's graphs/."""
    return f"{graph}-{bucket}.pt2"
