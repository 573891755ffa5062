"""The converted text weights as data: a small, exact description of every converted tensor, which readers run.

The convert step writes this description (text/description.json) instead of the NxDI-layout text weights; whoever
needs a converted tensor (the shard step, a materialized checkpoint for debugging) runs the step that makes it, from
the source checkpoint's bytes, one step at a time. The document is the conversion program made data:

    {"format": 1, "family", "model_type", "dtype", "fp8",
     "files": {file: {"digest", "size"}},       every source file a step reads, with the snapshot's digest
     "tensors": n, "bytes": b,                   how many converted tensors, and the bytes they would hold
     "steps": [{"rule": "attention.split_query_gate", "args": {},
                "sources": [[file, tensor, dtype, shape, [begin, end]], ...],   the byte range in the file
                "outputs": [[name, dtype, shape], ...]}]}   after the cast to dtype (norms: float32) or FP8

A rule is named, never copied: its code stays in its module (one place per weight-layout rule), and every step that
runs it from a description has that module in its key, through its import closure. The Arch a rule is bound with is
config.json's, which the convert output carries beside the description; `args` are what a rule is bound with
besides it (the embedding's pad row). Opening a description derives it again from the checkpoint files it names and
refuses any difference, so a reader runs exactly the described steps on exactly the described bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch

from qbuild.core.dtypes import torch_dtype as dtype_of
from qbuild.model.convert import fp8 as fp8_rules
from qbuild.model.convert.layout import Checkpoint, open_checkpoint
from qbuild.model.convert.errors import CheckpointError
from qbuild.model.convert.safetensors_io import DTYPE_NAMES, DTYPES, MappedSources
from qbuild.model.convert.rule import Step
from qbuild.model.convert.writer import SourceFiles, Spec, meta_specs, spec_bytes
from qbuild.model.fp8 import FP8PolicyName, policy as fp8_policy

FORMAT = 1
FILE = "description.json"       # under the convert output's text/
LABEL = f"text/{FILE}"


def run_step(step: Step, inputs: list[torch.Tensor], dtype: torch.dtype, fp8: FP8PolicyName,
             num_layers: int) -> dict[str, torch.Tensor]:
    """One step's NxDI outputs: the rule, then the cast to `dtype` (except float32-kept norms), or FP8 quantization
    of the tensors the policy selects (from the uncast values, to lose precision only once)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in step(*inputs).items():
        if fp8_rules.is_quantized(name, fp8, num_layers):
            out.update(fp8_rules.apply_policy(name, t, fp8, num_layers))
        else:
            out[name] = t if step.keep_fp32 else t.to(dtype)
    return out


# Steps whose inputs total at most this many bytes are planned on real zero tensors rather than meta ones: the
# first arithmetic op on a meta tensor (a norm's +1) pays a one-time setup in torch of 0.6-2.5 s.
_PLAN_ON_ZEROS_BYTES = 1 << 20


def plan_outputs(ck: Checkpoint, steps: list[Step], dtype: torch.dtype, policy: FP8PolicyName) -> list[list[Spec]]:
    """Each step's outputs (name, dtype, shape), learnt by running it on stand-ins of its inputs: no data is read."""
    plans = []
    for step in steps:
        entries = [ck.tensors[n].entry for n in step.sources]
        device = "cpu" if sum(e.nbytes for e in entries) <= _PLAN_ON_ZEROS_BYTES else "meta"
        stand_ins = [torch.zeros(e.shape, dtype=DTYPES[e.dtype], device=device) for e in entries]
        plans.append(meta_specs(run_step(step, stand_ins, dtype, policy, ck.arch.num_layers)))
    return plans


def describe(ck: Checkpoint, digests: Mapping[str, str], dtype: str, fp8: FP8PolicyName,
             plans: list[list[Spec]]) -> dict:
    """The description of the text steps of `ck`, whose outputs are `plans` (plan_outputs); `digests` maps each
    checkpoint file name to its digest (the snapshot's)."""
    steps, files = [], {}
    for step, outputs in zip(ck.program.text, plans):
        sources = []
        for name in step.sources:
            t = ck.tensors[name]
            if t.file not in files:
                files[t.file] = {"digest": digests[t.file], "size": t.path.stat().st_size}
            sources.append([t.file, name, t.entry.dtype, list(t.entry.shape), [t.entry.begin, t.entry.end]])
        steps.append({"rule": step.rule, "args": dict(step.args), "sources": sources,
                      "outputs": [[n, DTYPE_NAMES[d], list(s)] for n, d, s in outputs]})
    return {"format": FORMAT, "family": ck.model_type.family.name, "model_type": ck.config.get("model_type"),
            "dtype": dtype, "fp8": fp8, "files": dict(sorted(files.items())),
            "tensors": sum(len(p) for p in plans), "bytes": sum(spec_bytes(s) for p in plans for s in p),
            "steps": steps}


@dataclass(frozen=True)
class Producer:
    """Makes some converted tensors: maps its inputs into `mapped` and runs its step (or maps a stored tensor)."""
    names: tuple[str, ...]
    nbytes: int                                             # the bytes of its inputs
    run: Callable[[MappedSources], dict[str, torch.Tensor]]


class Described:
    """A description opened against the checkpoint files it names: what each converted tensor is (`specs`) and the
    producers that make them. Holds the files open until `close`."""

    label = LABEL

    def __init__(self, ck: Checkpoint, doc: dict, plans: list[list[Spec]]):
        self.ck, self.doc, self.plans = ck, doc, plans
        self.dtype, self.fp8 = dtype_of(doc["dtype"]), doc["fp8"]
        self.specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = dict(sorted(
            (n, (d, s)) for plan in plans for n, d, s in plan))
        self.files = SourceFiles(sorted({ck.tensors[n].path for step in ck.program.text for n in step.sources}))

    def producers(self) -> list[Producer]:
        return [self._producer(step, plan) for step, plan in zip(self.ck.program.text, self.plans)]

    def _producer(self, step: Step, plan: list[Spec]) -> Producer:
        located = [self.ck.tensors[n] for n in step.sources]

        def run(mapped: MappedSources) -> dict[str, torch.Tensor]:
            inputs = [mapped.map(self.files.fd(t.path), t.entry) for t in located]
            return run_step(step, inputs, self.dtype, self.fp8, self.ck.arch.num_layers)
        return Producer(tuple(n for n, _, _ in plan), sum(t.entry.nbytes for t in located), run)

    def close(self) -> None:
        self.files.close()


def read_description(directory: Path) -> dict:
    """The description document of a convert output `directory`; CheckpointError naming it if unreadable."""
    path = Path(directory) / "text" / FILE
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(LABEL, f"cannot be read ({e.__class__.__name__})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(LABEL, f"is not a format {FORMAT} description of converted weights")
    return doc


def open_described(directory: Path, files: Mapping[str, Path] | None,
                   digests: Mapping[str, str] | None = None) -> Described:
    """The description under `directory`, opened against the checkpoint whose files `files` locates (file name ->
    path, as convert_checkpoint takes it). `digests` (file name -> digest, the snapshot's) must match the described
    files'; without it the files are hashed. CheckpointError naming the description where the checkpoint is not the
    one described, or this qbuild's conversion program would make something else of it."""
    doc = read_description(directory)
    if not files:
        raise CheckpointError(LABEL, "describes weights converted from a checkpoint; its files are needed to read them")
    dtype = dtype_of(doc["dtype"])
    fp8_policy(doc["fp8"])
    ck = open_checkpoint(next(iter(files.values())).parent, files)
    digests = dict(digests) if digests is not None else file_digests(files, doc["files"])
    plans = plan_outputs(ck, ck.program.text, dtype, doc["fp8"])
    try:
        again = describe(ck, digests, doc["dtype"], doc["fp8"], plans)
    except KeyError as e:
        raise CheckpointError(LABEL, f"names {e.args[0]}, which has no digest in the snapshot") from None
    _require_same(doc, again)
    return Described(ck, doc, plans)


def file_digests(files: Mapping[str, Path], names) -> dict[str, str]:
    """BLAKE3 digests of the named checkpoint files, for a description written or read outside a build."""
    from qbuild.core.hashing import digest_file

    return {name: "blake3:" + digest_file(Path(files[name])) for name in names if name in files}


def _require_same(doc: dict, again: dict) -> None:
    """CheckpointError naming the first field where the stored description differs from the one derived now."""
    if doc == again:
        return
    for field in ("family", "model_type", "dtype", "fp8", "files", "tensors", "bytes"):
        if doc.get(field) != again.get(field):
            raise CheckpointError(LABEL, f"{field} differs from the checkpoint's ({_short(doc.get(field))} described, "
                                         f"{_short(again.get(field))} now)")
    old, new = doc.get("steps") or [], again["steps"]
    for i, (a, b) in enumerate(zip(old, new)):
        if a != b:
            what = b["outputs"][0][0] if b["outputs"] else f"step {i}"
            raise CheckpointError(LABEL, f"step {i} ({what}) differs from what this qbuild's conversion program "
                                         "makes of the checkpoint; convert it again")
    raise CheckpointError(LABEL, f"has {len(old)} steps, the conversion program {len(new)}; convert it again")


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."
