"""verify: run the bundle through its backend (Backend.run_prompts) on the reference's prompts and gate the build on
agreement.

Metrics, over every prompt: top-1 agreement of the prefill logits at every prompt position, greedy token match
over the reference's N tokens (position by position, EOS not stopping), and max |logit - reference| over the
prefill positions. A bundle that returns tokens only (a neuron build sampling on the device: docs/nxdi.md section 21)
is held to the same token match; its top-1 is its first token against the reference's argmax at the last prompt
position, and it has no logit error: max_logit_err gates nothing, which the report (`logit_gate`, each prompt's
`max_logit_err: null`), the log and a failure's message say. Thresholds come from the recipe's `verify:`; a failure
raises BuildError whose message holds the per-prompt report, so nothing is cached and the build fails. On success
report.json is the output.

A NaN or infinite logit (in the bundle's output or in the reference's) fails the gate: NaN compares false with every
threshold, so without an explicit check a model of NaN weights would pass with `max_logit_err: NaN`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from qbuild import backends
from qbuild.backends.base import PromptRun
from qbuild.core import jsonio
from qbuild.core.dtypes import DTYPE_BYTES
from qbuild.core.errors import BuildError
from qbuild.core.numerics import fix_threads
from qbuild.core.units import GIB
from qbuild.model.arch import Arch
from qbuild.model.sizes import VERIFY_IMAGE_SIZE, image_patches
from qbuild.planning.step import Context, PlannedNode, Step
from qbuild.recipe.params import VerifyParams

if TYPE_CHECKING:
    from qbuild.recipe.schema import LoadedRecipe


@dataclass
class PromptReport:
    index: int
    text: str
    image: bool
    tokens: int                 # prompt length
    top1: float                 # fraction of prompt positions whose argmax agrees
    max_logit_err: float | None  # None: the bundle returned no logits (tokens only)
    token_match: float          # fraction of the N greedy tokens equal to the reference
    first_mismatch: int | None  # index of the first differing greedy token
    greedy: list[int]
    reference: list[int]
    nonfinite: int = 0          # prefill logits of the bundle that are NaN or infinite
    ref_nonfinite: int = 0      # the same in the reference's logits (the checkpoint itself is not finite)


def compare(index: int, record: dict, logits, ref_logits, greedy: list[int]) -> PromptReport:
    """`logits` None: the bundle returned tokens only, and `ref_logits` is the reference's last prompt position,
    whose argmax its first token is compared with."""
    ref = record["greedy"]
    if logits is None:
        top1 = float(bool(greedy) and greedy[0] == int(ref_logits[-1].argmax()))
        err, nonfinite = None, 0
    else:
        top1 = float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean())
        err = float((logits.float() - ref_logits.float()).abs().max())
        nonfinite = int((~logits.isfinite()).sum())
    same = [a == b for a, b in zip(greedy, ref)] + [False] * (len(ref) - len(greedy))
    first = next((i for i, s in enumerate(same) if not s), None)
    ref_nonfinite = int((~ref_logits.isfinite()).sum())
    return PromptReport(index, record["text"], record["image"], len(record["ids"]), top1, err,
                        sum(same) / len(ref), first, greedy, ref, nonfinite, ref_nonfinite)


def _positions(r: PromptReport) -> int:
    """How many positions a prompt's top-1 was measured at: each of its logits' rows, or, for a bundle that returns
    tokens only, its first token alone."""
    return 1 if r.max_logit_err is None else r.tokens


def top1_agreement(reports: list[PromptReport]) -> float:
    """Top-1 agreement over every prompt, each counted at the positions it was measured at: what top1_min gates."""
    return sum(r.top1 * _positions(r) for r in reports) / sum(_positions(r) for r in reports)


def token_match(reports: list[PromptReport]) -> float:
    """Greedy token match averaged over the prompts: what token_match_min gates."""
    return sum(r.token_match for r in reports) / len(reports)


def failures(reports: list[PromptReport], thresholds: VerifyParams) -> list[str]:
    top1, match = top1_agreement(reports), token_match(reports)
    what = "top-1 agreement" if any(r.max_logit_err is not None for r in reports) else "first-token top-1 agreement"
    errs = [r.max_logit_err for r in reports if r.max_logit_err is not None]
    out = []
    ref_bad = sum(r.ref_nonfinite for r in reports)
    if ref_bad:
        out.append(f"the reference's logits hold {ref_bad} NaN/inf values: the checkpoint's weights are not finite")
    bad = sum(r.nonfinite for r in reports)
    if bad:
        out.append(f"{bad} of the bundle's prefill logits are NaN or infinite")
    # Written as `not (value within bound)` so that a NaN metric fails instead of passing every comparison.
    if not top1 >= thresholds.top1_min:
        out.append(f"{what} {top1:.4f} < top1_min {thresholds.top1_min}")
    if not match >= thresholds.token_match_min:
        out.append(f"greedy token match {match:.4f} < token_match_min {thresholds.token_match_min}")
    err = max(errs) if errs else None
    if err is not None and not (math.isfinite(err) and err <= thresholds.max_logit_err):
        out.append(f"max |logit error| {err:.3g} > max_logit_err {thresholds.max_logit_err}")
    return out


NO_LOGITS = "not applied (tokens only)"


def logit_gate(reports: list[PromptReport]) -> str:
    """Whether max_logit_err gated the build: not where the bundle returned no logits (docs/nxdi.md section 21)."""
    return "applied" if any(r.max_logit_err is not None for r in reports) else NO_LOGITS


def _line(r: PromptReport) -> str:
    where = "" if r.first_mismatch is None else f", first mismatch at token {r.first_mismatch}"
    top1 = f"top1 {r.top1:.3f}" if r.max_logit_err is not None else f"first-token top1 {r.top1:.0f}"
    return (f"[{r.index}] {r.text[:32]!r}{' +image' if r.image else ''}: {top1}, tokens "
            f"{round(r.token_match * len(r.reference))}/{len(r.reference)}{where}, "
            + (f"logit gate {NO_LOGITS}" if r.max_logit_err is None else f"max err {r.max_logit_err:.3g}"))


class Verify(Step):
    kind = "verify"
    params = VerifyParams
    inputs = ("bundle", "reference")
    # Its report holds CPU-dependent floats, and it runs the bundle (a device's, for a neuron bundle).
    portable = False

    @classmethod
    def plan(cls, recipe) -> None:
        r, v = recipe.loaded.recipe, recipe.loaded.recipe.verify
        recipe.add(PlannedNode("verify", cls.kind, f"verify {recipe.name}",
                               VerifyParams(v.top1_min, v.token_match_min, v.max_logit_err),
                               {"bundle": "package", "reference": "reference", **recipe.source_roles()}, 1 << 20,
                               2 * recipe.sizes.weights + GIB + run_bytes(recipe.loaded, recipe.arch),
                               resources=recipe.backend_plan.verify_resources, backend=r.backend, code=recipe.runs))

    @classmethod
    def run(cls, ctx: Context) -> None:
        _run(ctx)


def run_bytes(loaded: LoadedRecipe, arch: Arch) -> int:
    """What running the bundle on the verify prompts holds beyond its weights, growing with the buckets: the host's
    KV cache of the largest token-generation bucket and the slice each decode graph gets of it, the prefill logits of
    the largest context bucket, and the verify image's pass through its vision bucket (the (1, 1, S, S) mask and
    each head's attention scores, with softmax's copy) (qbuild.model.runtime)."""
    r = loaded.recipe
    d, batch, tp = DTYPE_BYTES[r.dtype], r.text.batch_size, r.parallel.tp
    kv = 2 * arch.num_attn_layers * tp * batch * r.text.token_buckets[-1] * arch.per_rank(tp).kv_dim * d
    logits = batch * r.text.cte_buckets[-1] * arch.vocab_size * 4
    vision = 0
    if r.vision is not None and r.verify.image_prompt and arch.vision is not None:
        patches = image_patches(arch.vision, *VERIFY_IMAGE_SIZE)
        bucket = next((b for b in r.vision.buckets if b >= patches), r.vision.buckets[-1])
        vision = bucket * bucket * (d + 3 * 4 * arch.vision.num_heads)
    return 2 * kv + 2 * logits + vision


def _run(ctx: Context) -> None:
    from safetensors.torch import load_file

    fix_threads()
    thresholds: VerifyParams = ctx.params
    ref_dir = ctx.inputs["reference"]
    reference = json.loads((ref_dir / "reference.json").read_text())
    ref_logits = load_file(ref_dir / "logits.safetensors")
    backend = backends.get(json.loads((ctx.inputs["bundle"] / "bundle.json").read_text())["backend"])
    reports = [_report(ran, ref_logits) for ran in backend.run_prompts(ctx, reference, ref_dir)]
    failed = failures(reports, thresholds)
    gate = logit_gate(reports)
    doc = {"ok": not failed, "thresholds": asdict(thresholds), "failures": failed, "logit_gate": gate,
           "prompts": [asdict(r) for r in reports]}
    if failed:
        raise BuildError("verify failed: " + "; ".join(failed) + (f" | logit gate {gate}" if gate == NO_LOGITS else "")
                         + " | per prompt: " + " | ".join(map(_line, reports)))
    (ctx.out / "report.json").write_text(jsonio.dumps(doc, indent=1, sort_keys=True))
    for r in reports:
        ctx.log(_line(r))
    ctx.log(f"{len(reports)} prompt{'s' if len(reports) != 1 else ''} passed; logit gate {gate}")


def _report(run: PromptRun, ref_logits: dict) -> PromptReport:
    """A bundle that returns the last prompt position's logits only is compared there, as a prompt of one position."""
    ref = ref_logits[f"prompt{run.index}"]
    if not run.last_only:
        return compare(run.index, run.record, run.logits, ref, run.greedy)
    return replace(compare(run.index, run.record, run.logits, ref[-1:], run.greedy), tokens=1)
