"""The recipe -> NxDI configuration translation, pinned against the public ports' configurations (models.md,
docs/nxdi.md sections 1-3) and the facts read from NxDI's source (docs/nxdi.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dataclasses import replace

from qbuild.steps.registry import STEPS
from qbuild import backends
from qbuild.backends.neuron.backend import text_compile_params, vision_compile_params
from qbuild.backends.neuron.config import modules_to_not_convert, neff_reuse, neuron_config, nxd_degrees, rank_layout
from qbuild.model.ranks import RankLayout
from qbuild.model.fp8 import policy
from qbuild.recipe.params import to_json
from qbuild.recipe.schema import load_recipe
from qbuild.hub.source import load_arch

# What each lineage's get_compiler_args() returns (docs/nxdi.md section 1).
MAIN_ARGS = ("--enable-saturate-infinity --enable-mixed-precision-accumulation --model-type transformer -O1 "
             "--auto-cast=none")
MOE_ARGS = MAIN_ARGS + " --internal-enable-dge-levels vector_dynamic_offsets"
PINS = """toolchain: {sdk: "2.31.0", neuronx_cc: 2.26.6360.0, neuronx_distributed: 0.19.28492,
            neuronx_distributed_inference: 0.10.18399, torch_neuronx: 2.9.0.2}
"""


def _recipe(tmp_path: Path, name: str, body: str):
    f = tmp_path / f"{name}.yaml"
    f.write_text(textwrap.dedent(body) + "backend: neuron\nport: {path: ./port}\n" + PINS)
    loaded = load_recipe(f)
    return loaded, load_arch(loaded)


def _text(tmp_path, name, body) -> dict:
    loaded, arch = _recipe(tmp_path, name, body)
    return neuron_config(text_compile_params(loaded, arch))


def test_35b_a3b_tp8_one_compile_with_every_bucket(tmp_path):
    cfg = _text(tmp_path, "a3b", """
        model: {hf: Qwen/Qwen3.5-35B-A3B}
        parallel: {tp: 8}
        text: {seq_len: 512, cte_buckets: [128, 512]}
    """)
    assert (cfg["lineage"], cfg["module"], cfg["app_class"], cfg["config_class"]) == \
        ("main", "src.modeling_qwen35", "NeuronQwen35ForCausalLM", "Qwen35InferenceConfig")
    assert cfg["neuron_config_class"] == "MoENeuronConfig"
    nc = cfg["neuron_config"]
    # One compile builds both submodels with both explicit lists: NxDI never auto-generates a list here.
    assert nc["enable_bucketing"] is True
    assert nc["context_encoding_buckets"] == [128, 512] and nc["token_generation_buckets"] == [512]
    assert cfg["neffs"] == 3 and cfg["ranks"] == 8
    assert nc["tp_degree"] == 8 and nc["moe_tp_degree"] == 8 and nc["moe_ep_degree"] == 1
    assert "ep_degree" not in nc
    assert nc["batch_size"] == 1 and nc["seq_len"] == 512 and nc["torch_dtype"] == "bfloat16"
    assert nc["max_context_length"] == 512 and nc["logical_nc_config"] == 2
    assert nc["blockwise_matmul_config"] == {"use_shard_on_intermediate_dynamic_while": True, "logical_nc_config": 2}
    # Router settings are attributes set after construction; normalize_top_k_affinities is no constructor field.
    assert cfg["attributes"] == {"router_config.dtype": "float32", "router_config.act_fn": "softmax"}
    assert "normalize_top_k_affinities" not in nc and "router_config" not in nc
    # qbuild writes the shards; load() reads weights/ when save_sharded_checkpoint is set.
    assert nc["save_sharded_checkpoint"] is True and nc["skip_sharding"] is True
    assert "quantized" not in nc
    assert cfg["compiler_args"] == MAIN_ARGS + " --target=trn2 --lnc=2"
    assert cfg["env"] == {"NEURON_PLATFORM_TARGET_OVERRIDE": "trn2", "NEURON_LOGICAL_NC_CONFIG": "2"}


def test_vision_is_one_traced_encoder_per_bucket(tmp_path):
    loaded, arch = _recipe(tmp_path, "vl", """
        model: {hf: Qwen/Qwen3.5-35B-A3B}
        parallel: {tp: 8}
        text: {seq_len: 512, cte_buckets: [512]}
        vision: {buckets: [1024, 4096]}
    """)
    cfg = neuron_config(vision_compile_params(loaded, arch, 4096))
    assert cfg["module"] == "src.modeling_qwen35_vision" and cfg["model_class"] == "CPUVisionModel"
    assert cfg["file"] == "vision_encoder_4096.pt" and cfg["neffs"] == 1
    assert cfg["compiler_args"].startswith("--model-type=transformer --auto-cast=none -O1 "
                                           "--enable-mixed-precision-accumulation")


def test_coder_next_is_the_moe_lineage_with_ep_multiplying_the_ranks(tmp_path):
    cfg = _text(tmp_path, "next", """
        model: {hf: Qwen/Qwen3-Coder-Next}
        parallel: {tp: 8, ep: 4}
        fused_qkv: true
        text: {seq_len: 1024, cte_buckets: [128]}
        moe_backend: shard_on_block
    """)
    assert (cfg["module"], cfg["app_class"], cfg["config_class"]) == \
        ("modeling_qwen35_moe", "NeuronQwen35MoeForCausalLM", "Qwen35MoeInferenceConfig")
    nc = cfg["neuron_config"]
    # Coder-Next's validated EP: ep_degree = moe_ep_degree, moe_tp_degree = tp (world = tp * ep).
    assert nc["tp_degree"] == 8 and nc["ep_degree"] == 4 and nc["moe_ep_degree"] == 4 and nc["moe_tp_degree"] == 8
    assert cfg["ranks"] == 32
    assert nc["fused_qkv"] is True
    assert nc["blockwise_matmul_config"] == {"block_size": 128, "use_shard_on_block_dynamic_while": True,
                                             "block_sharding_strategy": "PING_PONG", "logical_nc_config": 2}
    assert cfg["compiler_args"] == MOE_ARGS + " --target=trn2 --lnc=2"


def test_36_27b_fp8_mlp_only_as_the_fp8_port(tmp_path):
    cfg = _text(tmp_path, "long", """
        model: {hf: Qwen/Qwen3.6-27B}
        parallel: {tp: 4}
        fp8: mlp_only
        text: {seq_len: 131072, cte_buckets: [512], tkg_buckets: [131072]}
        compiler: {target: trn2, flags: ["--internal-hlo2tensorizer-options=--verify-hlo=true"]}
    """)
    nc = cfg["neuron_config"]
    assert cfg["neuron_config_class"] == "NeuronConfig"
    assert nc["quantized"] is True and nc["quantized_checkpoints_path"]
    assert nc["quantization_type"] == "per_channel_symmetric" and nc["quantization_dtype"] == "f8e4m3"
    assert nc["kv_cache_quant"] is False
    assert nc["weights_to_skip_layout_optimization"] == [r".*\.scale$", r".*\.weight_scale$",
                                                         r".*linear_attn\.conv1d_weight\.weight$"]
    keep = set(nc["modules_to_not_convert"])
    # Whole modules, with and without the model. prefix; q_proj-style paths would match nothing in NxD.
    assert {"layers.3.self_attn", "model.layers.3.self_attn", "layers.0.linear_attn", "layers.0.mlp",
            "layers.63.mlp", "lm_head", "embed_tokens", "norm"} <= keep
    assert "layers.1.mlp" not in keep and not any(m.endswith("q_proj") for m in keep)
    assert cfg["env"]["XLA_HANDLE_SPECIAL_SCALAR"] == "1" and cfg["env"]["UNSAFE_FP8FNCAST"] == "1"
    assert cfg["compiler_args"].endswith("--lnc=2 --internal-hlo2tensorizer-options=--verify-hlo=true")
    assert nc["max_context_length"] == 512 and nc["token_generation_buckets"] == [131072]
    assert "moe_tp_degree" not in nc and "blockwise_matmul_config" not in nc


def test_mlp_only_keeps_first_and_last_mlp():
    keep = modules_to_not_convert(policy("mlp_only"), 4)
    assert "layers.0.mlp" in keep and "model.layers.3.mlp" in keep
    assert "layers.1.mlp" not in keep and "layers.2.mlp" not in keep
    assert "layers.1.self_attn" in keep


@pytest.mark.parametrize("backend,expected", [
    ("torch_blockwise", {"use_torch_block_wise": True}),
    ("shard_hidden", {"use_torch_block_wise": False, "use_shard_on_intermediate_dynamic_while": False,
                      "use_shard_on_block_dynamic_while": False}),
])
def test_other_moe_backends(tmp_path, backend, expected):
    cfg = _text(tmp_path, backend, f"""
        model: {{hf: Qwen/Qwen3.5-35B-A3B}}
        moe_backend: {backend}
        parallel: {{tp: 8}}
        text: {{seq_len: 512, cte_buckets: [512]}}
    """)
    assert cfg["neuron_config"]["blockwise_matmul_config"] == {**expected, "logical_nc_config": 2}


def test_parallel_degrees_per_lineage():
    assert rank_layout("main", True, 8, 1) == RankLayout(world=8, dense_tp=8, moe_tp=8, moe_ep=1)
    # Coder-Next's EP: ep_degree = moe_ep_degree = ep multiplies the ranks; moe_tp_degree = tp_degree.
    ep_world = rank_layout("moe", True, 8, 2)
    assert ep_world == RankLayout(world=16, dense_tp=8, moe_tp=8, moe_ep=2)
    assert nxd_degrees(ep_world, True) == {"tp_degree": 8, "ep_degree": 2, "moe_tp_degree": 8, "moe_ep_degree": 2}
    # A dense model names no MoE degree, and NxD's ep_degree only where the world holds expert-parallel copies.
    assert nxd_degrees(rank_layout("main", False, 4, 1), False) == {"tp_degree": 4}


def test_neff_reuse_says_what_adding_a_bucket_costs(tmp_path):
    loaded, arch = _recipe(tmp_path, "a3b", """
        model: {hf: Qwen/Qwen3.5-35B-A3B}
        parallel: {tp: 8}
        text: {seq_len: 512, cte_buckets: [128, 512]}
    """)
    # The locked params are JSON (read back from artifacts.lock); the planned ones are typed.
    now = text_compile_params(loaded, arch)
    base = to_json(now)
    assert neff_reuse(base, replace(now, cte_buckets=(128, 512, 1024))) == \
        "1 new NEFF (cte-1024), 3 reused from the Neuron compile cache"
    # NxD hashes each bucket's work-dir path (_tp0_bk<i>) into its key: an inserted bucket shifts those after it.
    assert neff_reuse(base, replace(now, cte_buckets=(128, 256, 512))) == \
        "2 new NEFFs (cte-256, cte-512), 2 reused from the Neuron compile cache"
    assert neff_reuse(base, replace(now, batch_size=2)) is None
    assert neff_reuse(base, replace(now, compiler=replace(now.compiler, lnc=1))) is None
    assert "all 3 NEFFs recompile" in neff_reuse(base, replace(now, tkg_buckets=(256,)))
    # A lock written by another qbuild, whose params this one does not read: more than the buckets changed.
    assert neff_reuse({k: v for k, v in base.items() if k != "pad_token_id"}, now) is None
    assert neff_reuse({**base, "graph": "vision"}, now) is None


def test_pure_function_imports_without_torch():
    code = ("import sys, qbuild.backends.neuron.config as n, qbuild.planning.plan, qbuild.render; "
            "from qbuild import backends; [backends.get(name) for name in backends.NAMES]; "
            "assert 'torch' not in sys.modules, 'torch imported'; print(n.rank_layout('main', False, 2, 1))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_plan_json_shows_lineage_neffs_and_config(tmp_path):
    from tests.conftest import qbuild

    f = tmp_path / "a3b.yaml"
    f.write_text("model: {hf: Qwen/Qwen3.5-35B-A3B}\nbackend: neuron\nparallel: {tp: 8}\n"
                 "port: {path: ./port, env: {QWEN36_DELTANET_CTE_IMPL: legacy_direct, QWEN36_DELTANET_MULTIHEAD_CTE: "
                 "'0'}}\ntext: {seq_len: 512, cte_buckets: [128, 512]}\nvision: {buckets: [1024]}\n" + PINS)
    proc = qbuild("plan", str(f), "--json", cwd=tmp_path, check=True)
    doc = json.loads(proc.stdout)
    port = doc["recipes"]["a3b"]["port"]
    assert (port["lineage"], port["app_class"], port["found"]) == ("main", "NeuronQwen35ForCausalLM", False)
    compiles = [n for n in doc["nodes"] if n["kind"] == "compile"]
    text = [n for n in compiles if n["params"]["graph"] == "text"]
    vision = [n for n in compiles if n["params"]["graph"] == "vision"]
    assert len(text) == 1 and text[0]["neffs"] == 3 and text[0]["neuron_config"]["neuron_config"]["tp_degree"] == 8
    assert len(vision) == 1 and set(vision[0]["deps"]) == {"port", "converted"}
    verify = next(n for n in doc["nodes"] if n["kind"] == "verify")
    assert verify["resources"] == {"neuron_cores": 8}
    assert all(n["resources"] == {} for n in doc["nodes"] if n["kind"] != "verify")


def _shard_params(tmp_path, name: str, body: str):
    from qbuild.planning.environment import HostEnvironment
    from qbuild.core.hashing import StatCache
    from qbuild.planning.plan import plan_recipe

    # plan_recipe without the recipe checks: qbuild refuses ep > 1 on neuron (NxD raises decoding with EP at batch 1), but
    # the NxD EP layout is planned and sharded exactly, ready for a port that does.
    loaded, arch = _recipe(tmp_path, name, body)
    nodes = {}
    planned = plan_recipe(nodes, loaded, arch, HostEnvironment(StatCache(tmp_path / "stat.db")), backends=backends,
                          steps=STEPS)
    return nodes[planned.nodes["shard"]].params


def test_moe_lineage_ep_shards_nxds_world_with_attention_over_tp_degree(tmp_path, tiny_checkpoints):
    params = _shard_params(tmp_path, "next", f"""
        model: {{path: {tiny_checkpoints["qwen3_next"]}}}
        parallel: {{tp: 2, ep: 2}}
        text: {{seq_len: 128, cte_buckets: [128]}}
    """)
    # NxDI's world is tp_degree * ep_degree = 4 rank files; non-expert layers split over tp_degree 2; experts over
    # moe_ep_degree 2 groups of moe_tp_degree 2.
    assert params.layout == "nxd-moe"
    assert params.ranks == RankLayout(world=4, dense_tp=2, moe_tp=2, moe_ep=2)
    # The shard step runs those params as planned: 4 rank files, attention split over 2.
    from qbuild.model.convert.convert import convert_checkpoint
    from qbuild.planning.step import Context
    from qbuild.steps.shard import Shard

    convert_checkpoint(tiny_checkpoints["qwen3_next"], tmp_path / "conv", dtype="bfloat16")
    (tmp_path / "out").mkdir()
    Shard.run(Context(params, {"converted": tmp_path / "conv"}, tmp_path / "out", tmp_path))
    report = json.loads((tmp_path / "out" / "shard.json").read_text())
    assert report["files"] == [f"tp{r}_sharded_checkpoint.safetensors" for r in range(4)]
    assert report["ranks"]["dense_tp"] == 2


def test_dense_main_lineage_shard_has_no_expert_parallelism(tmp_path, tiny_checkpoints):
    params = _shard_params(tmp_path, "dense", f"""
        model: {{path: {tiny_checkpoints["qwen3_5"]}}}
        parallel: {{tp: 2}}
        text: {{seq_len: 128, cte_buckets: [128]}}
    """)
    assert (params.layout, params.ranks) == ("nxd-main", RankLayout(world=2, dense_tp=2, moe_tp=2, moe_ep=1))


# --- long context: the Qwen3.6-27B port's block KV layout and hybrid APC (docs/long-context.md section 5) ----------

def test_the_128k_recipe_compiles_the_ports_long_context_configuration():
    """recipes/36-27b-fp8-128k.yaml as PR 173's compile script builds it with --enable-hybrid-apc
    --enable-vllm-chunked-prefill (qwen36_27b_compile_fp8.py L952-1010 @ 03db3ef) and its sizes: blocks of 256, one
    sequence of them, a checkpoint every block, 8 slots; the KV length as the prompt limit and the prefix bucket."""
    from tests.conftest import REPO

    loaded = load_recipe(REPO / "recipes" / "36-27b-fp8-128k.yaml")
    params = text_compile_params(loaded, load_arch(loaded))
    cfg = neuron_config(params)
    nc = cfg["neuron_config"]
    # 512 blocks for vLLM (one 131072-token sequence), compiled as 513: vLLM's null block (docs/long-context.md 5.1).
    assert (nc["is_block_kv_layout"], nc["pa_block_size"], nc["pa_num_blocks"]) == (True, 256, 513)
    assert (nc["is_prefix_caching"], nc["prefix_buckets"], nc["prefix_cte_attention_backend"]) == \
        (True, [131072], "attention_cte")
    assert nc["max_context_length"] == 131072 and "chunked_prefill_config" not in nc
    assert cfg["port_config"] == {
        "use_hybrid_cache_manager": False, "use_hybrid_apc_manager": True, "gdn_checkpoint_interval": 256,
        "max_gdn_checkpoint_slots": 8, "gdn_recurrent_cache_dtype": "float32", "gdn_conv_cache_dtype": "bfloat16",
        "hybrid_recurrent_cache_dtype": "float32", "hybrid_conv_cache_dtype": "bfloat16", "hybrid_cache_mode": "all",
        "hybrid_apc_require_vllm_metadata": False, "hybrid_apc_allow_local_hash_fallback": True,
        "hybrid_apc_require_attention_block_refs": False, "hybrid_apc_enable_backed_prefix_reads": False,
        "hybrid_apc_commit_during_token_generation": False, "use_qwen_hybrid_chunked_prefill": True,
        "use_qwen_hybrid_chunked_prefill_nki": True}
    assert cfg["buckets"] == {"context_encoding": [[512, 0], [512, 131072]], "token_generation": [[1, 131072]]}
    assert cfg["neffs"] == 3
    from qbuild.backends.neuron.config import inference_kwargs

    assert inference_kwargs(params).items() >= cfg["port_config"].items()


_LC = """
    model: {hf: Qwen/Qwen3.6-27B}
    parallel: {tp: 4}
    text:
      seq_len: 8192
      cte_buckets: [256, 512]
"""
NEURON_REFUSED = {
    # name: (the text section's extra lines, what the one line must say)
    "block-vllm-refuses": ("  chunked_prefill: {}\n  prefix_cache: {block_size: 512}",
                           "text.prefix_cache.block_size: 512: vLLM 0.16 takes a --block-size of 1, 8, 16, 32, 64, "
                           "128, 256 only"),
    "interval-not-block": ("  chunked_prefill: {}\n  prefix_cache: {block_size: 128, checkpoint_interval: 256}",
                           "text.prefix_cache.checkpoint_interval: 256: the port's hybrid APC manager (v0) needs it "
                           "equal to block_size 128"),
    "default-interval": ("  chunked_prefill: {chunk_size: 128}", "text.chunked_prefill.chunk_size: 128 is not a "
                                                                  "multiple of the DeltaNet checkpoint interval 256"),
    "batch": ("  batch_size: 2\n  chunked_prefill: {}", "text.batch_size: 2: the port's hybrid APC manager"),
    "float16": ("  chunked_prefill: {}\ndtype: float16", "dtype: float16: the port keeps DeltaNet checkpoints in "
                                                         "float32 or bfloat16 only"),
}


@pytest.mark.parametrize("case", sorted(NEURON_REFUSED))
def test_what_the_port_and_vllm_refuse_is_one_line_naming_the_field(tmp_path, case):
    from qbuild.core.errors import UserError
    from qbuild.planning.plan import validate_recipe

    extra, needle = NEURON_REFUSED[case]
    body = textwrap.dedent(_LC.replace("[256, 512]", "[128, 256, 512]" if case == "default-interval" else "[256, 512]"))
    loaded, arch = _recipe(tmp_path, case, body + extra + "\n")
    with pytest.raises(UserError) as err:
        validate_recipe(loaded, arch, backends)
    message = str(err.value)
    assert "\n" not in message and f"{case}.yaml" in message and needle in message, message
    # They are the port's and vLLM's limits: a CPU proof of the same recipe is not refused.
    cpu = tmp_path / "cpu.yaml"
    cpu.write_text(body + extra + "\nbackend: export\n")
    validate_recipe(load_recipe(cpu), arch, backends)


def test_long_context_needs_the_main_lineage(tmp_path):
    from qbuild.core.errors import UserError
    from qbuild.planning.plan import validate_recipe

    loaded, arch = _recipe(tmp_path, "next", """
        model: {hf: Qwen/Qwen3-Coder-Next}
        parallel: {tp: 8}
        fused_qkv: true
        text: {seq_len: 1024, cte_buckets: [256], chunked_prefill: {}}
    """)
    with pytest.raises(UserError, match="text.chunked_prefill: the moe-lineage port has no block KV layout"):
        validate_recipe(loaded, arch, backends)


def test_neff_reuse_counts_the_prefix_caching_pairs(tmp_path):
    loaded, arch = _recipe(tmp_path, "lc", textwrap.dedent(_LC) + "  chunked_prefill: {}\n")
    now = text_compile_params(loaded, arch)
    assert neuron_config(now)["neffs"] == 5
    assert neff_reuse(to_json(now), replace(now, cte_buckets=(256, 512, 1024))) == \
        "2 new NEFFs (cte-1024x0, cte-1024x8192), 5 reused from the Neuron compile cache"


@pytest.mark.parametrize("sdk,refused", [("2.28.1", False), ("2.29.0", True), ("2.31.0", True)])
def test_shard_hidden_is_refused_from_the_release_that_removed_its_kernel(tmp_path, sdk, refused):
    """"The BWMM shard-on-hidden kernel previously used during prefill in Mixture-of-Experts models has been removed"
    (aws-neuron-sdk release-notes/components/nxd-inference.rst L62 @ a3247f5, the 2.29.0 notes)."""
    from qbuild.backends.neuron.backend import NeuronBackend
    from qbuild.core.errors import UserError

    f = tmp_path / "hidden.yaml"
    f.write_text(textwrap.dedent("""
        model: {hf: Qwen/Qwen3.5-35B-A3B}
        moe_backend: shard_hidden
        parallel: {tp: 8}
        text: {seq_len: 512, cte_buckets: [512]}
        backend: neuron
        port: {path: ./port}
    """) + f"toolchain: {{sdk: '{sdk}'}}\n")
    loaded = load_recipe(f)
    if not refused:
        NeuronBackend().validate(loaded, load_arch(loaded))
        return
    with pytest.raises(UserError, match=r"moe_backend: shard_hidden: SDK \S+ has no shard-on-hidden kernel"):
        NeuronBackend().validate(loaded, load_arch(loaded))


# --- expert parallelism: why a neuron recipe refuses it (docs/nxdi.md section 14) --------------------------------

@pytest.mark.parametrize("batch", [1, 64])
def test_ep_is_refused_with_the_reason_that_holds_for_the_batch(tmp_path, batch):
    """Coder-Next decodes 10 of 512 experts per token. At batch 1 (load 0.0195) NxD's token generation takes selective
    loading, which it refuses under EP, and the port's fused TKG path is off; at batch 64 (load 1.25) decode would
    take NxD's all-experts EP path, so the refusal names context encoding under EP, and states no inequality that is
    false."""
    from qbuild.core.errors import UserError
    from qbuild.planning.plan import validate_recipe

    loaded, arch = _recipe(tmp_path, f"ep-{batch}", f"""
        model: {{hf: Qwen/Qwen3-Coder-Next}}
        parallel: {{tp: 8, ep: 2}}
        text: {{batch_size: {batch}, seq_len: 1024, cte_buckets: [128, 512]}}
    """)
    with pytest.raises(UserError) as err:
        validate_recipe(loaded, arch, backends)
    message = str(err.value)
    assert "parallel.ep" in message and "\n" not in message and message.endswith("use ep: 1")
    if batch == 1:
        assert "at batch_size x top_k / experts = 0.0195 < 1 NxD's token generation takes selective loading" in message
        assert "moe_fused_nki_kernel_enabled, which neither qbuild nor the port's scripts set" in message
        assert "multiple of 128" not in message
    else:
        assert "at batch_size x top_k / experts = 1.25 >= 1 NxD decodes with its all-experts EP path" in message
        assert "context encoding under EP" in message and "< 1" not in message
