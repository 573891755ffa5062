"""Long prompts on neuron, built and served as the Qwen3.6-27B port does (docs/long-context.md section 5), against the
NxDI and vLLM / vllm-neuron contract doubles (tests/nxdi_double).

One tiny Qwen3.5 on the main lineage with chunked prefill and the prefix cache is built once (module fixture): the
compile must be the port's hybrid APC one (block KV layout, prefix-caching CTE graphs, the APC manager), the shards
must carry the zero DeltaNet checkpoint banks that model takes, and `qbuild serve` must start vLLM's chunked-prefill
scheduler with the port's patch and the compiled layout. Each fact has a negative: one value changed, and the double
refuses it as NxDI, the port, vLLM or vllm-neuron would.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.nxdi_double import MAIN_PORT, VLLM_SITE, metadata_overlay, nxdi_tree, pr173_port, read_log
from tests.test_neuron_double import Build, load_bundles, require_bundle, sdk, write_recipe  # noqa: F401 (a fixture)
from tests.test_neuron_serve import Served, _bundle, _double_env, _post, _run_printed, _unchanged, dry_run, flag

pytestmark = pytest.mark.xdist_group("neuron-long-context")

# KV length 256 in blocks of 32 with a checkpoint every block, prefilled in chunks of the larger CTE bucket (64).
TEXT = {"batch_size": 1, "seq_len": 256, "cte_buckets": [32, 64], "tkg_buckets": [256],
        "chunked_prefill": {"chunk_size": 64},
        "prefix_cache": {"block_size": 32, "checkpoint_slots": 2, "neuron_apc": "experimental"}}
BANK = "hybrid_gdn_checkpoint_cache"


@pytest.fixture(scope="module")
def lc(tmp_path_factory, small_checkpoints) -> tuple[Build, Path]:
    """The tiny Qwen3.5 (one DeltaNet and one attention layer, tp 2) with chunked prefill and the experimental APC,
    built with the double and pulled into root/bundle."""
    return _bundle(tmp_path_factory.mktemp("neuron-long-context"), small_checkpoints["qwen3_5"], MAIN_PORT, text=TEXT)


def _copy(bundle: Path, dest: Path) -> Path:
    """A copy of the bundle whose files can be changed (the pulled ones are hardlinks into the store)."""
    shutil.copytree(bundle, dest, copy_function=shutil.copy2)
    return dest


@pytest.mark.slow
def test_the_compile_is_the_ports_hybrid_apc_build(lc):
    """What reached NxDI: the compile script's --enable-hybrid-apc --enable-vllm-chunked-prefill configuration
    (qwen36_27b_compile_fp8.py L952-1010 @ 03db3ef) with the recipe's sizes, the KV length as the prompt limit and the
    prefix bucket, and one context-encoding graph per (active, prefix) pair."""
    build, _ = lc
    (call,) = build.calls("compile")
    nc = call["config"]["neuron_config"]
    # 8 blocks for vLLM (one 256-token sequence of 32-token blocks), compiled as 9: vLLM's null block takes one of its
    # num_gpu_blocks, and NxDI's cache adds its padding sink after the compiled count.
    assert (nc["is_block_kv_layout"], nc["is_prefix_caching"], nc["pa_block_size"], nc["pa_num_blocks"]) == \
        (True, True, 32, 9)
    assert nc["prefix_buckets"] == [256] and nc["max_context_length"] == 256 and nc["chunked_prefill_config"] is None
    port = call["config"]
    assert (port["use_hybrid_apc_manager"], port["use_hybrid_cache_manager"]) == (True, False)
    assert (port["gdn_checkpoint_interval"], port["max_gdn_checkpoint_slots"]) == (32, 2)
    assert port["use_qwen_hybrid_chunked_prefill"] is True and port["hybrid_recurrent_cache_dtype"] == "float32"
    cte, tkg = call["submodels"]
    assert cte["buckets"] == [[32, 0], [32, 256], [64, 0], [64, 256]] and tkg["buckets"] == [[1, 256]]
    assert len(call["neffs"]) == 5


@pytest.mark.slow
def test_the_shards_carry_the_checkpoint_banks_the_model_takes(lc, tmp_path):
    """Zero banks of 2 slots per DeltaNet layer, recurrent (slots, Hv/tp, dk, dv) in float32 and conv
    (slots, conv_dim/tp, K - 1) in the model dtype (HybridGDNCheckpointCache, modeling_qwen35.py L4075-4140); the
    bundle loads. A shard without one of them is refused naming it."""
    from safetensors.torch import load_file, save_file

    build, bundle = lc
    config = json.loads((build.checkpoint / "config.json").read_text())["text_config"]
    hk, hv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    tensors = load_file(bundle / "weights" / "tp1_sharded_checkpoint.safetensors")
    recurrent, conv = tensors[f"{BANK}.recurrent_slots.0"], tensors[f"{BANK}.conv_slots.0"]
    assert recurrent.shape == (2, hv // 2, dk, dv) and str(recurrent.dtype) == "torch.float32"
    assert conv.shape == (2, (2 * hk * dk + hv * dv) // 2, config["linear_conv_kernel_dim"] - 1)
    assert str(conv.dtype) == "torch.bfloat16" and not recurrent.any() and not conv.any()
    assert sorted(n for n in tensors if n.startswith(BANK)) == [f"{BANK}.conv_slots.0", f"{BANK}.recurrent_slots.0"]

    damaged = _copy(bundle, tmp_path / "damaged")
    shard = damaged / "weights" / "tp1_sharded_checkpoint.safetensors"
    kept = load_file(shard)
    del kept[f"{BANK}.conv_slots.0"]
    save_file(kept, shard)
    ok, refused = load_bundles(build, bundle, damaged, log=tmp_path / "load.jsonl")
    assert ok == "ok"
    assert f"{BANK}.conv_slots.0: the compiled model takes it" in refused and "tp1_sharded_checkpoint" in refused


@pytest.mark.slow
def test_serve_json_and_the_command_follow_the_ports_launcher(lc):
    """vllm/serve.json and the dry run: the compiled KV length as both limits, the blocks and block size, vLLM's own
    chunked-prefill scheduler with the chunk as its token budget, prefix caching with the launcher's mamba settings
    (start_vllm_server.sh L135-199, L580-695 @ 03db3ef), and the port's patch named for the plugin."""
    build, bundle = lc
    serve = json.loads((bundle / "vllm" / "serve.json").read_text())
    assert serve["long_context"] == {"chunk_size": 64, "block_size": 32, "num_blocks": 8, "checkpoint_interval": 32,
                                     "checkpoint_slots": 2, "prefix_buckets": [256], "prefix_caching": True}
    assert (serve["max_prompt_length"], serve["max_model_len"]) == (256, 256)
    spec = json.loads((bundle / "vllm" / "qbuild_vllm_plugin.json").read_text())
    assert spec["serving_patch"] == {"file": "../port/vllm/qwen36_hybrid_apc_scheduler_patch.py",
                                     "install": "install_import_hook"}
    doc = dry_run(build, str(bundle))
    command = doc["command"]
    assert (flag(command, "--block-size"), flag(command, "--num-gpu-blocks-override")) == ("32", "8")
    assert flag(command, "--max-num-batched-tokens") == "64" and flag(command, "--max-model-len") == "256"
    assert flag(command, "--generation-config") == "vllm"
    assert {"--enable-chunked-prefill", "--enable-prefix-caching"} <= set(command)
    assert not {"--no-enable-chunked-prefill", "--no-enable-prefix-caching"} & set(command)
    assert (flag(command, "--mamba-cache-mode"), flag(command, "--mamba-ssm-cache-dtype")) == ("all", "float32")
    extra = json.loads(flag(command, "--additional-config"))
    assert extra["max_prompt_length"] == 256 and extra["use_hybrid_apc_manager"] is True
    assert extra["override_neuron_config"]["chunked_prefill_config"]["max_num_seqs"] == 1
    assert extra["override_neuron_config"]["pa_num_blocks"] == 8
    assert doc["env"]["DISABLE_NEURON_CUSTOM_SCHEDULER"] == "1"
    # The port's guarded chat front on the public address, vLLM behind it on loopback (vllm/README.md L182-214).
    assert serve["chat_proxy"] == "port/vllm/qwen36_chat_proxy.py"
    assert (flag(command, "--host"), flag(command, "--port")) == ("127.0.0.1", "8001")
    proxy = doc["proxy"]["command"]
    assert proxy[1] == str(bundle / "port" / "vllm" / "qwen36_chat_proxy.py")
    assert (flag(proxy, "--host"), flag(proxy, "--port"), flag(proxy, "--backend-url")) == \
        ("127.0.0.1", "8000", "http://127.0.0.1:8001")
    assert doc["url"] == "http://127.0.0.1:8000/v1"
    for owned in (["--block-size", "16"], ["--no-enable-chunked-prefill"], ["--max-num-batched-tokens=32"]):
        proc = build.cli("serve", str(bundle), "--dry-run", "--", *owned)
        assert proc.returncode == 2 and "set by qbuild from the bundle" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_serve_runs_chunked_prefill_and_prefix_caching_through_vllm_neuron(lc, tmp_path):
    """`qbuild serve` against the doubles: vLLM on loopback behind the port's chat proxy, both vLLM processes install
    the port's patch, the engine core runs vLLM's scheduler with chunked prefill and prefix caching over the 8 blocks
    vLLM addresses (plus its null block), with KV blocks for the attention layer only; the proxy refuses a raw
    completion and sends chats with thinking off; a chat prompt past the CTE buckets is taken (the double answers 501
    as it does not generate), one past the KV length is a 400; the bundle is unchanged."""
    build, bundle = lc
    served = Served(build, str(bundle), tmp_path)
    try:
        url = served.url()
        assert url, served.stop()[1]
        status, raw = _post(url + "/completions", {"model": "bundle", "prompt": "hello world"})
        assert status == 400 and raw["error"]["code"] == "qwen36_chat_required"
        chat = {"model": "bundle", "messages": [{"role": "user", "content": "hello world " * 50}],
                "chat_template_kwargs": {"enable_thinking": True}}
        assert _post(url + "/chat/completions", chat)[0] == 501
        chat["messages"][0]["content"] = "hello world " * 200
        status, long = _post(url + "/chat/completions", chat)
        assert status == 400 and "maximum prompt length is 256 tokens" in long["error"]["message"]
    finally:
        code, err = served.stop()
    assert code == 0, err
    (engine,) = served.calls("vllm_engine_core")
    assert (engine["chunked_prefill"], engine["prefix_caching"], engine["max_num_batched_tokens"]) == (True, True, 64)
    assert (engine["block_size"], engine["num_gpu_blocks"], engine["max_prompt_length"]) == (32, 9, 256)
    assert engine["block_owners"] == {"0": "vLLM's null block", "9": "NxDI's padding sink"}
    assert engine["cache_blocks"] == 10 and engine["generation_config"] == "vllm"
    # The port's scheduler patch lets vLLM read its prefix cache only for an artifact that supports backed reads:
    # without them every request would be prefilled in full, cached prefix or not.
    assert [c["possible"] for c in served.calls("hybrid_apc_prefix_reads")] == [True]
    layer_types = json.loads((bundle / "config.json").read_text())["layer_types"]
    assert engine["kv_cache_layers"] == [f"layers.{i}.self_attn" for i, kind in enumerate(layer_types)
                                         if kind == "full_attention"]
    assert {c["pid"] for c in served.calls("serving_patch_installed")} >= {engine["pid"]}
    assert len(served.calls("serving_patch_installed")) == 2
    assert [c["chat_template_kwargs"] for c in served.calls("vllm_chat_request")] == [{"enable_thinking": False}] * 2
    _unchanged(bundle)


# --- what the doubles learned from the bundle that served wrongly: the null block and the padding sink, the runtime
# flag that counts a call's inputs -----------------------------------------------------------------------------------

def _with_compiled(bundle: Path, dest: Path, **neuron_config) -> Path:
    """A copy of `bundle` whose NxDI neuron_config.json says `neuron_config` (what another compile would have built)."""
    copy = _copy(bundle, dest)
    path = copy / "neuron_config.json"
    saved = json.loads(path.read_text())
    saved["neuron_config"].update(neuron_config)
    path.write_text(json.dumps(saved))
    return copy


@pytest.mark.slow
def test_vllms_blocks_and_nxdis_padding_sink_never_share_a_block(lc, tmp_path):
    """vLLM hands out blocks 1..8 of its 9 (block 0 is its null block), and NxDI's prefix-caching cache writes every
    padded slot into its last block: the bundle compiles 9 blocks, a cache of 10, so that sink is block 9. A model
    compiled with the 8 vLLM is told (pa_num_blocks equal to --num-gpu-blocks-override, as the port's comments call
    them "identical") has its sink on block 8, which a sequence owns too: the double's block table refuses it."""
    build, bundle = lc
    served = Served(build, str(bundle), tmp_path)
    try:
        assert served.url(), served.stop()[1]
    finally:
        code, err = served.stop()
    assert code == 0, err
    (engine,) = served.calls("vllm_engine_core")
    assert engine["cache_blocks"] == 10 and engine["num_gpu_blocks"] == 9
    assert engine["block_owners"] == {"0": "vLLM's null block", "9": "NxDI's padding sink"}

    doc = dry_run(build, str(_with_compiled(bundle, tmp_path / "n-blocks", pa_num_blocks=8)))
    proc = _run_printed(build, doc, tmp_path / "run.jsonl")
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "block 8 of the compiled KV cache has two owners: vLLM's block 8 and NxDI's padding sink" in proc.stderr


def _vllm_url(doc: dict) -> str:
    """Where the printed vLLM command listens (behind the chat proxy: loopback, the port after the public one)."""
    return f"http://{flag(doc['command'], '--host')}:{flag(doc['command'], '--port')}/v1"


def _serve_printed(build: Build, doc: dict, log: Path) -> subprocess.Popen:
    """The vLLM command `qbuild serve --dry-run` printed, started as printed; answered once it listens."""
    proc = subprocess.Popen(doc["command"], env=_double_env(build, doc, log), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=build.root, start_new_session=True)

    def up() -> bool:
        if proc.poll() is not None:
            return True
        try:
            return _get(_vllm_url(doc) + "/models") == 200
        except (OSError, http.client.HTTPException):   # not listening yet (a poll may even connect to itself)
            return False

    try:
        wait_until(up, 240, "the printed vLLM command to answer or exit")
    except AssertionError:   # a server that neither answers nor exits is not left behind, nor its engine process
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"the printed vLLM command did not answer in 240 s:\n{proc.communicate()[1][-3000:]}")
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    return proc


def _get(url: str) -> int:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status


def _stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGINT)
    return proc.communicate(timeout=120)[1]


@pytest.mark.slow
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_the_first_request_calls_the_graphs_with_the_inputs_they_were_traced_with(lc, tmp_path, prefix_caching):
    """Every long-context compile traces the hybrid APC graphs (29 inputs); the port's patch sets vLLM's runtime
    use_hybrid_apc_manager on the model around each step, and the model counts a call's inputs from it. qbuild sends
    it true whether or not vLLM caches prefixes, so the first request runs (the double answers 501: it does not
    generate); the same command with it false fails that request as the traced graph would."""
    build, bundle = lc
    copy = bundle if prefix_caching else _with_serve(bundle, tmp_path / "no-apc", prefix_caching=False)
    port = _free_port()
    doc = dry_run(build, str(copy), "--port", str(port))
    extra = json.loads(flag(doc["command"], "--additional-config"))
    assert extra["use_hybrid_apc_manager"] is True
    assert extra["hybrid_apc_require_vllm_metadata"] is prefix_caching
    assert ("--enable-prefix-caching" in doc["command"]) is prefix_caching
    proc = _serve_printed(build, doc, tmp_path / "ok.jsonl")
    try:
        status, _ = _post(_vllm_url(doc) + "/completions", {"model": "bundle", "prompt": "hello world " * 50})
    finally:
        err = _stop(proc)
    assert status == 501, err[-3000:]

    doc["command"] = _with(doc["command"], "--additional-config", json.dumps({**extra, "use_hybrid_apc_manager": False}))
    proc = _serve_printed(build, doc, tmp_path / "off.jsonl")
    try:
        status, answer = _post(_vllm_url(doc) + "/completions", {"model": "bundle", "prompt": "hello world " * 50})
    finally:
        _stop(proc)
    assert status == 500, answer
    assert "a call of 24 tensors (use_hybrid_apc_manager=False now) to a graph traced with 29 inputs" in \
        answer["error"]["message"]


def _with_serve(bundle: Path, dest: Path, **long_context) -> Path:
    """A copy of `bundle` whose vllm/serve.json records `long_context` changes, its manifest rewritten to match."""
    from qbuild.model.bundle import read_manifest, write_manifest

    copy = _copy(bundle, dest)
    path = copy / "vllm" / "serve.json"
    serve = json.loads(path.read_text())
    path.write_text(json.dumps({**serve, "long_context": {**serve["long_context"], **long_context}}))
    write_manifest(copy, {k: v for k, v in read_manifest(bundle).items() if k not in ("files", "format")})
    return copy


def _free_port() -> int:
    """A port as qbuild picks one for --port 0: below the ephemeral range, so that polling it before the server listens
    cannot connect to itself (server_process.free_ports)."""
    from qbuild.backends.neuron.server_process import free_ports

    return free_ports("127.0.0.1", 1)[0]


# --- the NxDI tree the port imports from -----------------------------------------------------------------------

ASYNC = "neuronx_distributed_inference.modules.async_execution"


@pytest.fixture(scope="module")
def lc_tree(tmp_path_factory, small_checkpoints) -> tuple[Build, Path, Path]:
    """The long-context bundle of a PR 173-like port (it imports NxDI's modules/async_execution.py, which the double's
    NxDI lacks) from a recipe that installs NxDI from that tree, built on a host whose NxDI is the tree."""
    root = tmp_path_factory.mktemp("neuron-nxdi-tree")
    tree, port = nxdi_tree(root / "nxdi"), pr173_port(root / "port")
    versions = metadata_overlay(root / "versions", {"neuronx-distributed-inference": "0.9.0+03db3ef2.dev"})
    build = Build(root)
    toolchain = {"sdk": "2.31.0", "neuronx_distributed_inference": "0.9.0",
                 "from_source": ["neuronx_distributed_inference"]}
    build.recipe = write_recipe(root / "recipes" / "serve.yaml", small_checkpoints["qwen3_5"], port, text=TEXT,
                                toolchain=toolchain)
    build.result, build.stderr = build.compile(build.recipe, overlay=(tree / "src", versions))
    require_bundle(build.result, build.stderr)
    pulled = build.cli("pull", "serve", "--to", str(root / "bundle"), "--allow-unverified")
    assert pulled.returncode == 0, pulled.stderr
    return build, root / "bundle", tree


@pytest.mark.slow
def test_the_bundle_records_the_nxdi_tree_and_serve_puts_it_on_the_path(lc_tree, tmp_path):
    """vllm/serve.json names the tree and what the port imports from it; `qbuild serve` refuses, in one line and
    before vLLM starts (exit 3), a host whose NxDI lacks it, takes --nxdi-tree only where it is that tree (exit 2
    otherwise), and puts the tree's src/ after the port on PYTHONPATH as the port's launcher does, where vLLM's
    engine then imports the port."""
    build, bundle, tree = lc_tree
    record = json.loads((bundle / "vllm" / "serve.json").read_text())["nxdi_tree"]
    assert record["imports"][ASYNC] == ["cancel_hybrid_apc_request", "finish_hybrid_apc_request",
                                        "prepare_hybrid_apc_model_inputs", "prepare_hybrid_apc_request_for_execution"]
    assert (record["version"], record["src"], record["git"]) == ("0.9.0", "src", None)

    proc = build.cli("serve", str(bundle), "--port", "0", overlay=(VLLM_SITE,), log=tmp_path / "none.jsonl")
    line = proc.stderr.strip()
    assert proc.returncode == 3 and "\n" not in line, proc.stderr
    assert f"has no {ASYNC}, which the bundle's port imports" in line and "--nxdi-tree" in line
    assert not read_log(tmp_path / "none.jsonl")

    stock = nxdi_tree(tmp_path / "stock")
    (stock / "src" / "neuronx_distributed_inference" / "modules" / "async_execution.py").unlink()
    for wrong, words in ((stock, f"it lacks {ASYNC}"), (tmp_path / "empty", "it lacks")):
        proc = build.cli("serve", str(bundle), "--dry-run", "--nxdi-tree", str(wrong))
        assert proc.returncode == 2 and "not the NxDI tree this bundle's port imports from" in proc.stderr, proc.stderr
        assert words in proc.stderr

    doc = dry_run(build, str(bundle), "--nxdi-tree", str(tree))
    assert doc["env"]["PYTHONPATH"].split(os.pathsep) == [str(bundle / "vllm"), str(bundle / "port"),
                                                          str((tree / "src").resolve())]
    served = Served(build, str(bundle), tmp_path, "--nxdi-tree", str(tree))
    try:
        assert served.url(), served.stop()[1]
    finally:
        code, err = served.stop()
    assert code == 0, err
    (engine,) = served.calls("vllm_engine_core")
    assert engine["app_cls"].endswith("NeuronQwen35ForCausalLM")


def test_an_nxdi_tree_checked_out_at_another_commit_is_refused(tmp_path):
    """The names the port imports and the version are not enough: PR 173 changes NxDI files beyond them (its block
    KV cache manager, its model wrapper), and another tree of version 0.9.0 can hold those names. A git checkout must
    be at the recorded commit."""
    from qbuild.core.errors import UserError
    from qbuild.backends.neuron.vllm_serve import nxdi_tree_src

    rev = "03db3ef214ebf8fa8e93e6cee8d5b6fe1618dae8"
    tree = nxdi_tree(tmp_path / "tree")
    imports = {ASYNC: ["cancel_hybrid_apc_request"]}
    serve = {"nxdi_tree": {"git": "https://github.com/aws-neuron/neuronx-distributed-inference.git", "rev": rev,
                           "src": "src", "version": "0.9.0", "imports": imports}}
    assert nxdi_tree_src(serve, tree) == (tree / "src").resolve()    # not a git checkout: names and version only
    (tree / ".git" / "refs" / "heads").mkdir(parents=True)
    (tree / ".git" / "HEAD").write_text("ref: refs/heads/pr173\n")
    (tree / ".git" / "refs" / "heads" / "pr173").write_text(rev + "\n")
    assert nxdi_tree_src(serve, tree) == (tree / "src").resolve()
    other = "ef2731ef8c5764953d23f95f0a8b736bcc5bc8d4"
    (tree / ".git" / "refs" / "heads" / "pr173").unlink()
    (tree / ".git" / "packed-refs").write_text(f"# pack-refs with: peeled\n{other} refs/heads/pr173\n")
    with pytest.raises(UserError, match=f"not the NxDI tree this bundle's port imports from .*checked out at {other}"):
        nxdi_tree_src(serve, tree)
    (tree / ".git" / "HEAD").write_text(other + "\n")     # a detached HEAD
    with pytest.raises(UserError, match=f"checked out at {other}"):
        nxdi_tree_src(serve, tree)


@pytest.mark.parametrize("host,port,words", [("::", 8000, "--host ::: this bundle is served behind the port's chat "
                                                            "proxy, which listens on IPv4 only"),
                                             ("::1", 8000, "listens on IPv4 only"),
                                             ("0.0.0.0", 65535, "--port 65535: this bundle's vLLM listens on the "
                                                                "port after the public one")])
def test_an_address_the_chat_proxy_cannot_take_is_refused_before_anything_starts(lc, tmp_path, host, port, words):
    build, bundle = lc
    proc = build.cli("serve", str(bundle), "--host", host, "--port", str(port), "--dry-run")
    assert proc.returncode == 2 and words in proc.stderr and "\n" not in proc.stderr.strip(), proc.stderr


def test_the_ports_chosen_for_the_proxy_and_vllm_differ():
    from qbuild.backends.neuron.vllm_serve import free_ports

    for _ in range(20):
        public, backend = free_ports("127.0.0.1", 2)
        assert public != backend


# --- what vLLM and vllm-neuron refuse: one value of the printed command changed ---------------------------------

def _with(command: list[str], name: str, value: str | None) -> list[str]:
    """`command` with flag `name` set to `value` (dropped where None)."""
    i = command.index(name)
    return command[:i] + ([name, value] if value is not None else []) + command[i + 2:]


@pytest.mark.slow
@pytest.mark.parametrize("name,value,refusal", [
    ("--block-size", "512", "argument --block-size: invalid choice: 512"),
    ("--max-model-len", "512", "At least 16 blocks are required for max_model_len 512"),
    ("--num-gpu-blocks-override", "7", "pa_num_blocks (8) must match your --num-gpu-blocks-override intent(7)"),
    ("--max-num-batched-tokens", "128", "a chunk of max_num_batched_tokens 128 fits no compiled"),
    ("--block-size", "16", "At least 16 blocks are required for max_model_len 256, but only 8"),
])
def test_the_double_refuses_a_command_that_disagrees_with_the_compile(lc, tmp_path, name, value, refusal):
    build, bundle = lc
    doc = dry_run(build, str(bundle))
    doc["command"] = _with(doc["command"], name, value)
    proc = _run_printed(build, doc, tmp_path / "run.jsonl")
    assert proc.returncode != 0 and refusal in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_a_consistent_command_for_another_layout_is_refused(lc, tmp_path):
    """Blocks of 16 throughout the command (vLLM's and the override's), which vllm-neuron takes: the double holds
    them to the compiled cache, whose slots vLLM would address wrongly."""
    build, bundle = lc
    doc = dry_run(build, str(bundle))
    command = _with(_with(doc["command"], "--block-size", "16"), "--num-gpu-blocks-override", "16")
    extra = json.loads(flag(command, "--additional-config"))
    extra["override_neuron_config"].update(pa_block_size=16, pa_num_blocks=16)
    doc["command"] = _with(command, "--additional-config", json.dumps(extra))
    proc = _run_printed(build, doc, tmp_path / "run.jsonl")
    assert proc.returncode != 0 and "the compiled KV cache has blocks of 32" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_prefix_caching_without_the_ports_patch_is_refused(lc, tmp_path):
    """vllm-neuron 0.5's KV cache spec names every layer as attention (runner L892-917 @ 3afb0a9); the port patches it
    to its attention layers, and a bundle whose plugin installed no patch cannot serve prefix caching."""
    build, bundle = lc
    copy = _copy(bundle, tmp_path / "nopatch")
    spec_path = copy / "vllm" / "qbuild_vllm_plugin.json"
    spec_path.write_text(json.dumps({**json.loads(spec_path.read_text()), "serving_patch": None}))
    doc = dry_run(build, str(copy))
    proc = _run_printed(build, doc, tmp_path / "run.jsonl")
    assert proc.returncode != 0 and "KV cache spec that names the DeltaNet layers" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_a_bundle_whose_layout_disagrees_is_refused_before_vllm_starts(lc, tmp_path):
    """serve.json's blocks against NxDI's compiled neuron_config.json, and max_model_len against the blocks."""
    from qbuild.model.bundle import read_manifest, write_manifest

    build, bundle = lc
    for change, words in (({"num_blocks": 16}, "neuron_config.pa_num_blocks is 9 where vllm/serve.json needs 17"),
                          ({"num_blocks": 9}, "neuron_config.pa_num_blocks is 9 where vllm/serve.json needs 10"),
                          ({"block_size": 16}, "neuron_config.pa_block_size is 32 where vllm/serve.json needs 16")):
        copy = _copy(bundle, tmp_path / str(len(list(tmp_path.iterdir()))))
        path = copy / "vllm" / "serve.json"
        serve = json.loads(path.read_text())
        path.write_text(json.dumps({**serve, "long_context": {**serve["long_context"], **change}}))
        write_manifest(copy, {k: v for k, v in read_manifest(bundle).items() if k not in ("files", "format")})
        proc = build.cli("serve", str(copy), "--port", "0", overlay=(VLLM_SITE,), log=tmp_path / "x.jsonl")
        assert proc.returncode == 2 and words in proc.stderr and "\n" not in proc.stderr.strip(), proc.stderr
    assert not read_log(tmp_path / "x.jsonl")


# --- qbuild's compile configuration against the double, one value changed --------------------------------------

@pytest.fixture
def main_port(sdk, monkeypatch):
    """The NxDI double (test_neuron_double's `sdk`) and the main port importable in this process for one test."""
    monkeypatch.syspath_prepend(str(MAIN_PORT))


def _app(cfg: dict, kwargs: dict, tmp_path: Path):
    """The port's application constructed as qbuild's SDK worker constructs it (sdk_worker.compile_text): its
    NeuronConfig, InferenceConfig and app, which choose the KV manager and the buckets there."""
    from neuronx_distributed_inference.models.config import NeuronConfig
    from src.modeling_qwen35 import NeuronQwen35ForCausalLM, Qwen35InferenceConfig

    config = Qwen35InferenceConfig(neuron_config=NeuronConfig(**cfg), **kwargs)
    return NeuronQwen35ForCausalLM(str(tmp_path), config=config)


# (what is changed, in the NeuronConfig or the port's config, and what refuses it)
MUTATIONS = {
    "no-prefix-caching": ({"is_prefix_caching": False}, {}, AttributeError, "no attribute 'k_shape'"),
    "nxdi-chunked-prefill": ({"chunked_prefill_config": {"max_num_seqs": 1}}, {}, NotImplementedError,
                             "Chunked Prefill is not available in NxDI"),
    "interval-not-block": ({}, {"gdn_checkpoint_interval": 64}, ValueError,
                           "gdn_checkpoint_interval == pa_block_size"),
    "static-manager": ({}, {"use_hybrid_apc_manager": False, "use_hybrid_cache_manager": True}, ValueError,
                       "does not support: block KV layout"),
    "bf16-recurrent-state": ({}, {"hybrid_recurrent_cache_dtype": "bfloat16"}, ValueError,
                             "requires float32 recurrent"),
    "both-managers": ({}, {"use_hybrid_cache_manager": True}, ValueError, "mutually exclusive"),
    "chunk-without-block-layout": ({"is_block_kv_layout": False, "chunked_prefill_config": {}}, {}, AssertionError,
                                   "is_block_kv_layout has to be true"),
}


@pytest.mark.parametrize("case", sorted(MUTATIONS))
def test_the_double_refuses_the_compile_configuration_with_one_value_changed(main_port, small_checkpoints, tmp_path,
                                                                             case):
    from qbuild.backends.neuron.backend import text_compile_params
    from qbuild.backends.neuron.config import inference_kwargs, neuron_config
    from qbuild.recipe.schema import load_recipe
    from qbuild.hub.source import load_arch

    recipe = write_recipe(tmp_path / "lc.yaml", small_checkpoints["qwen3_5"], MAIN_PORT, text=TEXT)
    loaded = load_recipe(recipe)
    params = text_compile_params(loaded, load_arch(loaded))
    cfg, kwargs = neuron_config(params)["neuron_config"], inference_kwargs(params)
    app = _app(cfg, kwargs, tmp_path)
    assert app.kv_manager == "QwenHybridBlockKVCacheManager"
    assert [s.buckets for s in app.submodels] == [[[32, 0], [32, 256], [64, 0], [64, 256]], [[1, 256]]]
    banks = sorted(n for n in app._model_cls.rank_weights(app.config) if n.startswith(BANK))
    assert banks == [f"{BANK}.conv_slots.0", f"{BANK}.recurrent_slots.0"]
    # The banks are weights of the model only with the hybrid APC manager (modeling_qwen35.py L5618-5626): without it
    # a shard holding them carries a tensor the model does not take.
    plain = _app({**cfg, "is_block_kv_layout": False, "is_prefix_caching": False},
                 {**kwargs, "use_hybrid_apc_manager": False}, tmp_path)
    assert plain.kv_manager == "KVCacheManager"
    assert not any(n.startswith(BANK) for n in plain._model_cls.rank_weights(plain.config))
    nc_change, port_change, error, words = MUTATIONS[case]
    with pytest.raises(error, match=words):
        _app({**cfg, **nc_change}, {**kwargs, **port_change}, tmp_path)


def test_the_128k_recipe_is_a_configuration_the_double_builds(main_port, tmp_path):
    """recipes/36-27b-fp8-128k.yaml as planned: the port's config takes it, the model has the block KV manager, the
    (512, 0) and (512, 131072) context-encoding graphs and one token-generation graph, and a bank pair per DeltaNet
    layer (48) of 8 slots, the recurrent bank (8, 48/4 value heads, 128, 128) in float32."""
    from qbuild.backends.neuron.backend import text_compile_params
    from qbuild.backends.neuron.config import inference_kwargs, neuron_config
    from qbuild.recipe.schema import load_recipe
    from qbuild.hub.source import load_arch
    from tests.conftest import REPO

    loaded = load_recipe(REPO / "recipes" / "36-27b-fp8-128k.yaml")
    arch = load_arch(loaded)
    params = text_compile_params(loaded, arch)
    app = _app(neuron_config(params)["neuron_config"], inference_kwargs(params), tmp_path)
    assert app.kv_manager == "QwenHybridBlockKVCacheManager"
    assert [s.buckets for s in app.submodels] == [[[512, 0], [512, 131072]], [[1, 131072]]]
    weights = app._model_cls.rank_weights(app.config)
    banks = {n: w for n, w in weights.items() if n.startswith(BANK)}
    assert len(banks) == 2 * sum(t == "linear_attention" for t in arch.layer_types) == 96
    assert (banks[f"{BANK}.recurrent_slots.0"].shape, banks[f"{BANK}.recurrent_slots.0"].dtype) == \
        ((8, 12, 128, 128), "float32")


@pytest.mark.slow
def test_a_port_without_its_vllm_patch_fails_before_the_compile(small_checkpoints, tmp_path):
    """A long-context bundle is served with the port's own vLLM patch; a port that lacks it fails the text compile in
    one line naming the file, before NxDI is called."""
    port = Path(shutil.copytree(MAIN_PORT, tmp_path / "port", ignore=shutil.ignore_patterns("__pycache__", "vllm")))
    build = Build(tmp_path)
    result, stderr = build.compile(write_recipe(tmp_path / "nopatch.yaml", small_checkpoints["qwen3_5"], port,
                                                text=TEXT))
    (failure,) = [v for v in result["failed"].values() if v["name"].startswith("compile text")]
    assert "port: vllm/qwen36_hybrid_apc_scheduler_patch.py is missing" in failure["error"], failure
    assert not build.calls("compile")
