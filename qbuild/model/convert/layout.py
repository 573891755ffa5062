"""The conversion program of one checkpoint: every Step from HF tensors to NxDI tensors, assembled per layer
from the rule tables of each concern its family lists (Family.rules: norms, attention, deltanet, mlp, moe,
embeddings, vision), and the checkpoint opened against it (open_checkpoint).

The program is a pure function of the model type, the architecture and which tensor names the checkpoint holds (to
pick the expert storage form per layer, and whether lm_head is stored or tied). Everything tp-dependent is left to
shard.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Mapping

from qbuild.model.arch import Arch, VisionArch
from qbuild.model.convert.checkpoint import CheckpointFiles, read_checkpoint, validate
from qbuild.model.convert.rule import Step
from qbuild.model.families import Family, ModelType


@dataclass(frozen=True)
class Program:
    text: list[Step]
    vision: list[Step]

    def sources(self) -> dict[str, tuple[int, ...]]:
        """Every HF tensor the checkpoint must hold, with its shape."""
        return {n: s for step in self.text + self.vision for n, s in zip(step.sources, step.shapes)}


class Rules:
    """The rule modules of one family (Family.rules), imported by name: the modules a family's convert and shard
    nodes name in their keys (dag.Node.code), and no other; a rule module a family does not list is missing here."""

    def __init__(self, family: Family):
        self._modules = {name: importlib.import_module(module)
                         for name, module in zip(family.rules, family.rule_modules())}

    def __getattr__(self, name: str) -> ModuleType:
        try:
            return self._modules[name]
        except KeyError:
            raise AttributeError(f"conversion rules {name!r} are not among the family's (Family.rules)") from None


def layer_steps(d: Arch, model_type: ModelType, rules: Rules, i: int, names) -> list[Step]:
    hf, nx = f"{model_type.text_prefix}layers.{i}.", f"layers.{i}."
    rows = list(rules.norms.LAYER_NORMS)
    if d.is_full_attention(i):
        rows += rules.attention.ATTENTION + rules.norms.ATTENTION_NORMS
    else:
        rows += rules.deltanet.GROUPED_DELTANET if model_type.family.grouped_deltanet else rules.deltanet.DELTANET
    steps = []
    if d.is_moe_layer(i):
        rows += rules.moe.ROUTER_AND_SHARED
        steps += rules.moe.expert_steps(d, hf, nx, fused=rules.moe.is_fused(names, hf))
    else:
        rows += rules.mlp.DENSE_MLP
    return [row.step(d, hf, nx) for row in rows] + steps


def text_program(d: Arch, model_type: ModelType, names) -> list[Step]:
    rules = Rules(model_type.family)
    steps = rules.embeddings.embedding_steps(d, model_type.family, model_type.text_prefix, names)
    steps.append(rules.norms.FINAL_NORM.step(d, model_type.text_prefix, ""))
    for i in range(d.num_layers):
        steps += layer_steps(d, model_type, rules, i, names)
    return steps


def vision_program(v: VisionArch, model_type: ModelType) -> list[Step]:
    prefix, vision = model_type.vision_prefix, Rules(model_type.family).vision
    steps = [row.step(v, prefix, "") for row in vision.TOP]
    for i in range(v.depth):
        steps += [row.step(v, f"{prefix}blocks.{i}.", f"blocks.{i}.") for row in vision.BLOCK]
    return steps


def program(model_type: ModelType, arch: Arch, names) -> Program:
    """The text steps, and the vision steps where the model type keeps a vision encoder (arch_of made sure the
    config has one)."""
    vision_steps = vision_program(arch.vision, model_type) if model_type.vision_prefix else []
    return Program(text_program(arch, model_type, names), vision_steps)


@dataclass(frozen=True)
class Checkpoint(CheckpointFiles):
    """A checkpoint with its conversion program, every tensor the program reads checked against it."""
    program: Program


def open_checkpoint(src: Path, files: Mapping[str, Path] | None = None) -> Checkpoint:
    """Read the checkpoint at `src` (checkpoint.read_checkpoint), then check its tensors against the conversion
    program: each one the program reads present with its shape and a floating-point dtype, nothing unexpected."""
    found = read_checkpoint(src, files)
    prog = program(found.model_type, found.arch, found.tensors)
    validate(found.infos(), prog.sources(), found.model_type, found.missing_label)
    return Checkpoint(**vars(found), program=prog)
