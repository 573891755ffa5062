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
from tests.nxdi_double import MAIN_PORT, MOE_PORT, SITE, read_log, settings_dir
from tests.test_neuron_double import Build, compiled, require_bundle, write_recipe

pytestmark = pytest.mark.xdist_group("neuron-serve")

TEXT = {"batch_size": 1, "seq_len": 128, "cte_buckets": [32, 64], "tkg_buckets": [128]}


def _bundle(root: Path, checkpoint: Path, port_dir: Path, **changes) -> tuple[Build, Path]:
    """A tiny neuron recipe built with the double (verify left for a device) and pulled into root/bundle."""
    build = Build(root)
    build.recipe = write_recipe(root / "recipes" / "serve.yaml", checkpoint, port_dir, text=TEXT, **changes)
    build.result, build.stderr = build.compile(build.recipe)
    compiled(build.result, build.stderr)
    require_bundle(build.result, build.stderr)
    bundle = root / "bundle"
    pulled = build.cli("pull", "serve", "--to", str(bundle), "--allow-unverified")
    assert pulled.returncode == 0, pulled.stderr
    return build, bundle


@pytest.fixture(scope="module")
def dense(tmp_path_factory, small_checkpoints) -> tuple[Build, Path]:
    """The tiny Qwen3.5 on the main lineage, tp 2, CTE buckets 32 and 64 under seq_len 128."""
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
    # The largest CTE bucket, not seq_len (128) nor the largest TKG bucket (128): NxDI refuses longer prompts.
    assert flag(command, "--max-model-len") == "64" and doc["max_model_len"] == 64
    assert flag(command, "--tensor-parallel-size") == "2"
    assert flag(command, "--max-num-seqs") == "1" and flag(command, "--num-gpu-blocks-override") == "1"
    assert flag(command, "--dtype") == "bfloat16"
    assert flag(command, "--host") == "0.0.0.0" and flag(command, "--port") == "8123"
    assert {"--no-enable-prefix-caching", "--no-enable-chunked-prefill"} <= set(command)
    assert "--block-size" not in command and "--enable-prefix-caching" not in command
    assert doc["url"] == "http://0.0.0.0:8123/v1"

    assert env["NEURON_COMPILED_ARTIFACTS"] == str(bundle)
    assert env["VLLM_PLUGINS"].split(",") == ["neuron", "qbuild_bundle"]
    assert "VLLM_NEURON_FRAMEWORK" not in env
    glue, port = (Path(p) for p in env["PYTHONPATH"].split(os.pathsep))
    assert glue == bundle / "vllm" and (glue / "qbuild_vllm_plugin.py").is_file()
    assert port == bundle / "port"     # main lineage: `import src.modeling_qwen35` from the port directory
    record = json.loads((bundle / "qbuild-neuron.json").read_text())
    assert {k: env[k] for k in record["config"]["env"]} == record["config"]["env"]
    assert env["NEURON_LOGICAL_NC_CONFIG"] == "2"


@pytest.mark.slow
def test_dry_run_of_a_recipe_and_of_a_copied_bundle(dense, tmp_path):
    """A recipe's bundle is served under the recipe's name; a bundle copied elsewhere serves from where it is now."""
    build, bundle = dense
    by_recipe = dry_run(build, str(build.recipe), "--allow-unverified")
    assert flag(by_recipe["command"], "--served-model-name") == "serve"
    assert flag(by_recipe["command"], "--max-model-len") == "64"
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


# What vllm-neuron does with NxDI (neuronx_distributed_model_loader.py @ a5ef7c8), with vLLM's plugin loading
# (vllm/plugins/__init__.py @ 0142555) in front: the general plugins of every distribution on sys.path, filtered by
# VLLM_PLUGINS. vLLM itself is not there, so its architecture registry is left out.
VLLM_NEURON_LOAD = """
import importlib.metadata, json, os, sys
allowed = os.environ["VLLM_PLUGINS"].split(",")
plugins = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins") if ep.name in allowed]
assert [ep.name for ep in plugins] == ["qbuild_bundle"], plugins
plugin = sys.modules[plugins[0].load().__module__]
spec = plugin.load_spec()
for _ in range(2):   # vLLM loads its plugins once per process, in several processes: registering twice is harmless
    plugin.add_port_to_path(spec)
    plugin.register_hf_config(spec)
    plugin.register_nxdi_model(spec)

from neuronx_distributed_inference.utils.constants import MODEL_TYPES
from neuronx_distributed_inference.utils.hf_adapter import load_pretrained_config
from transformers import AutoConfig

model_dir = sys.argv[1]
hf = AutoConfig.from_pretrained(model_dir)
arch = hf.architectures[0]                                            # L612-631
kv_heads, head_dim = getattr(hf, "num_key_value_heads", None), getattr(hf, "head_dim", None)
assert kv_heads and head_dim, "missing required fields in the pretrained config"
model, task = arch.split("For", 1)                                    # L639-653
task = "CausalLM" if task == "ConditionalGeneration" else task
cls = MODEL_TYPES[model.lower()]["causal-lm"]
nc = cls.get_neuron_config_cls()(tp_degree=int(sys.argv[2]), batch_size=1, seq_len=int(sys.argv[3]),
                                 max_context_length=int(sys.argv[3]), torch_dtype="bfloat16")
config = cls.get_config_cls()(nc, load_config=load_pretrained_config(model_dir))   # L162-167
app = cls(os.environ["NEURON_COMPILED_ARTIFACTS"])                                # L214-218
app.load(os.environ["NEURON_COMPILED_ARTIFACTS"])
print(json.dumps({"class": f"{cls.__module__}.{cls.__name__}", "kv_heads": kv_heads, "head_dim": head_dim,
                  "config_head_dim": config.head_dim}))
"""


def _as_vllm_neuron(build: Build, bundle: Path, doc: dict, log: Path) -> subprocess.CompletedProcess:
    """VLLM_NEURON_LOAD in the environment `qbuild serve` gives vLLM, the double's NxDI on the path behind it, its
    settings (the call log `log`, the HF checkpoint its load checks shard values against) just before it."""
    env = dict(os.environ, **doc["env"])
    settings = settings_dir(log.parent / f"{log.stem}-settings", log=log, checkpoint=build.checkpoint)
    env["PYTHONPATH"] = os.pathsep.join((doc["env"]["PYTHONPATH"], str(settings), str(SITE), str(REPO)))
    return subprocess.run([sys.executable, "-c", VLLM_NEURON_LOAD, str(bundle), flag(doc["command"],
                           "--tensor-parallel-size"), flag(doc["command"], "--max-model-len")],
                          env=env, capture_output=True, text=True, timeout=300, cwd=build.root)


def _loaded(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_bundle_plugin_registers_the_port_class_for_vllm_neuron(dense, tmp_path):
    """The bundle's own plugin, found as vLLM finds general plugins, registers the port's class under the name
    vllm-neuron derives from the architecture; the port's InferenceConfig then validates from the flattened
    config.json, and the compiled directory loads, all from the bundle's own copy of the port."""
    build, bundle = dense
    doc = dry_run(build, str(bundle))
    out = _loaded(_as_vllm_neuron(build, bundle, doc, tmp_path / "nxdi.jsonl"))
    assert out["class"] == "src.modeling_qwen35.NeuronQwen35ForCausalLM"
    text = json.loads((bundle / "config.json").read_text())["text_config"]
    assert out["kv_heads"] == text["num_key_value_heads"] and out["config_head_dim"] == text["head_dim"]
    calls = read_log(tmp_path / "nxdi.jsonl")
    (load,) = [c for c in calls if c["call"] == "load"]
    assert load["ranks"] == [0, 1]
    port_files = {Path(c["files"][out["class"]]) for c in calls if out["class"] in c.get("files", {})}
    assert port_files == {bundle / "port" / "src" / "modeling_qwen35.py"}


@pytest.mark.slow
def test_the_checkpoint_config_is_what_vllm_neuron_would_refuse(dense, small_checkpoints, tmp_path):
    """The check above can fail: with the checkpoint's own nested config.json in the bundle's place, vllm-neuron's
    first read finds no num_key_value_heads at the top level."""
    build, bundle = dense
    copy = Path(shutil.copytree(bundle, tmp_path / "bundle"))
    (copy / "config.json").unlink()
    shutil.copy(small_checkpoints["qwen3_5"] / "config.json", copy / "config.json")
    proc = _as_vllm_neuron(build, copy, dry_run(build, str(copy)), tmp_path / "nxdi.jsonl")
    assert proc.returncode != 0 and "missing required fields in the pretrained config" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_moe_lineage_bundle_serves_from_the_port_src(small_checkpoints, tmp_path):
    """Coder-Next's lineage: its flat config.json is left as it is, its src/ goes on PYTHONPATH, and its class is
    registered under "qwen3next" (vllm/register_model.py L26, PR 170 @ 753c7f5)."""
    build, bundle = _bundle(tmp_path, small_checkpoints["qwen3_next"], MOE_PORT, fused_qkv=True,
                            moe_backend="shard_on_block", port={"lineage": "moe"})
    assert "text_config" not in json.loads((bundle / "config.json").read_text())
    doc = dry_run(build, str(bundle))
    assert doc["env"]["PYTHONPATH"].split(os.pathsep) == [str(bundle / "vllm"), str(bundle / "port" / "src")]
    out = _loaded(_as_vllm_neuron(build, bundle, doc, tmp_path / "nxdi.jsonl"))
    assert out["class"] == "modeling_qwen35_moe.NeuronQwen35MoeForCausalLM"


@pytest.mark.slow
def test_serving_without_vllm_is_one_line_exit_3(dense):
    build, bundle = dense
    proc = build.cli("serve", str(bundle), "--port", "0")
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: serving a neuron bundle needs vLLM") and "--dry-run" in lines[-1]
    assert "Traceback" not in proc.stderr and proc.stdout == ""


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
    from qbuild.store.bundle import write_manifest

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


def test_the_plugin_registers_a_config_class_only_where_transformers_has_none(tmp_path):
    """A model type transformers does not know gets a permissive class whose text_config is a config object (what
    vllm-neuron's get_text_config().vocab_size needs); one it knows is left to transformers."""
    from transformers import AutoConfig, PretrainedConfig

    from qbuild.backends.neuron import vllm_plugin
    from qbuild.backends.neuron.package import flat_config

    known = type(AutoConfig.for_model("qwen3_5"))
    vllm_plugin.register_hf_config({"model_type": "qwen3_5", "text_model_type": "qwen3_5_text"})
    assert type(AutoConfig.for_model("qwen3_5")) is known

    model_type = f"qbuild_test_{tmp_path.name.replace('-', '_').lower()}"
    spec = {"model_type": model_type, "text_model_type": f"{model_type}_text"}
    for _ in range(2):   # once per vLLM process, and harmless again
        vllm_plugin.register_hf_config(spec)
    text = {"model_type": spec["text_model_type"], "vocab_size": 11, "num_key_value_heads": 2, "head_dim": 8}
    (tmp_path / "config.json").write_text(json.dumps(flat_config({"model_type": model_type, "text_config": text,
                                                                 "architectures": ["TestForCausalLM"]})))
    config = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(config.text_config, PretrainedConfig)
    assert config.get_text_config().vocab_size == 11 and config.num_key_value_heads == 2 and config.head_dim == 8


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
    main lineage), with the real SDK and vLLM's Neuron plugin: the OpenAI client completes a request, and Ctrl-C
    stops the server with exit 0."""
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
    built = qbuild("compile", str(recipe), "--lock", str(tmp_path / "artifacts.lock"), env=env, timeout=7200)
    assert built.returncode == 0, built.stderr[-4000:]
    ready = tmp_path / "url"
    server = subprocess.Popen([sys.executable, "-m", "qbuild.cli", "serve", str(recipe), "--port", "0",
                              "--ready-file", str(ready), "--lock", str(tmp_path / "artifacts.lock")],
                             env=dict(os.environ, **env, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        url = wait_until(lambda: ready.exists() and ready.read_text().strip(), 1800, "vLLM to answer /v1/models")
        client = openai.OpenAI(base_url=url, api_key="unused")
        reply = client.completions.create(model="serve", prompt="Hello world", max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens >= 1 and reply.choices[0].finish_reason in ("stop", "length")
    finally:
        server.send_signal(signal.SIGINT)
        out, err = server.communicate(timeout=300)
    assert server.returncode == 0, err[-4000:]
