"""`qbuild serve` on neuron bundles: the vLLM command and environment made of the bundle's own record, the flattened
config.json and the vLLM plugin the package step writes (docs/vllm.md), checked against the NxDI contract double
(tests/nxdi_double) the way vllm-neuron uses NxDI; and, on a Trainium host with vLLM's Neuron plugin, a real request.

vLLM does not install on a CPU host. What the double can show is what vllm-neuron does with NxDI before and while it
loads a compiled model (neuronx_distributed_model_loader.py @ a5ef7c8): find the app class in MODEL_TYPES under the
name it derives from the architecture, read num_key_value_heads / head_dim from the top level of the config, build
the port's InferenceConfig through load_pretrained_config, and load NEURON_COMPILED_ARTIFACTS with `App(dir).load(dir)`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, qbuild, wait_until
from tests.nxdi_double import MAIN_PORT, MOE_PORT, SITE, VLLM_SITE, metadata_overlay, read_log, settings_dir
from tests.test_neuron_double import Build, compiled, require_bundle, write_recipe

pytestmark = pytest.mark.xdist_group("neuron-serve")

# CTE buckets up to 128: the loader's fallback builds its own NeuronConfig with autobucketing, which the double only
# does from 128 on, so a failed load reaches the compile it falls back to.
TEXT = {"batch_size": 1, "seq_len": 256, "cte_buckets": [64, 128], "tkg_buckets": [256]}


def _bundle(root: Path, checkpoint: Path, port_dir: Path, text: dict = TEXT, **changes) -> tuple[Build, Path]:
    """A tiny neuron recipe (`serve`) built with the double (verify left for a device) and pulled into root/bundle."""
    build = Build(root)
    build.recipe = write_recipe(root / "recipes" / "serve.yaml", checkpoint, port_dir, text=text, **changes)
    build.result, build.stderr = build.compile(build.recipe)
    compiled(build.result, build.stderr)
    require_bundle(build.result, build.stderr)
    bundle = root / "bundle"
    pulled = build.cli("pull", "serve", "--to", str(bundle), "--allow-unverified")
    assert pulled.returncode == 0, pulled.stderr
    return build, bundle


@pytest.fixture(scope="module")
def dense(tmp_path_factory, small_checkpoints) -> tuple[Build, Path]:
    """The tiny Qwen3.5 on the main lineage, tp 2, CTE buckets 64 and 128, TKG bucket 256."""
    return _bundle(tmp_path_factory.mktemp("serve-dense"), small_checkpoints["qwen3_5"], MAIN_PORT)


def dry_run(build: Build, target: str, *args: str, **env) -> dict:
    proc = build.cli("serve", target, "--dry-run", "--json", *args, **env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


@pytest.mark.slow
def test_dry_run_prints_the_vllm_command_made_of_the_bundle_record(dense):
    build, bundle = dense
    doc = dry_run(build, str(bundle), "--port", "8123", "--host", "0.0.0.0")
    command, env = doc["command"], doc["env"]
    assert command[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(command, "--model") == str(bundle) and flag(command, "--served-model-name") == "bundle"
    # Prompts up to the largest CTE bucket (128, the compiled max_context_length), the sequence up to the largest TKG
    # bucket (256): vllm-neuron 0.5's additional_config.max_prompt_length, then vLLM's max_model_len.
    assert flag(command, "--max-model-len") == "256" and doc["max_model_len"] == 256
    assert json.loads(flag(command, "--additional-config")) == {"max_prompt_length": 128}
    assert doc["max_prompt_length"] == 128
    assert flag(command, "--tensor-parallel-size") == "2"
    assert flag(command, "--max-num-seqs") == "1" and flag(command, "--num-gpu-blocks-override") == "1"
    assert flag(command, "--dtype") == "bfloat16"
    assert flag(command, "--host") == "0.0.0.0" and flag(command, "--port") == "8123"
    assert {"--no-enable-prefix-caching", "--no-enable-chunked-prefill"} <= set(command)
    assert "--block-size" not in command and "--enable-prefix-caching" not in command
    assert "--trust-remote-code" not in command     # the plugin registers the config: no code from the bundle runs
    assert doc["url"] == "http://0.0.0.0:8123/v1"
    assert doc["stack"] == {"releases": ["2.31.0"], "vllm": "0.16.0", "vllm_neuron": "0.5.0"}

    assert env["NEURON_COMPILED_ARTIFACTS"] == str(bundle)
    assert env["VLLM_PLUGINS"].split(",") == ["neuron", "qbuild_bundle"]
    assert "VLLM_NEURON_FRAMEWORK" not in env and "VLLM_WORKER_MULTIPROC_METHOD" not in env
    glue, port = (Path(p) for p in env["PYTHONPATH"].split(os.pathsep))
    assert glue == bundle / "vllm" and (glue / "qbuild_vllm_plugin.py").is_file()
    assert port == bundle / "port"     # main lineage: `import src.modeling_qwen35` from the port directory
    record = json.loads((bundle / "qbuild-neuron.json").read_text())
    assert {k: env[k] for k in record["config"]["env"]} == record["config"]["env"]
    assert env["NEURON_LOGICAL_NC_CONFIG"] == "2"


@pytest.mark.slow
def test_arguments_after_the_double_dash_reach_vllm_and_the_bundles_own_are_refused(dense):
    build, bundle = dense
    extra = ["--chat-template", "t.jinja", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder",
             "--reasoning-parser", "qwen3", "--api-key", "sekrit", "--trust-remote-code"]
    doc = dry_run(build, str(bundle), "--", *extra)
    assert doc["command"][-len(extra):] == [*extra[:8], "***", extra[9]]      # the key is never printed
    assert "sekrit" not in json.dumps(doc)
    for args in (["--max-model-len", "4096"], ["-tp", "4"], ["--enable-prefix-caching"], ["--port=9"],
                 ["--additional-config={}"], ["--num-gpu-blocks-override", "8"]):
        proc = build.cli("serve", str(bundle), "--dry-run", "--", "--chat-template", "x", *args)
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr
        line = proc.stderr.strip()
        assert "\n" not in line and line.startswith(f"error: {args[0]}: set by qbuild from the bundle"), line


@pytest.mark.slow
def test_what_the_glue_cannot_serve_is_refused_naming_serve_json(dense, tmp_path):
    """A batch above 1 compiled without continuous batching (vllm-neuron prefills requests one at a time into their
    own batch lines), and a bundle of a release served by another vllm-neuron (2.28's 0.4.x), are refused in one line
    by --dry-run and by serve alike."""
    build, bundle = dense
    for change, words in (({"max_num_seqs": 2}, "batch size 2 compiled without continuous batching"),
                          ({"stack": {"releases": ["2.28.0", "2.28.1"], "vllm": "0.13.0", "vllm_neuron": "0.4"}},
                           "SDK 2.28.0, 2.28.1 serves with vllm-neuron 0.4 on vLLM 0.13.0")):
        copy = Path(shutil.copytree(bundle, tmp_path / str(len(list(tmp_path.iterdir())))))
        serve_json = copy / "vllm" / "serve.json"
        serve_json.unlink()        # a hardlink into the store: replaced, never written through
        serve_json.write_text(json.dumps({**json.loads((bundle / "vllm" / "serve.json").read_text()), **change}))
        for args in (("--dry-run",), ("--port", "0")):
            proc = build.cli("serve", str(copy), *args, overlay=(VLLM_SITE,))
            assert proc.returncode == 2 and proc.stderr.strip().startswith(f"error: {serve_json}: {words}"), \
                proc.stderr


@pytest.mark.slow
def test_dry_run_of_a_recipe_and_of_a_copied_bundle(dense, tmp_path):
    """A recipe's bundle is served under the recipe's name; a bundle copied elsewhere serves from where it is now."""
    build, bundle = dense
    by_recipe = dry_run(build, str(build.recipe), "--allow-unverified")
    assert flag(by_recipe["command"], "--served-model-name") == "serve"
    assert flag(by_recipe["command"], "--max-model-len") == "256"
    refused = build.cli("serve", str(build.recipe), "--dry-run")
    assert refused.returncode == 2 and "not verified" in refused.stderr and "--allow-unverified" in refused.stderr

    copy = Path(shutil.copytree(bundle, tmp_path / "elsewhere" / "model"))
    moved = dry_run(build, str(copy))
    assert moved["env"]["NEURON_COMPILED_ARTIFACTS"] == str(copy)
    assert moved["env"]["PYTHONPATH"].split(os.pathsep) == [str(copy / "vllm"), str(copy / "port")]
    assert str(bundle) not in json.dumps(moved)


@pytest.mark.slow
def test_flattened_config_has_the_text_fields_at_the_top(dense):
    """vllm-neuron reads num_key_value_heads and head_dim from the top level of config.json; the bundle's copy
    carries the text model's fields there and keeps text_config, and transformers still reads it as the model's."""
    from transformers import AutoConfig

    _, bundle = dense
    config = json.loads((bundle / "config.json").read_text())
    text = config["text_config"]
    assert config["num_key_value_heads"] == text["num_key_value_heads"]
    assert config["head_dim"] == text["head_dim"]
    assert config["rope_theta"] == text["rope_parameters"]["rope_theta"]
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and config["model_type"] == "qwen3_5"
    hf = AutoConfig.from_pretrained(bundle)
    assert hf.get_text_config().num_key_value_heads == text["num_key_value_heads"]
    assert hf.get_text_config().head_dim == text["head_dim"]


# --- the printed command, run by the vLLM / vllm-neuron double -----------------------------------------------------

def _double_env(build: Build, doc: dict, log: Path) -> dict:
    """`doc`'s environment (as `qbuild serve` gives vLLM) with the double's settings, vLLM / vllm-neuron and NxDI
    behind it on PYTHONPATH."""
    env = dict(os.environ, **doc["env"])
    directory = settings_dir(log.parent / f"{log.stem}-settings", log=log, checkpoint=build.checkpoint)
    env["PYTHONPATH"] = os.pathsep.join((doc["env"]["PYTHONPATH"], str(directory), str(VLLM_SITE), str(SITE),
                                         str(REPO)))
    return env


def _run_printed(build: Build, doc: dict, log: Path) -> subprocess.CompletedProcess:
    """The command `qbuild serve --dry-run` printed, run as printed; for a command whose engine fails to start."""
    return subprocess.run(doc["command"], env=_double_env(build, doc, log), capture_output=True, text=True,
                          timeout=300, cwd=build.root)


class Served:
    """`qbuild serve` of a bundle with the vLLM double on the path, as a user starts it."""

    def __init__(self, build: Build, target: str, tmp: Path, *args: str, **settings):
        self.ready, self.log = tmp / "url", tmp / "nxdi.jsonl"
        env = build.env(overlay=(VLLM_SITE,), log=self.log, **settings)
        self.proc = subprocess.Popen([sys.executable, "-m", "qbuild.cli", *build.args(
            ("serve", target, "--port", "0", "--ready-file", str(self.ready), *args))],
            env=dict(os.environ, **env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=build.root)

    def url(self) -> str:
        """The URL once the server answers; "" where it exited first."""
        wait_until(lambda: self.proc.poll() is not None or (self.ready.exists() and self.ready.read_text().strip()),
                   240, "the server to answer or exit")
        return self.ready.read_text().strip() if self.ready.exists() else ""

    def stop(self) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        _, err = self.proc.communicate(timeout=120)
        return self.proc.returncode, err

    def calls(self, name: str) -> list[dict]:
        return [c for c in read_log(self.log) if c["call"] == name]


def _post(url: str, doc: dict, key: str | None = None) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=json.dumps(doc).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _unchanged(bundle: Path) -> None:
    """Every file bundle.json lists has its digest, and the bundle holds no other file."""
    from qbuild.model.bundle import MANIFEST, check_files, read_manifest

    manifest = read_manifest(bundle)
    check_files(bundle, manifest)
    files = {p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file()
             and "__pycache__" not in p.parts}
    assert files - {MANIFEST} == set(manifest["files"]), sorted(files ^ set(manifest["files"]))


@pytest.mark.slow
def test_serve_runs_the_bundle_through_vllm_neuron_05(dense, tmp_path):
    """`qbuild serve` as a user runs it, against the vLLM 0.16 / vllm-neuron 0.5 double on a transformers-4.x-like
    interpreter: the engine core starts with `spawn` and gets the bundle plugin's own config class (pickled), loads the
    compiled directory with the guarded port class and never compiles; a prompt over the largest CTE bucket is a 400
    naming it; the pass-through reaches vLLM; Ctrl-C ends it with 0 and the bundle is byte for byte as built."""
    build, bundle = dense
    served = Served(build, str(bundle), tmp_path, "--", "--reasoning-parser", "qwen3", "--chat-template", "{{x}}")
    try:
        url = served.url()
        assert url, served.stop()[1]
        status, long = _post(url + "/completions", {"model": "bundle", "prompt": "hello world " * 100})
        assert status == 400 and "maximum prompt length is 128 tokens" in long["error"]["message"]
        assert _post(url + "/completions", {"model": "bundle", "prompt": "hello"})[0] == 501   # the double stops here
    finally:
        code, err = served.stop()
    assert code == 0, err
    (engine,) = served.calls("vllm_engine_core")
    assert engine["start_method"] == "spawn" and engine["pid"] != served.proc.pid
    assert engine["hf_config_cls"] == "qbuild_vllm_plugin.Qwen35Config"
    assert engine["app_cls"] == "PrecompiledOnlyNeuronQwen35ForCausalLM"
    assert (engine["max_prompt_length"], engine["block_size"], engine["num_gpu_blocks"]) == (128, 256, 2)
    (load,) = served.calls("load")
    assert load["path"].rstrip("/") == str(bundle) and load["ranks"] == [0, 1]
    assert [c["path"] for c in served.calls("vllm_sampling")] == ["cpu"]    # compiled without on-device sampling
    assert not served.calls("compile")
    _unchanged(bundle)


@pytest.mark.slow
def test_a_bundle_sampled_on_the_device_is_served_on_vllm_neurons_on_device_path(small_checkpoints, tmp_path):
    """A bundle compiled with on-device sampling (the ports' OnDeviceSamplingConfig(top_k=1)) is served by vllm-neuron
    0.5 on its on-device path, with the compiled sampler (top_k 1, do_sample off), not the loader's default
    (dynamic=True), which only a model vLLM compiles itself gets; the dry run says the request's sampling parameters
    change nothing. The vLLM flags are the same as for a bundle that returns logits."""
    build, bundle = _bundle(tmp_path / "build", small_checkpoints["qwen3_5"], MAIN_PORT,
                            text={**TEXT, "sampling": {"on_device": True, "top_k": 1}})
    doc = dry_run(build, str(bundle))
    assert doc["sampling"]["on_device"] is True and doc["sampling"]["top_k"] == 1
    assert "a request's temperature, top_p and top_k do not change the tokens" in doc["sampling"]["note"]
    assert json.loads(flag(doc["command"], "--additional-config")) == {"max_prompt_length": 128}
    served = Served(build, str(bundle), tmp_path)
    try:
        assert served.url(), served.stop()[1]
    finally:
        code, err = served.stop()
    assert code == 0, err
    (sampling,) = served.calls("vllm_sampling")
    assert sampling["path"] == "on_device"
    assert {k: sampling["config"][k] for k in ("top_k", "do_sample", "dynamic")} == \
        {"top_k": 1, "do_sample": False, "dynamic": False}


@pytest.mark.slow
def test_a_failed_load_cannot_write_into_the_bundle(dense, tmp_path):
    """Where the compiled model's load raises ValueError, vllm-neuron compiles into NEURON_COMPILED_ARTIFACTS, the
    bundle; the bundle's plugin refuses that, the server stops naming the load's error, qbuild exits 3, and every file
    of the bundle keeps its digest."""
    build, bundle = dense
    served = Served(build, str(bundle), tmp_path, load_error="injected: model.pt does not match")
    assert served.url() == ""
    code, err = served.stop()
    assert code == 3, err
    assert "ValueError: injected: model.pt does not match" in err and "would now compile into" in err
    assert err.strip().splitlines()[-1].startswith("error: vLLM exited with code 1 before it was stopped")
    assert not served.calls("compile")
    _unchanged(bundle)


@pytest.mark.slow
def test_a_host_with_another_vllm_stack_is_refused_in_one_line(dense, tmp_path):
    """SDK 2.31.1's manifest names vllm-neuron 0.21.0.1.0.0, the NxDI-free plugin: on such a host (or one with
    another vLLM) serve refuses before starting anything, naming both stacks."""
    build, bundle = dense
    for versions, have in (({"vllm-neuron": "0.21.0.1.0.0"}, "vLLM 0.16.0 with vllm-neuron 0.21.0.1.0.0"),
                           ({"vllm": "0.11.0"}, "vLLM 0.11.0 with vllm-neuron 0.5.0")):
        overlay = metadata_overlay(tmp_path / next(iter(versions)), versions)
        proc = build.cli("serve", str(bundle), "--port", "0", overlay=(overlay, VLLM_SITE), log=tmp_path / "x.jsonl")
        assert proc.returncode == 3, proc.stderr
        assert proc.stderr.strip() == (
            f"error: this host has {have}; the bundle (SDK 2.31.0) is served by vLLM 0.16.0 with "
            "vllm-neuron 0.5.0 (vllm/serve.json): use that release's vLLM environment")
    assert not read_log(tmp_path / "x.jsonl")


@pytest.mark.slow
def test_a_bundle_whose_files_disagree_is_refused_before_vllm_starts(dense, tmp_path):
    """The load's preconditions are checked first: NxDI's compiled neuron_config.json must say what vllm/serve.json
    tells vLLM (the runner refuses a max_prompt_length other than the compiled max_context_length), even where
    bundle.json was rewritten to match the files; a bundle whose files differ from bundle.json is refused too. Nothing
    starts: the double's log stays empty."""
    from qbuild.model.bundle import read_manifest, write_manifest

    build, bundle = dense
    copy = Path(shutil.copytree(bundle, tmp_path / "bundle"))
    config = json.loads((copy / "neuron_config.json").read_text())
    config["neuron_config"]["max_context_length"] = 64
    (copy / "neuron_config.json").unlink()
    (copy / "neuron_config.json").write_text(json.dumps(config))
    log = tmp_path / "x.jsonl"
    changed = build.cli("serve", str(copy), "--port", "0", overlay=(VLLM_SITE,), log=log)
    assert changed.returncode == 2 and "changed since the bundle was made" in changed.stderr, changed.stderr
    meta = {k: v for k, v in read_manifest(bundle).items() if k not in ("files", "format")}
    write_manifest(copy, meta)
    proc = build.cli("serve", str(copy), "--port", "0", overlay=(VLLM_SITE,), log=log)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"error: {copy / 'neuron_config.json'}: neuron_config.max_context_length is 64 "
                                   "where vllm/serve.json says 128; the bundle's files do not belong together: pull "
                                   "or build it again")
    assert not read_log(log)


@pytest.mark.slow
def test_the_checkpoint_config_is_what_vllm_neuron_would_refuse(dense, small_checkpoints, tmp_path):
    """The flattened config.json matters: with the checkpoint's own nested one in the bundle's place, the printed
    command's engine stops at vllm-neuron's first read, no num_key_value_heads at the top level."""
    build, bundle = dense
    copy = Path(shutil.copytree(bundle, tmp_path / "bundle"))
    (copy / "config.json").unlink()
    shutil.copy(small_checkpoints["qwen3_5"] / "config.json", copy / "config.json")
    proc = _run_printed(build, dry_run(build, str(copy)), tmp_path / "nxdi.jsonl")
    assert proc.returncode == 1 and "Missing required num_key_value_heads" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_moe_lineage_bundle_serves_from_the_port_src(small_checkpoints, tmp_path):
    """Coder-Next's lineage: its flat config.json is left as it is (transformers 4.57 and vLLM 0.16 know qwen3_next),
    its src/ goes on PYTHONPATH, and its class is registered under "qwen3next" (vllm/register_model.py L26, PR 170 @
    753c7f5); the tool-call flags its launcher passes reach vLLM."""
    build, bundle = _bundle(tmp_path, small_checkpoints["qwen3_next"], MOE_PORT, fused_qkv=True,
                            moe_backend="shard_on_block", port={"lineage": "moe"})
    assert "text_config" not in json.loads((bundle / "config.json").read_text())
    doc = dry_run(build, str(bundle))
    assert doc["env"]["PYTHONPATH"].split(os.pathsep) == [str(bundle / "vllm"), str(bundle / "port" / "src")]
    served = Served(build, str(bundle), tmp_path, "--", "--enable-auto-tool-choice", "--tool-call-parser",
                    "qwen3_coder")
    try:
        assert served.url(), served.stop()[1]
    finally:
        code, err = served.stop()
    assert code == 0, err
    (engine,) = served.calls("vllm_engine_core")
    assert engine["app_cls"] == "PrecompiledOnlyNeuronQwen35MoeForCausalLM"
    _unchanged(bundle)


@pytest.mark.slow
def test_serving_without_vllm_is_one_line_exit_3(dense):
    build, bundle = dense
    proc = build.cli("serve", str(bundle), "--port", "0")
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: serving a neuron bundle needs vLLM") and "--dry-run" in lines[-1]
    assert "Traceback" not in proc.stderr and proc.stdout == ""


# The vLLM 0.16 command line as the double's api_server parses it, the configuration vllm-neuron 0.5's platform makes of
# it, and the NeuronConfig its loader builds before it loads the compiled directory (vllm_site: flags of arg_utils.py /
# cli_args.py, platform.py L290-387, loader L985-1214).
_PARSE_SCRIPT = """
import json, os, sys
sys.path[:0] = sys.argv[1:3]
os.environ.update(json.loads(sys.argv[4]))
from vllm.config import VllmConfig
from vllm.entrypoints.openai.api_server import parser
from vllm_neuron.platform import NeuronPlatform
from vllm_neuron.worker.neuronx_distributed_model_loader import validated_neuron_config
args = parser().parse_args(json.loads(sys.argv[3]))
config = VllmConfig(model=args.model, hf_config=None, dtype=args.dtype, max_model_len=args.max_model_len,
                    tensor_parallel_size=args.tensor_parallel_size, max_num_seqs=args.max_num_seqs,
                    num_gpu_blocks_override=args.num_gpu_blocks_override,
                    enable_prefix_caching=bool(args.enable_prefix_caching),
                    enable_chunked_prefill=bool(args.enable_chunked_prefill), additional_config=args.additional_config,
                    block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens)
NeuronPlatform.check_and_update_config(config)
nc = validated_neuron_config(config)
print(json.dumps({**{k: v for k, v in vars(config).items() if k != "hf_config"},
                  "pa_num_blocks": nc["pa_num_blocks"], "max_context_length": nc["max_context_length"]}))
"""


@pytest.mark.parametrize("recipe", [r for r in sorted((REPO / "recipes").glob("*.yaml"))], ids=lambda p: p.name)
def test_each_shipped_recipe_serves_with_a_command_vllm_neuron_05_takes(recipe, tmp_path):
    """`qbuild serve --dry-run` of each shipped recipe's bundle layout (its vllm/serve.json as the package step writes
    it from the planned params and compile record): vLLM 0.16's parser takes every flag, vllm-neuron 0.5's platform
    and loader make of it prompts up to the compiled max_context_length and sequences up to the largest TKG bucket,
    with one contiguous block per sequence and chunked prefill off, or, for a recipe with chunked prefill
    (36-27b-fp8-128k), the compiled block KV layout served in chunks; the stack is SDK 2.29-2.31's."""
    from qbuild.backends.neuron.package import serve_record
    from qbuild.backends.neuron.params import NeuronPackageParams
    from qbuild.recipe.params import parse
    from qbuild.model.bundle import write_manifest

    nodes = json.loads(qbuild("plan", str(recipe), "--json", check=True).stdout)["nodes"]
    (package,) = [n for n in nodes if n["kind"] == "package"]
    (text,) = [n for n in nodes if n["kind"] == "compile" and n["params"].get("graph") == "text"]
    params = parse(NeuronPackageParams, package["params"])
    record = {"params": text["params"], "config": {"env": text["neuron_config"]["env"],
                                                   "neuron_config": text["neuron_config"]["neuron_config"]}}
    bundle = tmp_path / "bundle"
    (bundle / "vllm").mkdir(parents=True)
    (bundle / "vllm" / "serve.json").write_text(json.dumps(serve_record(params, record)))
    (bundle / "vllm" / "qbuild_vllm_plugin.json").write_text(json.dumps({"port_dir": "../port"}))
    write_manifest(bundle, {"backend": "neuron"})
    proc = qbuild("serve", str(bundle), "--dry-run", "--json", "--", "--reasoning-parser", "qwen3")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["stack"]["vllm"] == "0.16.0" and doc["stack"]["vllm_neuron"] == "0.5.0"
    assert doc["env"]["NEURON_COMPILED_ARTIFACTS"] == str(bundle)
    assert doc["env"].items() >= text["neuron_config"]["env"].items()
    parsed = subprocess.run([sys.executable, "-c", _PARSE_SCRIPT, str(VLLM_SITE), str(SITE),
                             json.dumps(doc["command"][3:]), json.dumps(doc["env"])], capture_output=True, text=True)
    assert parsed.returncode == 0, parsed.stderr
    config = json.loads(parsed.stdout)
    assert config["tensor_parallel_size"] == params.tp and config["dtype"] == params.dtype
    assert config["max_num_seqs"] == params.batch_size and config["max_model_len"] == max(params.tkg_buckets)
    compiled = text["neuron_config"]["neuron_config"]
    assert config["max_prompt_length"] == config["max_context_length"] == compiled["max_context_length"]
    # The recipes whose ports compile OnDeviceSamplingConfig(top_k=1) do; the dry run says what that does to requests.
    sampled = recipe.name in ("2b-tp8.yaml", "2b-vl-tp8.yaml", "35b-a3b-tp8.yaml", "35b-a3b-vl-tp8.yaml", "27b-tp4.yaml")
    assert compiled.get("on_device_sampling_config") == ({"top_k": 1} if sampled else None)
    assert ("sampling" in doc) == sampled
    if params.block_kv is None:
        # One contiguous block per sequence, chunked prefill off.
        cte, tkg = max(params.cte_buckets), max(params.tkg_buckets)
        assert (config["max_prompt_length"], config["block_size"]) == (cte, tkg)
        assert config["num_gpu_blocks_override"] == params.batch_size + 1
        assert not config["enable_prefix_caching"] and not config["enable_chunked_prefill"]
        return
    # The compiled block KV layout, served by vLLM's chunked-prefill scheduler in chunks of the recipe's chunk, as
    # PR 173's launcher serves it; prefix caching where the recipe opts into the port's experiment. The loader lifts
    # the override's pa_num_blocks by vLLM's null block to the count the bundle compiled (its padding sink past
    # vLLM's blocks).
    assert (config["block_size"], config["pa_num_blocks"]) == (compiled["pa_block_size"], compiled["pa_num_blocks"])
    assert config["enable_chunked_prefill"] and config["max_num_batched_tokens"] == params.long_context.chunk_size
    assert config["enable_prefix_caching"] == (params.long_context.prefix_cache is not None)


# --- the pieces, without a build ----------------------------------------------------------------------------------

def test_flat_config_copies_the_text_fields_up_and_leaves_flat_configs(small_checkpoints):
    from qbuild.backends.neuron.package import flat_config

    for family in ("qwen3_5", "qwen3_5_moe"):
        config = json.loads((small_checkpoints[family] / "config.json").read_text())
        text = config["text_config"]
        flat = flat_config(config)
        assert flat["text_config"] == text and flat["architectures"] == config["architectures"]
        assert flat["model_type"] == config["model_type"] != text["model_type"]
        for key in ("num_key_value_heads", "head_dim", "num_hidden_layers", "layer_types", "vocab_size"):
            assert flat[key] == text[key], key
        assert flat["rope_theta"] == text["rope_parameters"]["rope_theta"]
        assert flat["intermediate_size"] == text.get("intermediate_size", text.get("moe_intermediate_size"))
        assert {k: flat[k] for k in config} == config          # what the top level had, it keeps
    flat_next = json.loads((small_checkpoints["qwen3_next"] / "config.json").read_text())
    assert "text_config" not in flat_next and flat_config(flat_next) == flat_next


def test_a_neuron_bundle_without_the_vllm_glue_is_refused_naming_the_file(tmp_path):
    from qbuild.model.bundle import write_manifest

    write_manifest(tmp_path, {"backend": "neuron", "batch_size": 1})
    proc = qbuild("serve", str(tmp_path), "--dry-run")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"error: {tmp_path / 'vllm' / 'serve.json'}: missing; this neuron bundle was "
                                   "packaged without vLLM's glue (by an older qbuild): build it again")


def test_the_registry_key_is_what_vllm_neuron_derives():
    from qbuild.backends.neuron.package import nxdi_registry_key
    from qbuild.core.errors import BuildError

    assert nxdi_registry_key("Qwen3_5ForConditionalGeneration") == ("qwen3_5", "causal-lm")
    assert nxdi_registry_key("Qwen3_5MoeForConditionalGeneration") == ("qwen3_5moe", "causal-lm")
    assert nxdi_registry_key("Qwen3NextForCausalLM") == ("qwen3next", "causal-lm")
    with pytest.raises(BuildError, match="no \"For\""):
        nxdi_registry_key("Qwen3Next")


# The bundle plugin as vLLM 0.16 loads it, in the vLLM double's interpreter (which lacks the Qwen3.5 config types as
# transformers 4.x does): its config class must survive the pickling into a spawned engine process (vllm-neuron 0.5
# forces `spawn`: platform.py L7 @ 3afb0a9; vLLM passes the configuration as a Process argument: v1/engine/utils.py
# L99-128 @ 0.16.0), and plain pickle in the same process.
_SPAWN_SCRIPT = """
import json, multiprocessing, pickle, sys

def engine(config, conn):
    t = type(config)
    conn.send([f"{t.__module__}.{t.__qualname__}", type(config.text_config).__name__,
               config.get_text_config().vocab_size, config.num_key_value_heads])

if __name__ == "__main__":
    import vllm                                     # the double: qwen3_5 is unknown here, as in transformers 4.x
    from transformers import AutoConfig
    from vllm.plugins import load_general_plugins

    assert "qwen3_5" not in __import__("transformers").models.auto.configuration_auto.CONFIG_MAPPING
    load_general_plugins()                          # the bundle's entry point: register()
    load_general_plugins()                          # once per process
    config = AutoConfig.from_pretrained(sys.argv[1])
    again = pickle.loads(pickle.dumps(config))
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    proc = context.Process(target=engine, kwargs={"config": config, "conn": child})
    proc.start()
    spawned = parent.recv()
    proc.join()

    from neuronx_distributed_inference.utils.constants import MODEL_TYPES
    from vllm.model_executor.models import ModelRegistry
    app = MODEL_TYPES["qwen3_5"]["causal-lm"]
    refusals = []
    for call in (lambda: app.compile(app.__new__(app), "/the/bundle"),
                 lambda: app.save_quantized_state_dict("/the/model", None)):
        try:
            call()
        except RuntimeError as e:
            refusals.append(str(e))
    print(json.dumps({"spawned": spawned, "pickled": type(again).__qualname__, "app_mro": [c.__name__ for c in
                      app.__mro__[:3]], "arch": ModelRegistry.models.get("Qwen3_5ForConditionalGeneration"),
                      "refusals": refusals}))
"""


def _glue(tmp_path: Path) -> Path:
    """A bundle's vllm/ as the package step writes it (the plugin module, its spec naming the fake main port, the
    entry point) beside a flattened config.json: register() needs nothing else."""
    from qbuild.backends.neuron import vllm_plugin
    from qbuild.backends.neuron.package import flat_config

    glue = tmp_path / "vllm"
    (glue / "qbuild_bundle_vllm_plugin-1.dist-info").mkdir(parents=True)
    shutil.copy(vllm_plugin.__file__, glue / "qbuild_vllm_plugin.py")
    spec = {"model_type": "qwen3_5", "text_model_type": "qwen3_5_text", "architecture":
            "Qwen3_5ForConditionalGeneration", "nxdi_model": "qwen3_5", "nxdi_task": "causal-lm",
            "module": "src.modeling_qwen35", "app_class": "NeuronQwen35ForCausalLM",
            "port_dir": os.path.relpath(MAIN_PORT, glue)}
    (glue / "qbuild_vllm_plugin.json").write_text(json.dumps(spec))
    info = glue / "qbuild_bundle_vllm_plugin-1.dist-info"
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: qbuild_bundle_vllm_plugin\nVersion: 1\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\nqbuild_bundle = qbuild_vllm_plugin:register\n")
    text = {"model_type": "qwen3_5_text", "vocab_size": 11, "num_key_value_heads": 2, "head_dim": 8}
    (tmp_path / "config.json").write_text(json.dumps(flat_config(
        {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text})))
    return glue


def test_the_plugins_config_class_survives_a_spawned_engine_process(tmp_path):
    glue = _glue(tmp_path)
    script = tmp_path / "engine.py"
    script.write_text(_SPAWN_SCRIPT)
    env = dict(os.environ, VLLM_PLUGINS="neuron,qbuild_bundle",
               PYTHONPATH=os.pathsep.join(map(str, (glue, VLLM_SITE, SITE, REPO))))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["spawned"] == ["qbuild_vllm_plugin.Qwen35Config", "Qwen35TextConfig", 11, 2]
    assert out["pickled"] == "Qwen35Config"
    assert out["app_mro"] == ["PrecompiledOnlyNeuronQwen35ForCausalLM", "PrecompiledOnly", "NeuronQwen35ForCausalLM"]
    assert out["arch"] == "vllm.model_executor.models.qwen3:Qwen3ForCausalLM"
    compile_refusal, quantize_refusal = out["refusals"]
    assert "would now compile into /the/bundle" in compile_refusal
    assert "would now write a quantized checkpoint into /the/model" in quantize_refusal


def test_the_plugin_leaves_known_types_to_transformers_and_refuses_unknown_ones():
    """Where transformers has the model type (5.x has qwen3_5), its class is kept; where neither transformers nor
    the plugin has one, register() fails naming it rather than letting vLLM fail later."""
    from transformers import AutoConfig

    from qbuild.backends.neuron import vllm_plugin

    known = type(AutoConfig.for_model("qwen3_5"))
    vllm_plugin.register_hf_config({"model_type": "qwen3_5", "text_model_type": "qwen3_5_text"})
    assert type(AutoConfig.for_model("qwen3_5")) is known
    with pytest.raises(RuntimeError, match="no config class for model_type 'qbuild_unknown'"):
        vllm_plugin.register_hf_config({"model_type": "qbuild_unknown"})


def test_the_bundle_tokenizer_reads_with_transformers_4_and_5(tmp_path):
    """transformers 5 saves tokenizer_class TokenizersBackend, which 4.57's AutoTokenizer cannot resolve
    (tokenization_auto.py L1144-1156 @ 4.57.6; the vLLM double refuses it the same way); the bundle carries
    PreTrainedTokenizerFast, which both read from the same tokenizer.json with the same ids."""
    from transformers import AutoTokenizer

    from qbuild.backends.neuron.package import tokenizer_for_every_stack
    from qbuild.model.tinymodel import _write_tokenizer

    written, bundle = tmp_path / "written", tmp_path / "bundle"
    _write_tokenizer(written)
    assert json.loads((written / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    shutil.copytree(written, bundle)
    tokenizer_for_every_stack(bundle)
    config = json.loads((bundle / "tokenizer_config.json").read_text())
    assert config == {**json.loads((written / "tokenizer_config.json").read_text()),
                      "tokenizer_class": "PreTrainedTokenizerFast"}
    before, after = AutoTokenizer.from_pretrained(written), AutoTokenizer.from_pretrained(bundle)
    text = "Hello world <|im_start|> the quick brown fox"
    assert after(text)["input_ids"] == before(text)["input_ids"] and after.eos_token_id == before.eos_token_id
    probe = ("import sys; sys.path[:0] = sys.argv[2:]; from vllm.entrypoints.openai.api_server import "
             "load_tokenizer; print(load_tokenizer(sys.argv[1]).eos_token)")
    for directory, ok in ((bundle, True), (written, False)):
        proc = subprocess.run([sys.executable, "-c", probe, str(directory), str(VLLM_SITE)], capture_output=True,
                              text=True)
        assert (proc.returncode == 0) == ok, proc.stderr
        assert ok or "Tokenizer class TokenizersBackend does not exist" in proc.stderr


def test_a_bundle_changed_while_it_served_is_named(tmp_path):
    from qbuild.backends.neuron.server_process import check_unchanged
    from qbuild.core.errors import InfraError
    from qbuild.model.bundle import write_manifest

    (tmp_path / "model.pt").write_bytes(b"compiled")
    manifest = write_manifest(tmp_path, {"backend": "neuron"})
    check_unchanged(tmp_path, manifest)
    (tmp_path / "neuron-compiled-artifacts").mkdir()
    (tmp_path / "neuron-compiled-artifacts" / "model.pt").write_bytes(b"x")
    with pytest.raises(InfraError, match="neuron-compiled-artifacts/model.pt was written"):
        check_unchanged(tmp_path, manifest)
    shutil.rmtree(tmp_path / "neuron-compiled-artifacts")
    (tmp_path / "model.pt").write_bytes(b"compilex")
    with pytest.raises(InfraError, match="vLLM changed the bundle while it served it: .*model.pt: content does not"):
        check_unchanged(tmp_path, manifest)


# --- on a Trainium host --------------------------------------------------------------------------------------------

def _real_sdk_skip() -> str | None:
    import importlib.util

    for module in ("vllm", "vllm_neuron", "neuronx_distributed_inference", "openai"):
        if importlib.util.find_spec(module) is None:
            return f"{module} does not import here"
    nxdi = importlib.util.find_spec("neuronx_distributed_inference")
    if Path(nxdi.origin).resolve().is_relative_to(REPO / "tests" / "nxdi_double"):
        return "neuronx_distributed_inference is the contract double here, not the Neuron SDK"
    if not os.environ.get("QBUILD_TEST_PORTS"):
        return "QBUILD_TEST_PORTS is unset: it names the directory of NxDI contrib port checkouts"
    return None


@pytest.mark.skipif(_real_sdk_skip() is not None, reason=str(_real_sdk_skip()))
def test_serve_a_tiny_neuron_bundle_with_vllm(small_checkpoints, tmp_path):
    """`qbuild serve` on a tiny Qwen3.5 bundle built and verified on this host's NeuronCores (the Qwen3.5-2B port,
    main lineage), with the real SDK and vLLM 0.16 with vllm-neuron 0.5: the tiny tokenizer (saved by transformers 5)
    loads under the stack's transformers 4.x, the OpenAI client completes a request, a prompt over the largest CTE
    bucket is a 400, Ctrl-C stops the server with exit 0, and the bundle is unchanged."""
    import importlib.metadata

    import openai
    import yaml

    port = Path(os.environ["QBUILD_TEST_PORTS"]) / "Qwen3.5-2B"
    if not (port / "src").is_dir():
        pytest.skip(f"{port}: no port checkout")
    toolchain = {d.replace("-", "_"): importlib.metadata.version(d).split("+")[0]
                 for d in ("neuronx-cc", "neuronx-distributed", "neuronx-distributed-inference", "torch-neuronx")}
    recipe = tmp_path / "serve.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"path": str(small_checkpoints["qwen3_5"])}, "backend": "neuron", "port": {"path": str(port)},
        "parallel": {"tp": 2}, "dtype": "bfloat16", "text": TEXT, "compiler": {"target": "trn2"},
        "toolchain": toolchain, "verify": {"prompts": ["Hello world"], "new_tokens": 4, "image_prompt": False}}))
    env = {"QBUILD_STORE": str(tmp_path / "store")}
    lock = ["--lock", str(tmp_path / "artifacts.lock")]
    built = qbuild("compile", str(recipe), *lock, env=env, timeout=7200)
    assert built.returncode == 0, built.stderr[-4000:]
    bundle = tmp_path / "bundle"
    assert qbuild("pull", "serve", "--to", str(bundle), *lock, env=env).returncode == 0
    # As a user starts it: the console script this interpreter installed, on a pulled bundle, a flag for vLLM after --.
    script = Path(sys.executable).with_name("qbuild")
    ready = tmp_path / "url"
    server = subprocess.Popen([str(script), "serve", str(bundle), "--port", "0", "--ready-file", str(ready), *lock,
                               "--", "--generation-config", "vllm"],
                              env=dict(os.environ, **env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = wait_until(lambda: ready.exists() and ready.read_text().strip(), 1800, "vLLM to answer /v1/models")
        client = openai.OpenAI(base_url=url, api_key="unused")
        reply = client.completions.create(model="bundle", prompt="Hello world", max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens >= 1 and reply.choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.BadRequestError, match="maximum prompt length is 128 tokens"):
            client.completions.create(model="bundle", prompt="Hello world " * 100, max_tokens=4)
    finally:
        server.send_signal(signal.SIGINT)
        out, err = server.communicate(timeout=300)
    assert server.returncode == 0, err[-4000:]
    _unchanged(bundle)


_ECHO_THEN_ANSWER = """
import pathlib, socket, sys
sock = socket.create_server(("127.0.0.1", int(sys.argv[1])))
sock.settimeout(60)                     # a poller that never comes back: exit, failing the test
pathlib.Path(sys.argv[2]).write_text("")
conn, _ = sock.accept()                 # what a poll that connected to itself reads: its own request
conn.sendall(conn.recv(65536))
conn.close()
conn, _ = sock.accept()                 # then the server answers
conn.recv(65536)
conn.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\nConnection: close\\r\\n\\r\\n{}")
conn.close()
"""


def test_a_readiness_poll_that_reads_no_http_answer_polls_again(tmp_path):
    """qbuild announces a server once its URL answers. A poll of a port nobody listens on yet, in the ephemeral range,
    can be given that port as its own source port and connect to itself (Linux's TCP self-connect), reading back its
    own request; here a listener plays that by echoing the first poll. The poll counts it as no answer and polls again,
    and the server is announced once it answers. Before, the announcing thread died of the BadStatusLine and the
    server was never announced."""
    from qbuild.backends.base import ServeOptions
    from qbuild.backends.neuron.server_process import _wait, free_ports

    port = free_ports("127.0.0.1", 1)[0]
    child = subprocess.Popen([sys.executable, "-c", _ECHO_THEN_ANSWER, str(port), str(tmp_path / "listening")])
    try:
        url = f"http://127.0.0.1:{port}/v1"
        wait_until(lambda: child.poll() is not None or (tmp_path / "listening").exists(), 60, "the listener")
        ready = []
        _wait([child], [url], ServeOptions(name="m", host="127.0.0.1", port=port, log=lambda s: None,
                                           on_ready=ready.append))
        assert ready == [url] and child.returncode == 0
    finally:
        if child.poll() is None:
            child.kill()



def test_ports_picked_for_a_server_lie_below_the_ephemeral_range():
    """qbuild polls a port it picked before the server listens on it; below the kernel's ephemeral range no outgoing
    connection is given that port as its source, so the poll cannot connect to itself and hold it."""
    from qbuild.backends.neuron.server_process import EPHEMERAL_RANGE, LOWEST_PORT, free_ports

    if not EPHEMERAL_RANGE.exists():
        pytest.skip("no Linux ephemeral port range to stay below")
    low = int(EPHEMERAL_RANGE.read_text().split()[0])
    ports = free_ports("127.0.0.1", 3)
    assert len(set(ports)) == 3 and all(LOWEST_PORT <= p < low for p in ports), (ports, low)
