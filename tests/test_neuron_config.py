"""The recipe -> NxDI NeuronConfig translation, pinned against the configurations of the public ports (models.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from qbuild.arch import load_arch
from qbuild.backends.neuron import (
    DEFAULT_COMPILER_ARGS,
    bundle_neuron_config,
    compiler_args,
    modules_to_not_convert,
    neuron_config,
)
from qbuild.plan import compile_params
from qbuild.recipe import load_recipe

PORT_COMPILER_ARGS = ("--enable-saturate-infinity --enable-mixed-precision-accumulation --model-type transformer "
                      "-O1 --auto-cast=none")


def _recipe(tmp_path: Path, name: str, body: str):
    f = tmp_path / f"{name}.yaml"
    f.write_text(textwrap.dedent(body))
    loaded = load_recipe(f)
    return loaded, load_arch(loaded)


def _configs(tmp_path, name, body) -> dict[str, dict]:
    loaded, arch = _recipe(tmp_path, name, body)
    r = loaded.recipe
    graphs = [("cte", b) for b in r.text.cte_buckets] + [("tkg", b) for b in r.text.token_buckets]
    graphs += [("vision", b) for b in (r.vision.buckets if r.vision else [])]
    return {f"{g}-{b}": neuron_config(compile_params(loaded, arch, g, b)) for g, b in graphs}


def test_35b_a3b_tp8_shard_on_intermediate(tmp_path):
    cfgs = _configs(tmp_path, "a3b", """
        model: {hf: Qwen/Qwen3.5-35B-A3B}
        backend: neuron
        parallel: {tp: 8}
        text: {seq_len: 512, cte_buckets: [512]}
        vision: {buckets: [1024, 4096]}
    """)
    cte = cfgs["cte-512"]
    assert cte["config_class"] == "MoENeuronConfig" and cte["submodel"] == "context_encoding_model"
    nc = cte["neuron_config"]
    assert nc["tp_degree"] == 8 and nc["moe_tp_degree"] == 8 and nc["moe_ep_degree"] == 1
    assert nc["batch_size"] == 1 and nc["seq_len"] == 512 and nc["torch_dtype"] == "bfloat16"
    assert nc["logical_nc_config"] == 2 and nc["context_encoding_buckets"] == [512]
    assert nc["blockwise_matmul_config"] == {"use_shard_on_intermediate_dynamic_while": True}
    assert nc["router_config"] == {"dtype": "float32", "act_fn": "softmax"}
    assert nc["normalize_top_k_affinities"] is True
    assert "quantized" not in nc and cte["env"] == {}
    assert cte["compiler_args"] == PORT_COMPILER_ARGS
    assert cfgs["tkg-512"]["neuron_config"]["token_generation_buckets"] == [512]
    vis = cfgs["vision-4096"]
    assert vis["submodel"] == "vision_encoder" and vis["neuron_config"]["buckets"] == [4096]


def test_coder_next_tp8_ep4_shard_on_block_fused_qkv(tmp_path):
    cfgs = _configs(tmp_path, "next", """
        model: {hf: Qwen/Qwen3-Coder-Next}
        backend: neuron
        parallel: {tp: 8, ep: 4, moe_tp: 2}
        fused_qkv: true
        text: {seq_len: 1024, cte_buckets: [32]}
    """)
    nc = cfgs["cte-32"]["neuron_config"]
    assert nc["tp_degree"] == 8 and nc["moe_ep_degree"] == 4 and nc["moe_tp_degree"] == 2
    assert nc["fused_qkv"] is True
    assert nc["blockwise_matmul_config"] == {"block_size": 128, "use_shard_on_block_dynamic_while": True,
                                             "block_sharding_strategy": "PING_PONG"}
    assert nc["max_context_length"] == 32 and nc["seq_len"] == 1024
    assert cfgs["tkg-1024"]["neuron_config"]["token_generation_buckets"] == [1024]


def test_36_27b_fp8_mlp_only_128k(tmp_path):
    cfgs = _configs(tmp_path, "long", """
        model: {hf: Qwen/Qwen3.6-27B}
        backend: neuron
        parallel: {tp: 4}
        fp8: mlp_only
        text: {seq_len: 131072, cte_buckets: [512]}
        compiler: {target: trn2, flags: ["--internal-hlo2tensorizer-options=--verify-hlo=true"]}
    """)
    cte, tkg = cfgs["cte-512"], cfgs["tkg-131072"]
    nc = cte["neuron_config"]
    assert cte["config_class"] == "NeuronConfig"
    assert nc["tp_degree"] == 4 and nc["logical_nc_config"] == 2 and nc["seq_len"] == 131072
    assert nc["context_encoding_buckets"] == [512] and nc["max_context_length"] == 512
    assert tkg["neuron_config"]["token_generation_buckets"] == [131072]
    assert nc["quantized"] is True and nc["quantization_type"] == "per_channel_symmetric"
    assert nc["quantization_dtype"] == "f8e4m3"
    assert cte["env"] == {"XLA_HANDLE_SPECIAL_SCALAR": "1", "UNSAFE_FP8FNCAST": "1"}
    keep = set(nc["modules_to_not_convert"])
    # mlp_only: the MLPs of layers 1..62 are FP8; the first and last layer's MLP, attention, DeltaNet, lm_head not.
    assert {"lm_head", "layers.0.mlp.gate_proj", "layers.63.mlp.down_proj", "layers.3.self_attn.o_proj",
            "layers.0.linear_attn.in_proj_qkv", "layers.1.linear_attn.in_proj_a"} <= keep
    assert "layers.1.mlp.gate_proj" not in keep and "layers.62.mlp.up_proj" not in keep
    assert cte["compiler_args"] == PORT_COMPILER_ARGS + " --internal-hlo2tensorizer-options=--verify-hlo=true"
    assert "moe_tp_degree" not in nc and "blockwise_matmul_config" not in nc


def test_2b_tp8(tmp_path):
    cfgs = _configs(tmp_path, "small", """
        model: {hf: Qwen/Qwen3.5-2B}
        backend: neuron
        parallel: {tp: 8}
        text: {seq_len: 512, cte_buckets: [128, 512]}
        vision: {buckets: [1024, 4096]}
    """)
    nc = cfgs["cte-128"]["neuron_config"]
    assert nc["tp_degree"] == 8 and nc["seq_len"] == 512 and nc["batch_size"] == 1
    assert nc["max_context_length"] == 512 and nc["context_encoding_buckets"] == [128]
    assert nc["logical_nc_config"] == 2 and nc["fused_qkv"] is False and "quantized" not in nc
    merged = bundle_neuron_config(list(cfgs.values()))
    assert merged["neuron_config"]["context_encoding_buckets"] == [128, 512]
    assert merged["neuron_config"]["token_generation_buckets"] == [512]
    assert merged["vision_buckets"] == [1024, 4096]


@pytest.mark.parametrize("backend,expected", [
    ("torch_blockwise", {"use_torch_block_wise": True}),
    ("shard_hidden", {"use_torch_block_wise": False, "use_shard_on_intermediate_dynamic_while": False,
                      "use_shard_on_block_dynamic_while": False}),
])
def test_other_moe_backends(tmp_path, backend, expected):
    cfgs = _configs(tmp_path, backend, f"""
        model: {{hf: Qwen/Qwen3.5-35B-A3B}}
        backend: neuron
        moe_backend: {backend}
        parallel: {{tp: 8}}
        text: {{seq_len: 512, cte_buckets: [512]}}
    """)
    assert cfgs["cte-512"]["neuron_config"]["blockwise_matmul_config"] == expected


def test_fp8_full_and_fused_qkv_module_names():
    text = {"num_layers": 4, "num_experts": None,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
    full = modules_to_not_convert(text, "full", fused_qkv=True)
    assert "layers.0.linear_attn.in_proj_b" in full and "layers.0.linear_attn.in_proj_qkv" not in full
    assert not any("Wqkv" in m or "mlp." in m for m in full)
    mlp_only = modules_to_not_convert(text, "mlp_only", fused_qkv=True)
    assert "layers.3.self_attn.Wqkv" in mlp_only and "layers.3.self_attn.q_proj" not in mlp_only
    assert compiler_args([]) == " ".join(DEFAULT_COMPILER_ARGS)


def test_pure_function_imports_without_torch():
    code = ("import sys, qbuild.backends.neuron as n; "
            "assert 'torch' not in sys.modules, 'torch imported'; print(n.compiler_args([]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_plan_json_shows_neuron_config(tmp_path):
    from tests.conftest import qbuild

    f = tmp_path / "a3b.yaml"
    f.write_text("model: {hf: Qwen/Qwen3.5-35B-A3B}\nbackend: neuron\nparallel: {tp: 8}\n"
                 "text: {seq_len: 512, cte_buckets: [512]}\n")
    proc = qbuild("plan", str(f), "--json", cwd=tmp_path, check=True)
    nodes = json.loads(proc.stdout)["nodes"]
    compiles = [n for n in nodes if n["kind"] == "compile"]
    assert compiles and all(n["neuron_config"]["neuron_config"]["tp_degree"] == 8 for n in compiles)
    assert all("neuron_config" not in n for n in nodes if n["kind"] != "compile")
