"""Compile backends: how one graph (a submodel at a bucket) becomes an artifact.

- export: a torch.export program (.pt2), weights as graph inputs; fast, for tests and for inspecting graphs.
- inductor: an AOTInductor package (.pt2) compiled to native CPU code from the same exported program.
- neuron: NxDI / neuronx-cc where the Neuron SDK is installed (neuron.py; its config translation is pure).

Nothing here imports torch at module level: the planner imports qbuild.backends.neuron for `plan --json`.
"""

from __future__ import annotations

BACKENDS = ("export", "inductor", "neuron")
CPU_BACKENDS = ("export", "inductor")


def graph_file(graph: str, bucket: int) -> str:
    """The file name of a compiled CPU graph, inside a compile output and under a bundle's graphs/."""
    return f"{graph}-{bucket}.pt2"


def text_arch(params: dict):
    """The Arch of a text graph's compile params (its allow-listed fingerprint; never a checkpoint)."""
    from ..arch import Arch

    return Arch.from_fingerprint(params["text"])


def vision_arch(params: dict):
    """The VisionArch of a vision graph's compile params."""
    from ..arch import VisionArch

    return VisionArch.from_fingerprint(params["vision"])


def hf_config(params: dict) -> dict:
    """An HF config.json rebuilt from the allow-listed architecture in compile params (never from a checkpoint).

    What NxDI's config loader reads (the CPU backends build the reference model from the Arch directly).
    """
    if params["graph"] == "vision":
        # The image token ids are host-side facts (where features go), not part of the vision graph.
        return {"model_type": "qwen3_5", "image_token_id": -1, "vision_start_token_id": -1,
                "vision_config": vision_arch(params).to_hf_config()}
    return text_arch(params).to_hf_config()
