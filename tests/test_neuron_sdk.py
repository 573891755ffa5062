"""The neuron backend against the REAL Neuron SDK and real port checkouts, on a Trainium host (`make neuron-check`).

Skipped where neuronx_distributed_inference does not import, where what imports is the contract double
(tests/nxdi_double), or where QBUILD_TEST_PORTS is unset. QBUILD_TEST_PORTS is a directory of NxDI contrib port
checkouts named as in aws-neuron/neuronx-distributed-inference contrib/models/: Qwen3.5-2B (dense family, main
lineage), Qwen3.5-27B (dense family, main-replicated lineage, PR 128), Qwen3.5-35B-A3B (MoE family, main lineage),
Qwen3-Coder-Next (Qwen3-Next, moe lineage, PR 170); a port that is missing is skipped.

Each tiny family is built with `backend: neuron` (compile, shard, package, and verify on the NeuronCores), pulled,
loaded with the port's own class as vLLM and the ports' scripts do (`App(dir).load(dir)`), and its greedy tokens
compared with transformers' (the reference step's, computed in float32 on the host).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
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
    from qbuild.store import default_store_path
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
