"""The one full AOTInductor build: a tiny Qwen3-Next recipe compiled to native code, verified, and run through
`qbuild run` with the same greedy tokens as transformers' generate. Its model has two layers, one of each kind
(Gated DeltaNet, then gated attention): native compile time grows with the layers, and one of each covers every
kernel. About a minute on 2 cores, hence `slow`."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO, qbuild


@pytest.mark.slow
def test_inductor_bundle_verifies_and_runs(tmp_path):
    import torch
    import transformers

    from qbuild.model.tinymodel import write_tiny_checkpoint

    checkpoint = write_tiny_checkpoint(tmp_path / "model", "qwen3_next")
    recipe = tmp_path / "next-inductor.yaml"
    recipe.write_text(f"model: {{path: {checkpoint}}}\nbackend: inductor\ndtype: float32\nparallel: {{tp: 1}}\n"
                      "text: {seq_len: 32, cte_buckets: [16], tkg_buckets: [32]}\n"
                      'verify: {top1_min: 0.99, token_match_min: 1.0, max_logit_err: 0.001, new_tokens: 6, '
                      'prompts: ["1, 2, 3, 4, 5,"]}\n')
    env = {"PYTHONPATH": str(REPO)}
    store = str(tmp_path / "store")
    # The C++ wrapper only sequences the kernel calls: compiled at -O0 instead of inductor's -O1 it takes half the
    # time, and the kernels, whose code computes the logits, keep every flag they ship with.
    proc = qbuild("compile", str(recipe), "-j", "2", "--json", "--store", store, cwd=tmp_path,
                  env={**env, "AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL": "O0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compile cte-16 (inductor)" in json.loads(proc.stdout)["built"]
    prompt = "Hello world! 0123"
    proc = qbuild("run", "next-inductor", "--prompt", prompt, "--max-new-tokens", "6", "--json", "--store", store,
                  cwd=tmp_path, env=env, check=True)
    out = json.loads(proc.stdout)
    tok = transformers.AutoTokenizer.from_pretrained(checkpoint)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    assert ids.shape[1] <= 16
    assert out["token_ids"] == model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
