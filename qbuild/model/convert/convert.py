"""The convert step: an HF checkpoint -> tp-independent NxDI-layout text weights (+ vision weights).

Output directory:
  text/model-00001.safetensors ...      canonical NxDI names, unsharded (shard.py splits them per rank)
  text/model.safetensors.index.json     tensor -> file
  vision/model.safetensors              VL families only: the traced encoder's names + host-side patch/pos embeds
  config.json, tokenizer*.json, ...     the checkpoint's non-weight files, copied
  convert.json                          what was done: family, dtype, fp8 policy, tensor count, bytes

Both entry points run the same Steps (layout.py) through `run_step`; the streaming one reads one step's tensors at
a time, so peak memory is a few times the largest step's inputs (one tensor, or one layer's per-expert tensors),
whatever the checkpoint's size.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Mapping

import torch

from qbuild.model.convert import fp8 as fp8_rules
from qbuild.model.convert.checkpoint import TensorInfo, arch_of, open_checkpoint, validate
from qbuild.core.dtypes import torch_dtype as dtype_of
from qbuild.model.convert.layout import program
from qbuild.model.convert.safetensors_io import DTYPE_NAMES, DTYPES, MappedSources, PlannedFile, contiguous
from qbuild.model.convert.steps import Step
from qbuild.model.convert.writer import DEFAULT_SHARD_BYTES, ShardedOutput, SourceFiles, meta_specs, write_json
from qbuild.model.fp8 import FP8PolicyName, policy as fp8_policy
from qbuild.store.files import staged
from qbuild.core.threads import run_all

FORMAT_VERSION = 1


def check_policy(fp8: str) -> None:
    fp8_policy(fp8)


def run_step(step: Step, inputs: list[torch.Tensor], dtype: torch.dtype, fp8: FP8PolicyName,
             num_layers: int) -> dict[str, torch.Tensor]:
    """One step's NxDI outputs: the rule, then the cast to `dtype` (except float32-kept norms), or FP8 quantisation
    of the tensors the policy selects (from the uncast values, to lose precision only once)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in step(*inputs).items():
        if fp8_rules.is_quantised(name, fp8, num_layers):
            out.update(fp8_rules.apply_policy(name, t, fp8, num_layers))
        else:
            out[name] = t if step.keep_fp32 else t.to(dtype)
    return out


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
    validate(infos, prog, model_type, "<state dict>")
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
    """HF checkpoint directory `src` -> converted directory `dst` (layout in the module docstring).

    `files` maps checkpoint file names to their real paths (e.g. HF cache blobs). The whole checkpoint is validated
    before anything is written; output is staged beside `dst` and renamed into place, so on any error `dst` is not
    created. `workers` > 1 runs independent steps in threads. Returns the convert.json document."""
    torch_dtype = dtype_of(dtype)
    check_policy(fp8)
    ck = open_checkpoint(Path(src), files)
    layers = ck.arch.num_layers

    def plan(steps: list[Step], policy: FP8PolicyName) -> list[list]:
        return [meta_specs(run_step(s, _plan_inputs([ck.tensors[n].entry for n in s.sources]), torch_dtype,
                                    policy, layers)) for s in steps]

    text_plan, vision_plan = plan(ck.program.text, fp8), plan(ck.program.vision, "none")
    sources = SourceFiles(sorted({t.path for t in ck.tensors.values()}))
    try:
        with staged(Path(dst), directory=True) as tmp:
            report = _write_converted(tmp, ck, sources, text_plan, vision_plan, torch_dtype, dtype, fp8, workers,
                                      max_shard_bytes)
    finally:
        sources.close()
    return report


def _write_converted(tmp: Path, ck, sources: SourceFiles, text_plan, vision_plan, torch_dtype: torch.dtype,
                     dtype: str, fp8: FP8PolicyName, workers: int, max_shard_bytes: int) -> dict:
    """Run every step into the planned files under `tmp`, copy the non-weight files, write convert.json."""
    (tmp / "text").mkdir()
    text_out = ShardedOutput.open(tmp / "text", text_plan, max_shard_bytes)
    vision_out = None
    if vision_plan:
        (tmp / "vision").mkdir()
        vision_out = PlannedFile(tmp / "vision" / "model.safetensors", [s for g in vision_plan for s in g])

    def task(step: Step, policy: FP8PolicyName, write):
        def run() -> None:  # the step's mappings are unmapped when its tensors go out of scope here
            mapped = MappedSources()
            inputs = [mapped.map(sources.fd(ck.tensors[n].path), ck.tensors[n].entry) for n in step.sources]
            write(run_step(step, inputs, torch_dtype, policy, ck.arch.num_layers), mapped)
        return run

    def write_vision(outs, mapped):
        for n, t in outs.items():
            vision_out.write(n, t, mapped)

    steps = [(s, fp8, text_out.write) for s in ck.program.text] + [(s, "none", write_vision) for s in ck.program.vision]
    if workers > 1:  # biggest first, so the threads finish together instead of one running a last big step alone
        steps.sort(key=lambda job: -sum(ck.tensors[n].entry.nbytes for n in job[0].sources))
    tasks = [task(*job) for job in steps]
    try:
        run_all(tasks, workers)
    except BaseException:
        text_out.discard()
        if vision_out is not None:
            vision_out.discard()
        raise
    index = text_out.close()
    if vision_out is not None:
        vision_out.close()
    for name, path in sorted(ck.carried.items()):
        shutil.copyfile(path, tmp / name)
    report = _report(ck, dtype, fp8, index, text_out, vision_out)
    write_json(tmp / "convert.json", report)
    return report


# Steps whose inputs total at most this many bytes are planned on real zero tensors rather than meta ones: the
# first arithmetic op on a meta tensor (a norm's +1) pays a one-time setup in torch of 0.6-2.5 s.
_PLAN_ON_ZEROS_BYTES = 1 << 20


def _plan_inputs(entries) -> list[torch.Tensor]:
    """Stand-ins with the inputs' shapes and dtypes, for planning: only the outputs' shapes and dtypes are used."""
    device = "cpu" if sum(e.nbytes for e in entries) <= _PLAN_ON_ZEROS_BYTES else "meta"
    return [torch.zeros(e.shape, dtype=DTYPES[e.dtype], device=device) for e in entries]


def _report(ck, dtype: str, fp8: str, index: dict, text_out: ShardedOutput, vision_out: PlannedFile | None) -> dict:
    vision_slots = vision_out.slots if vision_out is not None else {}
    text_bytes = index["metadata"]["total_size"]
    vision_bytes = sum(s.nbytes for s in vision_slots.values())
    return {
        "format": FORMAT_VERSION,
        "family": ck.model_type.family.name,
        "model_type": ck.config.get("model_type"),
        "dtype": dtype,
        "fp8": fp8,
        "tensors": len(index["weight_map"]) + len(vision_slots),
        "text_tensors": len(index["weight_map"]),
        "vision_tensors": len(vision_slots),
        "bytes": text_bytes + vision_bytes,
        "text_bytes": text_bytes,
        "vision_bytes": vision_bytes,
        "text_files": [f.path.name for f in text_out.files],
        "fp8_tensors": sum(n.endswith(".scale") for n in index["weight_map"]),
    }
