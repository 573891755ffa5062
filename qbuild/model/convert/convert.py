"""The convert step: an HF checkpoint -> tp-independent NxDI-layout text weights (+ vision weights).

Two outputs, from the same Steps (layout.py) run by the same `run_step` (description.py):
- `describe_checkpoint`, what a build stores: the text weights as a description (no weight bytes), which the shard
  step streams the checkpoint through; the vision weights, which ship in the bundle as they are, stored once here.
- `convert_checkpoint`, the converted checkpoint materialized (for debugging: `qbuild compile --keep-intermediates`,
  and for tests): the text weights as safetensors files.

Output directory:
  text/description.json                 described: every converted text tensor (description.py)
  text/model-00001.safetensors ...      materialized: canonical NxDI names, unsharded (shard.py splits them per rank)
  text/model.safetensors.index.json     materialized: tensor -> file
  vision/model.safetensors              VL families only: the traced encoder's names + host-side patch/pos embeds
  config.json, tokenizer*.json, ...     the checkpoint's non-weight files, copied
  convert.json                          what was done: family, dtype, fp8 policy, tensor count, bytes

Streaming reads one step's tensors at a time, so peak memory is a few times the largest step's inputs (one tensor,
or one layer's per-expert tensors), whatever the checkpoint's size.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Mapping

import torch

from qbuild.core.dtypes import torch_dtype as dtype_of
from qbuild.core.threads import run_all
from qbuild.model.convert.checkpoint import TensorInfo, arch_of, validate
from qbuild.model.convert.description import (FILE as DESCRIPTION, describe, file_digests, open_described,
                                              plan_outputs, run_step)
from qbuild.model.convert.layout import Checkpoint, open_checkpoint, program
from qbuild.model.convert.safetensors_io import DTYPE_NAMES, MappedSources, PlannedFile, contiguous
from qbuild.model.convert.rule import Step
from qbuild.model.convert.writer import (DEFAULT_SHARD_BYTES, ShardedOutput, SourceFiles,
                                         torch_ops_in_caller_threads, write_json)
from qbuild.model.fp8 import FP8PolicyName, policy as fp8_policy
from qbuild.core.files import staged

FORMAT_VERSION = 1


def check_policy(fp8: str) -> None:
    fp8_policy(fp8)


def convert_state_dict(config: dict, tensors: Mapping[str, torch.Tensor], *, dtype: str = "bfloat16",
                       fp8: FP8PolicyName = "none") -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """HF config dict + HF state dict -> (NxDI text tensors, vision tensors), in memory. Same rules and validation
    as convert_checkpoint; for tests and small models."""
    torch_dtype = dtype_of(dtype)
    check_policy(fp8)
    model_type, arch = arch_of(config, "config")
    prog = program(model_type, arch, tensors.keys())
    infos = {n: TensorInfo("<state dict>", DTYPE_NAMES.get(t.dtype, str(t.dtype)), tuple(t.shape))
             for n, t in tensors.items()}
    validate(infos, prog.sources(), model_type, "<state dict>")
    text: dict[str, torch.Tensor] = {}
    for step in prog.text:
        text.update(run_step(step, [tensors[n] for n in step.sources], torch_dtype, fp8, arch.num_layers))
    vision: dict[str, torch.Tensor] = {}
    for step in prog.vision:
        vision.update(run_step(step, [tensors[n] for n in step.sources], torch_dtype, "none", arch.num_layers))
    # rules may return views (the expert transposes); callers get contiguous tensors, as a saved file would hold
    return ({n: contiguous(t) for n, t in text.items()}, {n: contiguous(t) for n, t in vision.items()})


def convert_checkpoint(src: Path, dst: Path, *, files: Mapping[str, Path] | None = None, dtype: str = "bfloat16",
                       fp8: FP8PolicyName = "none", workers: int = 1,
                       max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> dict:
    """HF checkpoint directory `src` -> the materialized converted directory `dst` (layout in the module docstring).

    `files` maps checkpoint file names to their real paths (e.g. HF cache blobs). The whole checkpoint is validated
    before anything is written; output is staged beside `dst` and renamed into place, so on any error `dst` is not
    created. `workers` > 1 runs independent steps in threads. Returns the convert.json document."""
    torch_dtype = dtype_of(dtype)
    check_policy(fp8)
    ck = open_checkpoint(Path(src), files)
    text_plan = plan_outputs(ck, ck.program.text, torch_dtype, fp8)
    vision_plan = plan_outputs(ck, ck.program.vision, torch_dtype, "none")
    sources = SourceFiles(sorted({t.path for t in ck.tensors.values()}))
    try:
        with staged(Path(dst), directory=True) as tmp:
            (tmp / "text").mkdir()
            text_out = ShardedOutput.open(tmp / "text", text_plan, max_shard_bytes)
            vision_out = _vision_file(tmp, vision_plan)
            jobs = [(s, fp8, text_out.write) for s in ck.program.text] + _vision_jobs(ck, vision_out)
            _run_steps(ck, sources, jobs, torch_dtype, workers, [text_out, vision_out])
            index = text_out.close()
            text_bytes = index["metadata"]["total_size"]
            report = _finish(tmp, ck, dtype, fp8, vision_out, len(index["weight_map"]), text_bytes,
                             sum(n.endswith(".scale") for n in index["weight_map"]))
            report["text_files"] = [f.path.name for f in text_out.files]
            write_json(tmp / "convert.json", report)
    finally:
        sources.close()
    return report


def describe_checkpoint(src: Path, dst: Path, *, files: Mapping[str, Path] | None = None,
                        digests: Mapping[str, str] | None = None, dtype: str = "bfloat16",
                        fp8: FP8PolicyName = "none") -> dict:
    """HF checkpoint directory `src` -> the described converted directory `dst`: text/description.json instead of
    the text weights, the vision weights written. `digests` maps each checkpoint file name to its digest (a build
    passes its snapshot's; without it the files are hashed). Validated, staged and returned as convert_checkpoint
    does."""
    torch_dtype = dtype_of(dtype)
    check_policy(fp8)
    ck = open_checkpoint(Path(src), files)
    text_plan = plan_outputs(ck, ck.program.text, torch_dtype, fp8)
    vision_plan = plan_outputs(ck, ck.program.vision, torch_dtype, "none")
    if digests is None:
        digests = file_digests({t.file: t.path for t in ck.tensors.values()}, {t.file for t in ck.tensors.values()})
    doc = describe(ck, digests, dtype, fp8, text_plan)
    sources = SourceFiles(sorted({ck.tensors[n].path for s in ck.program.vision for n in s.sources}))
    try:
        with staged(Path(dst), directory=True) as tmp:
            (tmp / "text").mkdir()
            write_json(tmp / "text" / DESCRIPTION, doc)
            vision_out = _vision_file(tmp, vision_plan)
            _run_steps(ck, sources, _vision_jobs(ck, vision_out), torch_dtype, 1, [vision_out])
            report = _finish(tmp, ck, dtype, fp8, vision_out, doc["tensors"], doc["bytes"],
                             sum(n.endswith(".scale") for s in doc["steps"] for n, _, _ in s["outputs"]))
            report.update(text_files=[], text="described")
            write_json(tmp / "convert.json", report)
    finally:
        sources.close()
    return report


def materialize(described: Path, dst: Path, *, files: Mapping[str, Path], digests: Mapping[str, str] | None = None,
                workers: int = 1) -> dict:
    """The described converted directory `described` -> the materialized one at `dst`, as convert_checkpoint writes
    it (for debugging). The description must be the one this checkpoint and this qbuild make (open_described)."""
    source = open_described(Path(described), files, digests)
    source.close()
    doc = source.doc
    return convert_checkpoint(next(iter(files.values())).parent, dst, files=files, dtype=doc["dtype"],
                              fp8=doc["fp8"], workers=workers)


def _vision_file(tmp: Path, vision_plan: list[list]) -> PlannedFile | None:
    if not vision_plan:
        return None
    (tmp / "vision").mkdir()
    return PlannedFile(tmp / "vision" / "model.safetensors", [s for g in vision_plan for s in g])


def _vision_jobs(ck: Checkpoint, vision_out: PlannedFile | None) -> list:
    def write_vision(outs, mapped):
        for n, t in outs.items():
            vision_out.write(n, t, mapped)
    return [(s, "none", write_vision) for s in ck.program.vision]


def _run_steps(ck: Checkpoint, sources: SourceFiles, jobs: list, torch_dtype: torch.dtype, workers: int,
               outputs: list) -> None:
    """Run each (step, fp8 policy, write) job, writing its outputs as they come; discard every output on failure."""
    def task(step: Step, policy: FP8PolicyName, write):
        def run() -> None:  # the step's mappings are unmapped when its tensors go out of scope here
            mapped = MappedSources()
            inputs = [mapped.map(sources.fd(ck.tensors[n].path), ck.tensors[n].entry) for n in step.sources]
            write(run_step(step, inputs, torch_dtype, policy, ck.arch.num_layers), mapped)
        return run

    if workers > 1:  # biggest first, so the threads finish together instead of one running a last big step alone
        jobs = sorted(jobs, key=lambda job: -sum(ck.tensors[n].entry.nbytes for n in job[0].sources))
    try:
        with torch_ops_in_caller_threads():
            run_all([task(*job) for job in jobs], workers)
    except BaseException:
        for out in outputs:
            if out is not None:
                out.discard()
        raise


def _finish(tmp: Path, ck: Checkpoint, dtype: str, fp8: str, vision_out: PlannedFile | None, text_tensors: int,
            text_bytes: int, fp8_tensors: int) -> dict:
    """Close the vision file, copy the non-weight files; the report (convert.json) without its text files."""
    if vision_out is not None:
        vision_out.close()
    for name, path in sorted(ck.carried.items()):
        shutil.copyfile(path, tmp / name)
    vision_slots = vision_out.slots if vision_out is not None else {}
    vision_bytes = sum(s.nbytes for s in vision_slots.values())
    return {
        "format": FORMAT_VERSION,
        "family": ck.model_type.family.name,
        "model_type": ck.config.get("model_type"),
        "dtype": dtype,
        "fp8": fp8,
        "tensors": text_tensors + len(vision_slots),
        "text_tensors": text_tensors,
        "vision_tensors": len(vision_slots),
        "bytes": text_bytes + vision_bytes,
        "text_bytes": text_bytes,
        "vision_bytes": vision_bytes,
        "fp8_tensors": fp8_tensors,
    }
