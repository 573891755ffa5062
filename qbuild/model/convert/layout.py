"""The conversion program of one checkpoint: every Step from HF tensors to NxDI tensors, assembled per layer
from the rule tables of each concern (norms, attention, deltanet, mlp, moe, embeddings, vision).

The program is a pure function of the model type, the architecture and which tensor names the checkpoint holds (to
pick the expert storage form per layer, and whether lm_head is stored or tied). Everything tp-dependent is left to
shard.
"""

from __future__ import annotations

from dataclasses import dataclass

from qbuild.model.arch import Arch, VisionArch
from qbuild.model.convert import attention, deltanet, embeddings, mlp, moe, norms, vision
from qbuild.model.convert.steps import Step
from qbuild.model.families import ModelType


@dataclass(frozen=True)
class Program:
    text: list[Step]
    vision: list[Step]

    def sources(self) -> dict[str, tuple[int, ...]]:
        """Every HF tensor the checkpoint must hold, with its shape."""
        return {n: s for step in self.text + self.vision for n, s in zip(step.sources, step.shapes)}


def layer_steps(d: Arch, model_type: ModelType, i: int, names) -> list[Step]:
    hf, nx = f"{model_type.text_prefix}layers.{i}.", f"layers.{i}."
    rows = list(norms.LAYER_NORMS)
    if d.is_full_attention(i):
        rows += attention.ATTENTION + norms.ATTENTION_NORMS
    else:
        rows += deltanet.GROUPED_DELTANET if model_type.family.grouped_deltanet else deltanet.DELTANET
    steps = []
    if d.is_moe_layer(i):
        rows += moe.ROUTER_AND_SHARED
        steps += moe.expert_steps(d, hf, nx, fused=moe.is_fused(names, hf))
    else:
        rows += mlp.DENSE_MLP
    return [row.step(d, hf, nx) for row in rows] + steps


def text_program(d: Arch, model_type: ModelType, names) -> list[Step]:
    steps = embeddings.embedding_steps(d, model_type.family, model_type.text_prefix, names)
    steps.append(norms.FINAL_NORM.step(d, model_type.text_prefix, ""))
    for i in range(d.num_layers):
        steps += layer_steps(d, model_type, i, names)
    return steps


def vision_program(v: VisionArch, model_type: ModelType) -> list[Step]:
    prefix = model_type.vision_prefix
    steps = [row.step(v, prefix, "") for row in vision.TOP]
    for i in range(v.depth):
        steps += [row.step(v, f"{prefix}blocks.{i}.", f"blocks.{i}.") for row in vision.BLOCK]
    return steps


def program(model_type: ModelType, arch: Arch, names) -> Program:
    """The text steps, and the vision steps where the model type keeps a vision encoder (arch_of made sure the
    config has one)."""
    vision_steps = vision_program(arch.vision, model_type) if model_type.vision_prefix else []
    return Program(text_program(arch, model_type, names), vision_steps)
