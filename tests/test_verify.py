"""The verify gate's metrics and thresholds, on synthetic logits."""

from __future__ import annotations

from dataclasses import replace

import torch

from qbuild.steps.verify import _line, compare, failures
from qbuild.recipe.params import VerifyParams

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


def test_a_bundle_of_tokens_only_is_held_to_its_tokens_and_its_first_token():
    """A bundle that samples on the device returns no logits: its top-1 is its first token against the reference's
    argmax at the last prompt position (what its last-position logits would have been compared with), its token match
    is the same gate, and no logit error is claimed or checked."""
    ref = torch.zeros(1, 10)
    ref[0, 7] = 1.0                                   # the reference's last prompt position: argmax 7
    right = compare(0, _record(greedy=(7, 2, 3)), None, ref, [7, 2, 3])
    assert (right.top1, right.token_match, right.max_logit_err, right.nonfinite) == (1.0, 1.0, None, 0)
    assert failures([right], THRESHOLDS) == []
    assert _line(right).endswith("tokens 3/3, logit gate not applied (tokens only)")
    wrong = compare(0, _record(greedy=(7, 2, 3)), None, ref, [6, 2, 3])
    assert wrong.top1 == 0.0 and wrong.first_mismatch == 0
    assert [m.split(" <")[0] for m in failures([wrong], THRESHOLDS)] == ["first-token top-1 agreement 0.0000",
                                                                          "greedy token match 0.6667"]
    assert _line(wrong).startswith("[0] 'prompt': first-token top1 0, tokens 2/3, first mismatch at token 0")


def test_a_tokens_only_bundles_first_tokens_count_one_per_prompt():
    """A tokens-only bundle's top-1 is one comparison per prompt, its first token: a long prompt counts as one, so
    four short prompts whose first token is wrong fail the gate beside one long prompt that is right (weighted by
    prompt length, 400 right positions of 440 would pass 0.9)."""
    ref = torch.zeros(1, 10)
    ref[0, 7] = 1.0
    right = compare(0, _record(n=400, greedy=(7, 2, 3, 4, 5)), None, ref, [7, 2, 3, 4, 5])
    wrong = [compare(i, _record(n=10, greedy=(7, 2, 3, 4, 5)), None, ref, [6, 2, 3, 4, 5]) for i in range(1, 5)]
    msgs = failures([right, *wrong], VerifyParams(top1_min=0.9, token_match_min=0.6, max_logit_err=1e-3))
    assert msgs == ["first-token top-1 agreement 0.2000 < top1_min 0.9"]


def test_shipped_golden_prompts_are_pinned():
    from qbuild.steps.reference import golden

    doc = golden()  # raises if prompts.json changed without its pinned digest
    assert doc["prompts"] and all(isinstance(p, str) and p for p in doc["prompts"]) and doc["image_prompt"]


def _reference(tmp_path, prompts) -> tuple:
    """A reference (reference.json, logits.safetensors with an eye per prompt) and an empty bundle directory."""
    import json

    from safetensors.torch import save_file

    ref, bundle = tmp_path / "reference", tmp_path / "bundle"
    ref.mkdir()
    bundle.mkdir()
    (ref / "reference.json").write_text(json.dumps({"prompts": prompts}))
    logits = {f"prompt{i}": torch.eye(2, 10) for i in range(len(prompts))}
    save_file(logits, ref / "logits.safetensors")
    return ref, bundle, logits


def _verify(tmp_path, ref, bundle, thresholds=None) -> list[dict]:
    import json

    from qbuild.planning.step import Context
    from qbuild.steps.verify import Verify

    out = tmp_path / "out"
    out.mkdir()
    params = thresholds or VerifyParams(top1_min=0.0, token_match_min=0.0, max_logit_err=1e9)
    Verify.run(Context(params, {"bundle": bundle, "reference": ref, "port": tmp_path}, out, tmp_path / "scratch",
                       log=lambda s: None))
    return json.loads((out / "report.json").read_text())["prompts"]


def test_verify_runs_the_bundle_through_its_backend(tmp_path):
    """The verify step asks the backend the bundle names (a double registered through qbuild.backends.using) to run
    it, and compares what it returns: every position of a full prefill, the last one alone where the backend says so."""
    import json

    from qbuild import backends
    from qbuild.backends.base import PromptRun

    prompts = [{"text": "a", "ids": [0, 1], "greedy": [5, 6], "image": False},
               {"text": "b", "ids": [0, 1], "greedy": [5, 6], "image": False}]
    ref, bundle, logits = _reference(tmp_path, prompts)
    (bundle / "bundle.json").write_text(json.dumps({"backend": "export"}))

    class Double:
        name = "export"

        def run_prompts(self, ctx, reference, ref_dir):
            assert ctx.inputs["bundle"] == bundle and ref_dir == ref
            return [PromptRun(0, reference["prompts"][0], logits["prompt0"], [5, 6], last_only=False),
                    PromptRun(1, reference["prompts"][1], logits["prompt1"][-1:], [5, 0], last_only=True)]

    with backends.using(Double()):
        first, second = _verify(tmp_path, ref, bundle)
    assert first["tokens"] == 2 and first["top1"] == 1.0 and first["token_match"] == 1.0
    assert second["tokens"] == 1 and second["max_logit_err"] == 0.0 and second["first_mismatch"] == 1


def test_a_neuron_bundle_is_compared_up_to_its_first_generated_pad_token(tmp_path):
    """The ports feed a generated pad token back as padding, so a neuron bundle's tokens after it are not comparable
    with transformers': the comparison stops after it, on both sides, and only there."""
    import json

    from qbuild import backends
    from qbuild.backends.neuron.backend import NeuronBackend
    from qbuild.backends.neuron.deploy import QBUILD_RECORD

    pad = 2
    prompts = [{"text": "a", "ids": [0, 1], "greedy": [5, pad, 7, 7], "image": False},
               {"text": "b", "ids": [0, 1], "greedy": [5, 6, 7, 8], "image": False}]
    ref, bundle, logits = _reference(tmp_path, prompts)
    (bundle / "bundle.json").write_text(json.dumps({"backend": "neuron"}))
    (bundle / QBUILD_RECORD).write_text(json.dumps({"params": {"pad_token_id": pad}}))
    # The device run itself needs NeuronCores: the neuron backend is given a double of it. After the pad the device's
    # tokens differ; the second prompt generates no pad, so its whole comparison stands and its last token is wrong.
    device = [[5, pad, 9, 9], [5, 6, 7, 0]]

    def run_bundle(*args):
        return device, {f"prompt{k}": logits[f"prompt{k}"][-1:] for k in range(2)}

    with backends.using(NeuronBackend(run_bundle=run_bundle)):
        first, second = _verify(tmp_path, ref, bundle)
    assert first["reference"] == [5, pad] and first["greedy"] == [5, pad] and first["token_match"] == 1.0
    assert second["token_match"] == 0.75 and second["first_mismatch"] == 3


def test_the_report_says_the_logit_gate_was_not_applied_to_a_bundle_of_tokens_only(tmp_path):
    """A bundle that returns tokens only passes or fails on its tokens; the report, the log and a failure's message
    say that max_logit_err gated nothing, rather than leaving only a null."""
    import json

    import pytest

    from qbuild import backends
    from qbuild.backends.base import PromptRun
    from qbuild.core.errors import BuildError
    from qbuild.planning.step import Context
    from qbuild.steps.verify import Verify

    prompts = [{"text": "a", "ids": [0, 1], "greedy": [1, 6], "image": False}]
    ref, bundle, _ = _reference(tmp_path, prompts)
    (bundle / "bundle.json").write_text(json.dumps({"backend": "export"}))
    greedy = [[1, 6]]

    class Double:
        name = "export"

        def run_prompts(self, ctx, reference, ref_dir):
            return [PromptRun(0, reference["prompts"][0], None, greedy[0], last_only=True)]

    logged = []
    out = tmp_path / "out"
    out.mkdir()
    with backends.using(Double()):
        Verify.run(Context(VerifyParams(top1_min=0.0, token_match_min=1.0, max_logit_err=0.0),
                           {"bundle": bundle, "reference": ref, "port": tmp_path}, out, tmp_path / "scratch",
                           log=logged.append))
        report = json.loads((out / "report.json").read_text())
        assert report["ok"] is True and report["logit_gate"] == "not applied (tokens only)"
        assert logged[-1] == "1 prompt passed; logit gate not applied (tokens only)"
        greedy[0] = [1, 5]
        with pytest.raises(BuildError, match=r"^verify failed: greedy token match 0.5000 < token_match_min 1.0 \| "
                                             r"logit gate not applied \(tokens only\) \| per prompt: "):
            Verify.run(Context(VerifyParams(top1_min=0.0, token_match_min=1.0, max_logit_err=0.0),
                               {"bundle": bundle, "reference": ref, "port": tmp_path}, tmp_path / "out2",
                               tmp_path / "scratch", log=logged.append))
