"""The neuron backend against the REAL Neuron SDK and real port checkouts, on a Trainium host (`make neuron-check`).

Skipped where neuronx_distributed_inference does not import, where what imports is the contract double
(tests/nxdi_double), or where QBUILD_TEST_PORTS is unset. QBUILD_TEST_PORTS is a directory of NxDI contrib port
checkouts named as in aws-neuron/neuronx-distributed-inference contrib/models/: Qwen3.5-2B (dense family, main
lineage), Qwen3.5-27B (dense family, main-replicated lineage, PR 128), Qwen3.5-35B-A3B (MoE family, main lineage),
Qwen3-Coder-Next (Qwen3-Next, moe lineage, PR 170), Qwen3.6-27B (main lineage, PR 173: long prompts); a port that is
missing is skipped.

Each tiny family is built with `backend: neuron` (compile, shard, package, and verify on the NeuronCores), pulled,
loaded with the port's own class as vLLM and the ports' scripts do (`App(dir).load(dir)`), and its greedy tokens
compared with transformers' (the reference step's, computed in float32 on the host). A tiny long-context bundle of the
Qwen3.6-27B port is served with vLLM 0.16 and vllm-neuron 0.5 (skipped where they do not import): a prompt of several
chunks against transformers, and the port's experimental hybrid APC repeating a prompt exactly.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import REPO, qbuild

nxdi = pytest.importorskip("neuronx_distributed_inference")
if Path(nxdi.__file__).resolve().is_relative_to(REPO / "tests" / "nxdi_double"):
    pytest.skip("neuronx_distributed_inference is the contract double here, not the Neuron SDK",
                allow_module_level=True)
if not os.environ.get("QBUILD_TEST_PORTS"):
    pytest.skip("QBUILD_TEST_PORTS is unset: it names the directory of NxDI contrib port checkouts",
                allow_module_level=True)

PORTS = Path(os.environ["QBUILD_TEST_PORTS"])
# port directory -> (the tiny family it builds, lineage, recipe fields the port runs with)
PORT_CASES = {
    "Qwen3.5-2B": ("qwen3_5", "main", {}),
    "Qwen3.5-27B": ("qwen3_5", "main-replicated", {}),
    "Qwen3.5-35B-A3B": ("qwen3_5_moe", "main", {}),
    "Qwen3-Coder-Next": ("qwen3_next", "moe", {"fused_qkv": True, "moe_backend": "shard_on_block"}),
}
NEW_TOKENS = 8
# A tiny random model in bfloat16 on the device against float32 transformers: near-ties can flip a later token, so the
# first token must agree and most of the rest.
MIN_TOKEN_MATCH = 0.75
GENERATE = """
import importlib, json, sys
import torch
from neuronx_distributed_inference.utils.hf_adapter import HuggingFaceGenerationAdapter
from transformers import GenerationConfig

bundle, port, module, app_class, prompts, n, pad = sys.argv[1:8]
sys.path.insert(0, port)
app = getattr(importlib.import_module(module), app_class)(bundle)
app.load(bundle)
adapter = HuggingFaceGenerationAdapter(app)
out = []
for ids in json.loads(prompts):
    ids = torch.tensor([ids])
    gc = GenerationConfig(do_sample=False, pad_token_id=int(pad), eos_token_id=None)
    seq = adapter.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=int(n),
                           min_new_tokens=int(n), do_sample=False, generation_config=gc)
    out.append(seq[0, ids.shape[1]:].tolist())
print(json.dumps(out))
"""


def _installed_pins() -> dict[str, str]:
    """The recipe pins the SDK installed here (its public versions: wheels add a local +hash)."""
    dists = ("neuronx-cc", "neuronx-distributed", "neuronx-distributed-inference", "torch-neuronx")
    return {d.replace("-", "_"): importlib.metadata.version(d).split("+")[0] for d in dists}


@pytest.mark.parametrize("port_name", sorted(PORT_CASES))
def test_tiny_family_on_neuron(port_name, tiny_checkpoints, tmp_path):
    family, lineage, fields = PORT_CASES[port_name]
    port = PORTS / port_name
    if not (port / "src").is_dir():
        pytest.skip(f"{port}: no port checkout")
    recipe = tmp_path / f"{family}.yaml"
    recipe.write_text(json.dumps({
        "model": {"path": str(tiny_checkpoints[family])}, "backend": "neuron",
        "port": {"path": str(port), "lineage": lineage}, "parallel": {"tp": 2}, "dtype": "bfloat16",
        "text": {"batch_size": 1, "seq_len": 128, "cte_buckets": [32, 64], "tkg_buckets": [128]},
        "compiler": {"target": "trn2", "lnc": 2}, "toolchain": _installed_pins(),
        "verify": {"top1_min": 0, "token_match_min": 0, "max_logit_err": 1e9, "new_tokens": NEW_TOKENS,
                   "prompts": ["Hello world", "The quick brown fox"], "image_prompt": False}, **fields}))
    env = {"QBUILD_NEURON_WORKDIR": str(tmp_path / "nxd-work")}
    lock = tmp_path / "artifacts.lock"
    qbuild("compile", str(recipe), "--lock", str(lock), env=env, check=True, timeout=7200)
    bundle = tmp_path / "bundle"
    qbuild("pull", family, "--to", str(bundle), "--lock", str(lock), env=env, check=True)

    from qbuild.backends.neuron.ports import LINEAGES
    from qbuild.store.spec import default_store_path
    from qbuild.store.local import LocalStore

    doc = json.loads(lock.read_text())
    reference_dir = tmp_path / "reference"
    LocalStore(default_store_path()).materialize(
        doc["nodes"][doc["recipes"][family]["nodes"]["reference"]]["outputs"], reference_dir)
    reference = json.loads((reference_dir / "reference.json").read_text())["prompts"]
    record = json.loads((bundle / "qbuild-neuron.json").read_text())
    line = LINEAGES[record["config"]["lineage"]]
    proc = subprocess.run(
        [sys.executable, "-c", GENERATE, str(bundle), str(line.module_dir(bundle / "port")), line.text_module,
         line.app_class, json.dumps([r["ids"] for r in reference]), str(NEW_TOKENS),
         str(record["params"]["pad_token_id"] or 0)],
        capture_output=True, text=True, timeout=3600,
        env=dict(os.environ, **record["config"]["env"], PYTHONPATH=os.pathsep.join([str(REPO),
                                                                                 os.environ.get("PYTHONPATH", "")])))
    assert proc.returncode == 0, proc.stderr[-4000:]
    greedy = json.loads(proc.stdout.splitlines()[-1])
    for r, tokens in zip(reference, greedy):
        same = sum(a == b for a, b in zip(tokens, r["greedy"])) / NEW_TOKENS
        assert tokens[0] == r["greedy"][0] and same >= MIN_TOKEN_MATCH, \
            f"{port_name} {r['text']!r}: neuron {tokens}, transformers {r['greedy']}"


# --- long prompts: chunked prefill and the port's hybrid APC through vLLM (docs/long-context.md section 5) ---------
# The Qwen3.6-27B port (QBUILD_TEST_PORTS/Qwen3.6-27B, NxDI PR 173 @ 03db3ef) compiles the block KV layout and serves it
# through vLLM's chunked prefill with its own patch, so these run `qbuild serve` with vLLM 0.16 and vllm-neuron 0.5.
# Prompts are token ids and completions return token ids (vLLM's return_token_ids: entrypoints/openai/completion/
# protocol.py L142-150, L434 @ 0.16.0), and --enable-prompt-tokens-details reports the prefix cache's tokens
# (cli_args.py L184, completion/serving.py L471-473).
LONG_TEXT = {"batch_size": 1, "seq_len": 512, "cte_buckets": [64, 128], "tkg_buckets": [512],
             "chunked_prefill": {"chunk_size": 128}, "prefix_cache": {"block_size": 64, "checkpoint_slots": 4}}
# A prompt of several chunks, whose transformers greedy tokens the bundle must give.
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 24


def _serve_skip() -> str | None:
    import importlib.util

    for module in ("vllm", "vllm_neuron"):
        if importlib.util.find_spec(module) is None:
            return f"{module} does not import here"
    if not (PORTS / "Qwen3.6-27B" / "vllm").is_dir():
        return f"{PORTS / 'Qwen3.6-27B'}: no checkout of the Qwen3.6-27B port"
    return None


def _long_context_bundle(checkpoint: Path, tmp_path: Path, apc: str) -> tuple[Path, list[int], list[int]]:
    """A tiny Qwen3.5 long-context bundle built with the Qwen3.6-27B port (no verify: NxDI's generation adapter passes
    no block table) and pulled; (bundle, the prompt's ids, transformers' greedy ids for it)."""
    recipe = tmp_path / "lc.yaml"
    recipe.write_text(json.dumps({
        "model": {"path": str(checkpoint)}, "backend": "neuron",
        "port": {"path": str(PORTS / "Qwen3.6-27B"), "lineage": "main"}, "parallel": {"tp": 2}, "dtype": "bfloat16",
        "text": {**LONG_TEXT, "prefix_cache": {**LONG_TEXT["prefix_cache"], "neuron_apc": apc}},
        "compiler": {"target": "trn2", "lnc": 2}, "toolchain": _installed_pins(),
        "verify": {"prompts": ["Hello world"], "new_tokens": NEW_TOKENS, "image_prompt": False}}))
    env = {"QBUILD_NEURON_WORKDIR": str(tmp_path / "nxd-work"), "QBUILD_STORE": str(tmp_path / "store")}
    lock = ["--lock", str(tmp_path / "artifacts.lock")]
    built = qbuild("compile", str(recipe), "--skip-device", *lock, env=env, timeout=7200)
    assert built.returncode == 0, built.stderr[-4000:]
    bundle = tmp_path / "bundle"
    assert qbuild("pull", "lc", "--to", str(bundle), "--allow-unverified", *lock, env=env).returncode == 0
    ids, greedy = _reference(checkpoint, LONG_PROMPT)
    assert len(ids) > max(LONG_TEXT["cte_buckets"]), "the prompt must take several chunks"
    return bundle, ids, greedy


def _reference(checkpoint: Path, text: str) -> tuple[list[int], list[int]]:
    """(the prompt's ids, transformers' greedy tokens) as the reference step computes them, in float32 on the host
    (--skip-device leaves the reference step unbuilt: only verify needs it)."""
    from transformers import AutoTokenizer

    from qbuild.steps.reference import _greedy, _model

    config = json.loads((checkpoint / "config.json").read_text())
    ids = list(AutoTokenizer.from_pretrained(str(checkpoint))(text, add_special_tokens=False)["input_ids"])
    _, tokens = _greedy(_model(checkpoint, config), ids, NEW_TOKENS, {}, None)
    return ids, tokens


def _complete(url: str, ids: list[int]) -> dict:
    import urllib.request

    body = {"model": "bundle", "prompt": ids, "max_tokens": NEW_TOKENS, "min_tokens": NEW_TOKENS, "temperature": 0,
            "return_token_ids": True}
    request = urllib.request.Request(url + "/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as r:
        return json.loads(r.read())


def _two_free_ports() -> int:
    """A port P such that P and P + 1 are free now (behind the chat proxy, vLLM takes the port after the public one)."""
    import socket

    for _ in range(100):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port < 65535:
                with socket.socket() as b:
                    try:
                        b.bind(("127.0.0.1", port + 1))
                        return port
                    except OSError:
                        continue
    raise AssertionError("no two consecutive free ports")


@contextmanager
def _serving(bundle: Path, tmp_path: Path):
    """`qbuild serve` of the bundle as a user starts it (the vLLM flag for cached-token counts after --): (the public
    URL, vLLM's own URL behind the port's chat proxy). The tests send token ids as raw completions to vLLM itself: the
    tiny checkpoint has no chat template, and the proxy refuses raw completions (checked here)."""
    import signal
    import urllib.error

    from tests.conftest import wait_until

    ready, port = tmp_path / "url", _two_free_ports()
    server = subprocess.Popen([str(Path(sys.executable).with_name("qbuild")), "serve", str(bundle), "--port",
                               str(port), "--ready-file", str(ready), "--", "--enable-prompt-tokens-details"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        public = wait_until(lambda: ready.exists() and ready.read_text().strip(), 1800, "vLLM to answer /v1/models")
        with pytest.raises(urllib.error.HTTPError) as refused:
            _complete(public, [1, 2, 3])
        assert refused.value.code == 400
        yield f"http://127.0.0.1:{port + 1}/v1"
    finally:
        server.send_signal(signal.SIGINT)
        _, err = server.communicate(timeout=300)
    assert server.returncode == 0, err[-4000:]


@pytest.mark.skipif(_serve_skip() is not None, reason=str(_serve_skip()))
def test_a_prompt_of_several_chunks_gives_transformers_tokens(tiny_checkpoints, tmp_path):
    """A prompt over the largest CTE bucket, prefilled by vLLM in chunks of 128 through the compiled block KV layout
    (prefix caching off), generates transformers' greedy tokens: the first one exactly, most of the rest."""
    bundle, ids, greedy = _long_context_bundle(tiny_checkpoints["qwen3_5"], tmp_path, "off")
    serve = json.loads((bundle / "vllm" / "serve.json").read_text())
    assert serve["long_context"]["prefix_caching"] is False and serve["max_prompt_length"] == 512
    with _serving(bundle, tmp_path) as url:
        tokens = _complete(url, ids)["choices"][0]["token_ids"]
    same = sum(a == b for a, b in zip(tokens, greedy)) / NEW_TOKENS
    assert tokens[0] == greedy[0] and same >= MIN_TOKEN_MATCH, f"neuron {tokens}, transformers {greedy}"


@pytest.mark.skipif(_serve_skip() is not None, reason=str(_serve_skip()))
def test_the_ports_hybrid_apc_repeats_a_prompt_exactly_from_its_cache(tiny_checkpoints, tmp_path):
    """neuron_apc: experimental: the same long prompt twice gives the same tokens, the second time from the prefix
    cache (vLLM counts cached prompt tokens), as the port validated its hybrid APC exactness (README.md L121-126)."""
    bundle, ids, greedy = _long_context_bundle(tiny_checkpoints["qwen3_5"], tmp_path, "experimental")
    assert json.loads((bundle / "vllm" / "serve.json").read_text())["long_context"]["prefix_caching"] is True
    with _serving(bundle, tmp_path) as url:
        cold, warm = _complete(url, ids), _complete(url, ids)
    assert warm["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]
    assert cold["choices"][0]["token_ids"][0] == greedy[0]
    cached = (warm["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert cached >= LONG_TEXT["prefix_cache"]["block_size"], warm["usage"]
