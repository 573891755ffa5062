"""The verify gate's metrics and thresholds, on synthetic logits."""

from __future__ import annotations

from dataclasses import replace

import torch

from qbuild.actions.verify import _line, compare, failures
from qbuild.params import VerifyParams

THRESHOLDS = VerifyParams(top1_min=0.99, token_match_min=1.0, max_logit_err=1e-3)


def _record(n=4, greedy=(1, 2, 3)):
    return {"text": "prompt", "ids": list(range(n)), "greedy": list(greedy), "image": False}


def test_identical_outputs_pass():
    ref = torch.randn(4, 10)
    r = compare(0, _record(), ref.clone(), ref, [1, 2, 3])
    assert r.top1 == 1.0 and r.token_match == 1.0 and r.max_logit_err == 0.0 and r.first_mismatch is None
    assert failures([r], THRESHOLDS) == []


def test_each_threshold_reports_itself():
    ref = torch.zeros(4, 10)
    ref[:, 0] = 1.0
    ours = ref.clone()
    ours[1, 5] = 2.0                      # one position's argmax flips; error 2.0
    r = compare(3, _record(), ours, ref, [1, 9])   # one wrong token, one missing
    assert r.top1 == 0.75 and abs(r.token_match - 1 / 3) < 1e-9 and r.first_mismatch == 1
    msgs = failures([r], THRESHOLDS)
    assert len(msgs) == 3 and "top-1 agreement 0.7500 < top1_min 0.99" in msgs[0]
    assert "greedy token match" in msgs[1] and "max |logit error| 2 > max_logit_err" in msgs[2]
    assert _line(r).startswith("[3] 'prompt': top1 0.750, tokens 1/3, first mismatch at token 1")


def test_top1_is_weighted_by_prompt_length():
    a = compare(0, _record(n=4), torch.eye(4, 10), torch.eye(4, 10), [1, 2, 3])
    bad = torch.eye(1, 10)
    b = compare(1, _record(n=1), bad.flip(1), bad, [1, 2, 3])
    assert failures([a, b], replace(THRESHOLDS, top1_min=0.8, max_logit_err=10)) == []


def test_shipped_golden_prompts_are_pinned():
    from qbuild.actions.reference import golden

    doc = golden()  # raises if prompts.json changed without its pinned digest
    assert doc["prompts"] and all(isinstance(p, str) and p for p in doc["prompts"]) and doc["image_prompt"]
