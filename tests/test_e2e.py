"""End to end: tiny checkpoints of every family -> recipes -> verified bundles (export backend), run through the
CLI, compared with HF transformers; what a change rebuilds; a failing verify gate; pull refusing a bad blob.

One session-scoped build serves every test here (three recipes: dense VL at tp2 with a vision bucket and an image
prompt, MoE at tp2 ep2, Qwen3-Next at tp1); tests that change something build into the same store, so they only
pay for what their change rebuilds. That build, and a run of the pulled VL bundle, run under
tests/test_pickle_ban.py's audit of every unpickling.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, qbuild
from tests.test_pickle_ban import audited_env, events, violations

# One worker takes the whole file: every test here shares the session-scoped build `ws`.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("e2e")]

PROMPTS = ["The capital of France is", "1, 2, 3, 4, 5,"]
RECIPES = {
    "vl-dense-tp2": ("qwen3_5", "parallel: {tp: 2}\nvision: {buckets: [64]}\n"),
    "moe-tp2-ep2": ("qwen3_5_moe", "parallel: {tp: 2, ep: 2}\n"),
    "next-tp1": ("qwen3_next", "parallel: {tp: 1}\n"),
}


@dataclass
class Workspace:
    root: Path
    env: dict
    checkpoints: dict
    first: dict          # `qbuild compile --json` of the first build

    def qbuild(self, *args: str, check: bool = False):
        return qbuild(*args, "--store", str(self.root / "store"), cwd=self.root, env=self.env, check=check)

    def recipe(self, name: str, family: str, extra: str, **verify) -> Path:
        checkpoint = verify.pop("checkpoint", self.checkpoints[family])
        text = verify.pop("text", "text: {seq_len: 64, cte_buckets: [32], tkg_buckets: [64]}")
        v = {"top1_min": 0.99, "token_match_min": 1.0, "max_logit_err": 0.001, "new_tokens": 6, "prompts": PROMPTS,
             **verify}
        f = self.root / "recipes" / f"{name}.yaml"
        f.parent.mkdir(exist_ok=True)
        f.write_text(f"model: {{path: {checkpoint}}}\nbackend: export\ndtype: float32\n{text}\n{extra}"
                     f"verify: {json.dumps(v)}\n")
        return f

    def lock(self) -> dict:
        return json.loads((self.root / "artifacts.lock").read_text())

    def blob(self, recipe: str, role: str, path: str) -> Path:
        doc = self.lock()
        node = doc["nodes"][doc["recipes"][recipe]["nodes"][role]]
        digest = node["outputs"][path]["digest"]
        return self.root / "store" / "cas" / digest[:2] / digest


@pytest.fixture(scope="session")
def ws(tmp_path_factory, small_checkpoints) -> Workspace:
    root = tmp_path_factory.mktemp("e2e")
    env = {"XDG_CACHE_HOME": str(root / "xdg"), "HF_HOME": str(root / "hf"), "HF_HUB_OFFLINE": "1",
           "QBUILD_STORE": str(root / "store"), "PYTHONPATH": str(REPO)}
    w = Workspace(root, env, small_checkpoints, {})
    files = [str(w.recipe(name, fam, extra)) for name, (fam, extra) in RECIPES.items()]
    proc = qbuild("compile", *files, "-j", "2", "--json", "--store", str(root / "store"), cwd=root,
                  env={**env, **audited_env(root / "build-audit.log")})
    assert proc.returncode == 0, proc.stderr[-4000:]
    w.first = json.loads(proc.stdout)
    return w


def _names(result: dict, kind: str) -> list[str]:
    return [n for n in result["built"] if n.startswith(kind)]


def test_every_family_builds_a_verified_bundle(ws):
    assert ws.first["ok"] and not ws.first["failed"]
    assert sorted(_names(ws.first, "verify")) == [f"verify {n}" for n in sorted(RECIPES)]
    assert "compile vision-64 (export)" in ws.first["built"]
    doc = ws.lock()
    for name in RECIPES:
        assert doc["recipes"][name]["verified"]
        report = json.loads(ws.blob(name, "verify", "report.json").read_text())
        assert report["ok"] and all(p["token_match"] == 1.0 for p in report["prompts"])
    vl = json.loads(ws.blob("vl-dense-tp2", "verify", "report.json").read_text())
    assert [p["image"] for p in vl["prompts"]] == [False, False, True]
    bundle = json.loads(ws.blob("moe-tp2-ep2", "package", "bundle.json").read_text())
    assert bundle["tp"] == 2 and bundle["ep"] == 2 and bundle["backend"] == "export"
    assert {"weights/tp0_sharded_checkpoint.safetensors", "weights/tp1_sharded_checkpoint.safetensors",
            "graphs/cte-32.pt2", "graphs/tkg-64.pt2", "config.json", "tokenizer.json"} <= set(bundle["files"])


def test_the_build_unpickles_nothing_but_pool_messages_and_graph_examples(ws):
    recorded = events(ws.root / "build-audit.log")
    assert violations(recorded) == []
    # The audit ran in the workers too (their jobs arrive pickled), and graphs were loaded under it (verify).
    assert any(e["api"] == "pickle.find_class" and e["detail"] == "qbuild.execution.job.Job" for e in recorded)
    assert any(e["api"] == "torch.load" for e in recorded)


def test_second_compile_builds_nothing(ws):
    files = [str(ws.root / "recipes" / f"{n}.yaml") for n in RECIPES]
    proc = ws.qbuild("compile", *files, "--json", check=True)
    assert json.loads(proc.stdout)["built"] == []


def test_run_json_matches_transformers_generate(ws, small_checkpoints):
    import torch
    import transformers

    prompt = "Hello world! The quick brown fox"
    proc = ws.qbuild("run", "next-tp1", "--prompt", prompt, "--max-new-tokens", "8", "--json", check=True)
    out = json.loads(proc.stdout)
    assert set(out) >= {"token_ids", "text", "ttft_ms", "tpot_ms"} and out["ttft_ms"] > 0
    tok = transformers.AutoTokenizer.from_pretrained(small_checkpoints["qwen3_next"])
    model = transformers.AutoModelForCausalLM.from_pretrained(small_checkpoints["qwen3_next"], dtype=torch.float32)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    expected = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
    assert out["token_ids"] == expected
    assert out["text"] == tok.decode(expected, skip_special_tokens=True)


def test_pulled_vl_bundle_runs_an_image_prompt_unpickling_only_graph_examples_and_benches(ws, tmp_path):
    dest = tmp_path / "bundle"
    ws.qbuild("pull", "vl-dense-tp2", "--to", str(dest), check=True)
    reference = json.loads(ws.blob("vl-dense-tp2", "reference", "reference.json").read_text())
    image_record = next(p for p in reference["prompts"] if p["image"])
    image = ws.blob("vl-dense-tp2", "reference", "image.png")
    log = tmp_path / "run-audit.log"
    proc = qbuild("run", str(dest), "--prompt", image_record["text"], "--image", str(image), "--max-new-tokens", "6",
                  "--json", cwd=ws.root, env={**ws.env, **audited_env(log)}, check=True)
    tokens = json.loads(proc.stdout)["token_ids"]
    assert tokens == image_record["greedy"][:len(tokens)] and tokens  # the run may stop early at EOS
    # The run loaded the text and vision graphs under the pickle audit, and unpickled nothing else.
    assert violations(events(log)) == [] and any(e["api"] == "torch.load" for e in events(log))
    proc = ws.qbuild("bench", str(dest), "--repeats", "2", "--warmup", "0", "--new-tokens", "4", "--json",
                     check=True)
    points = json.loads(proc.stdout)["points"]
    assert [p["prompt_len"] for p in points] == [16, 32]
    assert all(p["ttft_ms"]["median"] > 0 and p["tpot_ms"]["mean"] > 0 and p["decode_tok_s"] > 0 for p in points)


def test_prompt_longer_than_the_largest_bucket_is_a_user_error(ws):
    proc = ws.qbuild("run", "next-tp1", "--prompt-ids", ",".join(["5"] * 40), "--max-new-tokens", "2")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: the prompt has 40 tokens, more than the largest context-encoding bucket 32 of this bundle; "
        "shorten it or build a recipe with a larger bucket"]


def test_new_weights_rebuild_everything_but_compile(ws, tmp_path):
    from qbuild.model.tinymodel import write_tiny_checkpoint

    other = write_tiny_checkpoint(tmp_path / "seed1", "qwen3_next", seed=1)
    f = ws.recipe("next-seed1", "qwen3_next", "parallel: {tp: 1}\n", checkpoint=other)
    result = json.loads(ws.qbuild("compile", str(f), "--json", check=True).stdout)
    kinds = sorted(n.split()[0] for n in result["built"])
    assert kinds == ["convert", "fetch", "package", "reference", "shard", "verify"]
    assert sorted(n for n in result["cached"] if n.startswith("compile")) == \
        ["compile cte-32 (export)", "compile tkg-64 (export)"]


def test_changing_one_bucket_rebuilds_only_that_graph_and_its_dependents(ws):
    f = ws.recipe("next-tkg48", "qwen3_next", "parallel: {tp: 1}\n",
                  text="text: {seq_len: 64, cte_buckets: [32], tkg_buckets: [48]}")
    result = json.loads(ws.qbuild("compile", str(f), "--json", check=True).stdout)
    assert sorted(result["built"]) == ["compile tkg-48 (export)", "package next-tkg48", "verify next-tkg48"]


def test_unmet_verify_threshold_fails_with_a_per_prompt_report(ws):
    f = ws.recipe("next-strict", "qwen3_next", "parallel: {tp: 1}\n", max_logit_err=1e-12)
    proc = ws.qbuild("compile", str(f))
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: verify next-strict: verify failed: max |logit error|")
    assert "> max_logit_err 1e-12" in last
    assert "[0] 'The capital of France is': top1 1.000, tokens 6/6" in last and "[1] '1, 2, 3, 4, 5,'" in last
    assert "Traceback" not in proc.stderr
    plan = json.loads(ws.qbuild("plan", str(f), "--json", check=True).stdout)
    verify = next(n for n in plan["nodes"] if n["kind"] == "verify")
    assert verify["status"] == "build"  # a failed verify is never cached
    assert not ws.lock()["recipes"]["next-strict"]["verified"]


def test_neuron_backend_fails_naming_the_missing_package(ws, small_checkpoints):
    port = ws.root / "port"
    (port / "src").mkdir(parents=True, exist_ok=True)
    (port / "src" / "modeling_qwen35_moe.py").write_text("raise RuntimeError('a port is never imported here')\n")
    f = ws.root / "recipes" / "next-neuron.yaml"
    f.write_text(f"model: {{path: {small_checkpoints['qwen3_next']}}}\nbackend: neuron\nport: {{path: {port}}}\n"
                 "toolchain: {sdk: \"2.30.0\"}\n"
                 "text: {seq_len: 64, cte_buckets: [32]}\n")
    proc = ws.qbuild("compile", str(f))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: compile ") and "neuronx-distributed-inference" in last


def test_pull_refuses_a_corrupted_blob(ws, tmp_path):
    blob = ws.blob("next-tp1", "package", "graphs/cte-32.json")
    original = blob.read_bytes()
    os.chmod(blob, 0o644)
    try:
        blob.write_bytes(original.replace(b"cte", b"CTE", 1))
        dest = tmp_path / "pulled"
        proc = ws.qbuild("pull", "next-tp1", "--to", str(dest))
        assert proc.returncode == 3
        assert proc.stderr.startswith("error: graphs/cte-32.json: ") and "corrupt" in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
        assert not dest.exists() or not any(dest.iterdir())
    finally:  # the store may have dropped the corrupt blob; put the right bytes back for any later user
        if blob.exists():
            os.chmod(blob, 0o644)
        blob.write_bytes(original)
        os.chmod(blob, 0o444)
