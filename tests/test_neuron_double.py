"""The neuron backend end to end through the CLI, against the NxDI contract double (tests/nxdi_double).

The Neuron SDK does not install on a CPU host. The double plays its public surface (NeuronConfig, the application's
compile and load, the metaneff, torch_neuronx.trace, the HF generation adapter) strictly, records every call in the
log its settings name (tests.nxdi_double.settings_dir), and ships two fake ports, one per lineage. These tests build
tiny checkpoints with `backend: neuron` and `--skip-device` (verify needs NeuronCores) and assert what reached the SDK:
the configuration, the environment, the compiler arguments, the compile cache, and that the bundle loads as NxDI's
compiled directory.
Packaging checks every shard against the weights the double's metaneff names (NxD's keys and per-rank shapes, derived
by the fake ports from docs/nxdi.md section 4), so a bundle that packages carries shards in NxD's exact format.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from qbuild.backends.neuron.releases import RELEASES
from tests.conftest import REPO, qbuild
from tests.nxdi_double import (MAIN_PORT, MAIN_SUBDIR, MOE_PORT, ROOT, SITE, metadata_overlay, port_repository,
                                read_log, replicated_deltanet_port, settings_dir)

# One worker takes the whole file, so the module-scoped build `dense` is built once.
pytestmark = pytest.mark.xdist_group("neuron-double")

TOOLCHAIN = yaml.safe_load((REPO / "recipes/bases/trn2.yaml").read_text())["toolchain"]
RECIPE_FLAG = "--enable-fast-loading-neuron-binaries"    # any recipe flag: it must reach get_compiler_args()
PORT_ARGS = ("--enable-saturate-infinity --enable-mixed-precision-accumulation --model-type transformer -O1 "
             "--auto-cast=none")    # contrib/models/Qwen3.5-35B-A3B/src/modeling_qwen35.py get_compiler_args @ 4bcdc54
MOE_PORT_ARGS = PORT_ARGS + " --internal-enable-dge-levels vector_dynamic_offsets"   # Coder-Next PR 170 @ 753c7f5
# The switches a recipe with vision sets for the main ports (run_vl_smoke.py:41-42 @ 4bcdc54; qbuild.backends.neuron.
# ports.VL_PORT_ENV): without them qbuild refuses it, and the double's port refuses to trace image features.
VL_ENV = {"QWEN36_DELTANET_CTE_IMPL": "legacy_direct", "QWEN36_DELTANET_MULTIHEAD_CTE": "0"}
def _pythonpath(sdk: bool = True, overlay: tuple[Path, ...] = ()) -> str:
    """The CLI's PYTHONPATH: the double's settings and version overlays, the double's site (when the SDK should be
    there), this checkout."""
    parts = [*overlay, SITE] if sdk else list(overlay)
    return os.pathsep.join(str(p) for p in (*parts, REPO))


def write_recipe(path: Path, checkpoint: Path, port_dir: Path | None, **changes) -> Path:
    """A tiny neuron recipe (JSON is YAML): the shipped toolchain pins, tp 2, tiny buckets, thresholds that pass any
    output (the double cannot compute), short prompts that fit the buckets. `changes` replace top-level fields;
    a `text` or `port` mapping is merged (without `port_dir`, `port` names the port: a git port)."""
    doc = {"model": {"path": str(checkpoint)}, "backend": "neuron", "port": {"path": str(port_dir)} if port_dir else {},
           "parallel": {"tp": 2}, "dtype": "bfloat16",
           "text": {"batch_size": 1, "seq_len": 128, "cte_buckets": [32, 64], "tkg_buckets": [64]},
           "compiler": {"target": "trn2", "lnc": 2, "flags": [RECIPE_FLAG]}, "toolchain": TOOLCHAIN,
           "verify": {"top1_min": 0, "token_match_min": 0, "max_logit_err": 1e9, "new_tokens": 4,
                      "prompts": ["Hello world", "The quick brown fox"], "image_prompt": False}}
    for key, value in changes.items():
        doc[key] = {**doc[key], **value} if key in ("text", "port") else value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    return path


@dataclass
class Build:
    """One store with its lockfile, the double's log and the Neuron work-dir root; `cli` runs qbuild against them."""

    root: Path
    recipe: Path | None = None       # the recipe the fixture built, its result document and stderr
    result: dict | None = None
    stderr: str = ""

    @property
    def store(self) -> Path:
        return self.root / "store"

    @property
    def lock(self) -> Path:
        return self.root / "artifacts.lock"

    @property
    def log(self) -> Path:
        return self.root / "nxdi-double.jsonl"

    @property
    def work(self) -> Path:
        return self.root / "nxd-work"

    @property
    def checkpoint(self) -> Path | None:
        """The HF checkpoint the fixture's recipe builds from (the double's load checks shard values against it)."""
        return Path(yaml.safe_load(self.recipe.read_text())["model"]["path"]) if self.recipe else None

    def env(self, sdk: bool = True, overlay: tuple[Path, ...] = (), log: Path | None = None,
            barrier: str | None = None, checkpoint: Path | None = None, load_error: str | None = None,
            **extra) -> dict:
        """The CLI's environment: the double's settings (its call log: `log`, else this build's; the HF checkpoint
        load() checks values against: `checkpoint`, else the fixture recipe's; a failure load() injects) first on
        PYTHONPATH, the work-dir root, no network."""
        log = log or self.log
        checkpoint = checkpoint or self.checkpoint
        key = hashlib.sha256(f"{log}|{barrier}|{checkpoint}|{load_error}".encode()).hexdigest()[:12]
        settings = settings_dir(self.root / "double-settings" / key, log=log, barrier=barrier, checkpoint=checkpoint,
                                load_error=load_error)
        return {"PYTHONPATH": _pythonpath(sdk, (settings, *overlay)), "QBUILD_NEURON_WORKDIR": str(self.work),
                "HF_HUB_OFFLINE": "1", "HF_HOME": str(self.root / "hf"), "XDG_CACHE_HOME": str(self.root / "xdg"),
                **extra}

    def cli(self, *args: str, lock: Path | None = None, sdk: bool = True, overlay: tuple[Path, ...] = (),
            log: Path | None = None, **extra) -> subprocess.CompletedProcess:
        return qbuild(*self.args(args, lock), env=self.env(sdk, overlay, log, **extra))

    def args(self, args: tuple[str, ...], lock: Path | None = None) -> list[str]:
        """`args` with this build's store and lockfile, before a `--` (what follows it is handed to vLLM)."""
        cut = args.index("--") if "--" in args else len(args)
        return [*args[:cut], "--store", str(self.store), "--lock", str(lock or self.lock), *args[cut:]]

    def compile(self, recipe: Path, *flags: str, lock: Path | None = None, **kw) -> tuple[dict, str]:
        """`qbuild compile --skip-device --json`: (the result document, stderr)."""
        proc = self.cli("compile", str(recipe), "--skip-device", "--json", "-j", "2", *flags, lock=lock, **kw)
        assert proc.stdout.strip(), f"no result (exit {proc.returncode}):\n{proc.stderr}"
        return json.loads(proc.stdout), proc.stderr

    def calls(self, name: str) -> list[dict]:
        return [c for c in read_log(self.log) if c["call"] == name]

    def cache_entries(self) -> list[Path]:
        """The compile cache's entries: <pin>/<target>/<group>/neuronxcc-<version>/MODULE_<key>."""
        return sorted((self.store / "neuron-compile-cache").glob("*/*/*/neuronxcc-*/MODULE_*"))

    def node_outputs(self, recipe: str, role: str, dest: Path) -> Path:
        """A locked node's outputs laid out in `dest` (hardlinks from the store)."""
        from qbuild.store.local import LocalStore

        doc = json.loads(self.lock.read_text())
        outputs = doc["nodes"][doc["recipes"][recipe]["nodes"][role]]["outputs"]
        LocalStore(self.store).materialize(outputs, dest)
        return dest


def compiled(result: dict, stderr: str = "") -> None:
    """The text compile of a build succeeded (built now or found in the store)."""
    names = [n for n in result["built"] + result["cached"] if n.startswith("compile text")]
    assert len(names) == 1, f"no text compile: {json.dumps(result, indent=1)}\n{stderr}"


def require_bundle(result: dict, stderr: str = "") -> None:
    """The build packaged its bundle (packaging refuses shards the compiled model does not take)."""
    assert not result["failed"], f"build failed: {json.dumps(result['failed'], indent=1)}\n{stderr}"
    names = [n for n in result["built"] + result["cached"] if n.startswith("package")]
    assert len(names) == 1, f"no package step: {json.dumps(result, indent=1)}\n{stderr}"


_LOAD_SCRIPT = """
import importlib, json, sys
module, app_class, port, dirs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
sys.path.insert(0, port)
app = getattr(importlib.import_module(module), app_class)
out = []
for d in dirs:
    try:
        app(d).load(d)
        out.append("ok")
    except Exception as e:
        out.append(f"{type(e).__name__}: {e}")
print(json.dumps(out))
"""


def load_bundles(build: Build, bundle: Path, *others: Path, checkpoint: Path | None = None,
                 log: Path | None = None) -> list[str]:
    """`App(dir).load(dir)` of `bundle` and of each of `others` (copies of it), with the port's class from the
    bundle's own copy of the port and its compile environment, in one fresh interpreter: "ok" or the error's line per
    directory. The double checks every shard's names, shapes, dtypes and values (against `checkpoint`, else the
    build's recipe's)."""
    from qbuild.backends.neuron.ports import LINEAGES

    record = json.loads((bundle / "qbuild-neuron.json").read_text())
    cfg = record["config"]
    port = LINEAGES[cfg["lineage"]].module_dir(bundle / "port")
    env = dict(os.environ, **build.env(log=log or build.root / "load.jsonl", checkpoint=checkpoint), **cfg["env"])
    proc = subprocess.run([sys.executable, "-c", _LOAD_SCRIPT, cfg["module"], cfg["app_class"], str(port),
                           *(str(d) for d in (bundle, *others))], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def dense(tmp_path_factory, small_checkpoints):
    """The tiny Qwen3.5 (main lineage) built once with the double: text buckets cte [32, 64] / tkg [64], vision 64."""
    build = Build(tmp_path_factory.mktemp("neuron-dense"))
    build.recipe = write_recipe(build.root / "recipes" / "dense.yaml", small_checkpoints["qwen3_5"], MAIN_PORT,
                                vision={"buckets": [64]}, port={"env": VL_ENV})
    build.result, build.stderr = build.compile(build.recipe)
    compiled(build.result, build.stderr)
    return build


def _compile_call(build: Build, index: int = 0) -> dict:
    calls = build.calls("compile")
    assert calls, "the double recorded no compile"
    return calls[index]


# --- the text compile ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_one_compile_builds_every_bucket_of_both_submodels(dense):
    """One NxDI compile per text bundle, with bucketing on and both lists explicit (never auto-generated), every
    bucket compiled, token-generation bucket 0 first; sharding skipped inside compile (qbuild's shard step writes
    weights/)."""
    assert len(dense.calls("compile")) == 1
    configs = [c for c in dense.calls("NeuronConfig") if not c["load_path"]]
    assert len(configs) == 1 and configs[0]["cls"] == "NeuronConfig"
    kwargs = configs[0]["kwargs"]
    assert kwargs["enable_bucketing"] is True
    assert kwargs["context_encoding_buckets"] == [32, 64] and kwargs["token_generation_buckets"] == [64]
    assert kwargs["max_context_length"] == 64 and kwargs["max_length"] == 128 and kwargs["seq_len"] == 128
    assert kwargs["tp_degree"] == 2 and kwargs["torch_dtype"] == "bfloat16" and kwargs["logical_nc_config"] == 2
    assert kwargs["save_sharded_checkpoint"] is True and kwargs["skip_sharding"] is True
    call = _compile_call(dense)
    subs = {s["tag"]: s for s in call["submodels"]}
    assert subs["context_encoding_model"]["buckets"] == [32, 64]
    assert subs["token_generation_model"]["buckets"] == [64]
    assert not any(s["auto_buckets"] for s in subs.values())
    order = [(n["tag"], n["bucket"]) for n in call["neffs"]]
    assert order == [("token_generation_model", 64), ("context_encoding_model", 32), ("context_encoding_model", 64)]
    # A bundle with a vision encoder: its context encoding takes the image features, token generation never does.
    assert [n["traced"]["vision_inputs"] for n in call["neffs"]] == [False, True, True]
    assert [c["skipped"] for c in dense.calls("shard_weights")] == ["skip_sharding"]
    # The vision encoder: one torch_neuronx.trace of the port's CPUVisionModel per bucket, weights in the model dtype.
    (trace,) = dense.calls("torch_neuronx.trace")
    assert trace["module"] == "src.modeling_qwen35_vision.CPUVisionModel"
    assert [i["shape"] for i in trace["example_inputs"]] == [[64, 32], [1, 1, 64, 64], [64, 16], [64, 16]]
    assert trace["parameter_dtypes"] == ["bfloat16"]


@pytest.mark.slow
def test_compile_environment(dense):
    """What the compile subprocess saw: its own absolute work dir under QBUILD_NEURON_WORKDIR (made 0700), the store's
    compile cache for the recipe's neuronx-cc pin and target, LNC and target set before NxDI was imported, and the
    port directory (not src/) first on sys.path."""
    call = _compile_call(dense)
    env = call["env"]
    work_dir = Path(env["BASE_COMPILE_WORK_DIR"])
    assert work_dir.is_absolute() and work_dir.parent == dense.work and dense.work.stat().st_mode & 0o777 == 0o700
    cache = Path(env["NEURON_COMPILE_CACHE_URL"])
    pin = RELEASES[TOOLCHAIN["sdk"]]["neuronx-cc"]
    assert cache.parent == dense.store.resolve() / "neuron-compile-cache" / pin / "trn2"
    assert env["NEURON_LOGICAL_NC_CONFIG"] == "2" and env["NEURON_PLATFORM_TARGET_OVERRIDE"] == "trn2"
    (init,) = dense.calls("app_init")
    port_module = Path(init["files"]["src.modeling_qwen35.NeuronQwen35ForCausalLM"])
    assert port_module.parent.parent == Path(call["sys_path"][0]) and port_module.name == "modeling_qwen35.py"
    assert Path(call["cwd"]) != work_dir and not Path(call["cwd"]).is_relative_to(work_dir)
    entries = {Path(n["cache_entry"]) for n in call["neffs"]}
    assert len(entries) == 3 and entries <= set(dense.cache_entries())


@pytest.mark.slow
def test_recipe_compiler_args_reach_get_compiler_args(dense):
    """get_compiler_args() answers with the lineage's arguments, --target and --lnc (NxDI adds neither when the app
    returns its own) and the recipe's flags, for both submodels; the flags NxD hashes carry the absolute logfile."""
    answers = {c["tag"]: c["returned"] for c in dense.calls("get_compiler_args")}
    expected = f"{PORT_ARGS} --target=trn2 --lnc=2 {RECIPE_FLAG}"
    assert answers == {"context_encoding_model": expected, "token_generation_model": expected}
    call = _compile_call(dense)
    assert "src.modeling_qwen35.NeuronQwen35ForCausalLM" in (dense.calls("app_init")[0]["mro"])
    for neff in call["neffs"]:
        assert neff["flags"].startswith(expected)
        assert f"--logfile={neff['dir']}/log-neuron-cc.txt" in neff["flags"]


@pytest.mark.slow
def test_neuron_config_json_survives_into_the_bundle(dense, tmp_path):
    """NxDI's neuron_config.json (what load() reads back) reaches the bundle byte for byte; qbuild keeps its own record
    beside it as qbuild-neuron.json."""
    require_bundle(dense.result, dense.stderr)
    bundle = tmp_path / "bundle"
    pulled = dense.cli("pull", "dense", "--to", str(bundle), "--allow-unverified")
    assert pulled.returncode == 0, pulled.stderr
    compiled_dir = dense.node_outputs("dense", "compile text", tmp_path / "compiled")
    assert (bundle / "neuron_config.json").read_bytes() == (compiled_dir / "neuron_config.json").read_bytes()
    saved = json.loads((bundle / "neuron_config.json").read_text())
    assert saved["neuron_config"]["context_encoding_buckets"] == [32, 64] and "params" not in saved
    record = json.loads((bundle / "qbuild-neuron.json").read_text())
    assert record["config"]["app_class"] == "NeuronQwen35ForCausalLM" and record["params"]["graph"] == "text"


@pytest.mark.slow
def test_concurrent_builds_get_distinct_work_dirs(dense, tmp_path):
    """Two CLI processes compiling at the same time (the double holds both inside trace until both arrived) use two
    work dirs and two working directories: trace() wipes its work dir, and NxD writes temp HLOs into the cwd."""
    recipes = [write_recipe(tmp_path / "conc-a.yaml", Path(json.loads(dense.recipe.read_text())["model"]["path"]),
                            MAIN_PORT, fused_qkv=True),
               write_recipe(tmp_path / "conc-b.yaml", Path(json.loads(dense.recipe.read_text())["model"]["path"]),
                            MAIN_PORT, port={"env": {"QWEN36_DELTANET_CTE_IMPL": "legacy_direct"}})]
    log = tmp_path / "concurrent.jsonl"
    env = dict(os.environ, **dense.env(log=log, barrier=f"{tmp_path / 'barrier'}:2"))
    procs = [subprocess.Popen([sys.executable, "-m", "qbuild.cli", "compile", str(r), "--skip-device", "--json",
                               "--store", str(dense.store), "--lock", str(tmp_path / f"{r.stem}.lock")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in recipes]
    outs = [p.communicate(timeout=600) for p in procs]
    for (out, err) in outs:
        assert out.strip(), err
        compiled(json.loads(out), err)
    calls = [c for c in read_log(log) if c["call"] == "compile"]
    assert len(calls) == 2 and calls[0]["pid"] != calls[1]["pid"]
    assert calls[0]["env"]["BASE_COMPILE_WORK_DIR"] != calls[1]["env"]["BASE_COMPILE_WORK_DIR"]
    assert calls[0]["cwd"] != calls[1]["cwd"]
    # The port's switch reached the trace of the recipe that set it, and only that one.
    by_fused = {c["config"]["neuron_config"]["fused_qkv"]: c for c in calls}
    assert by_fused[False]["env"]["QWEN36_DELTANET_CTE_IMPL"] == "legacy_direct"
    assert "QWEN36_DELTANET_CTE_IMPL" not in by_fused[True]["env"]
    # Text-only recipes: no graph takes vision inputs.
    assert not any(n["traced"]["vision_inputs"] for c in calls for n in c["neffs"])


@pytest.mark.slow
def test_adding_a_bucket_compiles_one_neff(dense, tmp_path):
    """Adding a token-generation bucket after the others keeps the work dir and the compile cache: the next compile
    finds the three NEFFs it had and adds exactly one, as `qbuild explain` says beforehand (and says "3 new" when
    an inserted bucket shifts others)."""
    lock = tmp_path / "artifacts.lock"
    shutil.copyfile(dense.lock, lock)
    checkpoint = Path(json.loads(dense.recipe.read_text())["model"]["path"])
    recipe = write_recipe(tmp_path / "dense.yaml", checkpoint, MAIN_PORT, vision={"buckets": [64]},
                          port={"env": VL_ENV}, text={"tkg_buckets": [64, 128]})
    explained = dense.cli("explain", str(recipe), lock=lock)
    assert explained.returncode == 0, explained.stderr
    (line,) = [ln for ln in explained.stdout.splitlines() if ln.startswith("compile text")]
    assert "1 new NEFF (tkg-128), 3 reused from the Neuron compile cache" in line, explained.stdout
    before = dense.cache_entries()
    log = tmp_path / "log.jsonl"
    result, stderr = dense.compile(recipe, lock=lock, log=log)
    compiled(result, stderr)
    assert len(dense.cache_entries()) == len(before) + 1
    first = _compile_call(dense)
    (second,) = [c for c in read_log(log) if c["call"] == "compile"]
    assert second["env"]["NEURON_COMPILE_CACHE_URL"] == first["env"]["NEURON_COMPILE_CACHE_URL"]
    assert second["env"]["BASE_COMPILE_WORK_DIR"] == first["env"]["BASE_COMPILE_WORK_DIR"]
    misses = [(n["tag"], n["bucket"]) for n in second["neffs"] if not n["hit"]]
    assert misses == [("token_generation_model", 128)] and len(second["neffs"]) == 4
    # A bucket inserted BEFORE others moves them to another _tp0_bk<i>, hence another --logfile in their hashed flags:
    # those recompile too, and explain says so.
    recipe = write_recipe(tmp_path / "dense.yaml", checkpoint, MAIN_PORT, vision={"buckets": [64]},
                          port={"env": VL_ENV}, text={"cte_buckets": [16, 32, 64], "tkg_buckets": [64, 128]})
    explained = dense.cli("explain", str(recipe), lock=lock)
    (line,) = [ln for ln in explained.stdout.splitlines() if ln.startswith("compile text")]
    assert "3 new NEFFs (cte-16, cte-32, cte-64), 2 reused from the Neuron compile cache" in line, explained.stdout
    before = dense.cache_entries()
    result, stderr = dense.compile(recipe, lock=lock, log=log)
    compiled(result, stderr)
    assert len(dense.cache_entries()) == len(before) + 3
    third = [c for c in read_log(log) if c["call"] == "compile"][-1]
    assert sorted((n["tag"], n["bucket"]) for n in third["neffs"] if not n["hit"]) == \
        [("context_encoding_model", 16), ("context_encoding_model", 32), ("context_encoding_model", 64)]


@pytest.mark.slow
def test_bundle_loads_with_the_port_class(dense, tmp_path):
    """`App(dir).load(dir)` with the port's class from the bundle's own copy of the port: NxDI's load reads every
    rank's weights/tp{r}_sharded_checkpoint.safetensors and takes them only in the names and shapes it compiled."""
    require_bundle(dense.result, dense.stderr)
    bundle = tmp_path / "bundle"
    assert dense.cli("pull", "dense", "--to", str(bundle), "--allow-unverified").returncode == 0
    assert load_bundles(dense, bundle, log=tmp_path / "load.jsonl") == ["ok"]
    (load,) = [c for c in read_log(tmp_path / "load.jsonl") if c["call"] == "load"]
    assert load["ranks"] == [0, 1] and load["values_checked"] is True and load["values_unstated"] == []


# --- the moe lineage ---------------------------------------------------------------------------------------------

# The Coder-Next build as validated (README L66, test/integration/test_model.py L123 @ 753c7f5:
# NEURON_CC_FLAGS='--auto-cast matmult --auto-cast-type bf16'), the port's own `--auto-cast=none` replaced.
CODER_NEXT_ARGS = ("--enable-saturate-infinity --enable-mixed-precision-accumulation --model-type transformer -O1 "
                   "--internal-enable-dge-levels vector_dynamic_offsets --target=trn2 --lnc=2 "
                   "--auto-cast matmult --auto-cast-type bf16")


@pytest.mark.slow
def test_shipped_coder_next_recipe_resolves_the_moe_lineage_and_compiles_with_the_validated_flags(tmp_path):
    """recipes/coder-next-tp8.yaml as shipped (tp 8, its buckets, its SDK 2.30 pins, its compiler flags), with a tiny
    Qwen3-Next for the model (head counts that split over 8 ranks, as the real one's 16 / 2 / 16 / 32 do) and the
    double's moe port for the port. It resolves the moe lineage: src/ on sys.path, the flat module's
    NeuronQwen35MoeForCausalLM with a MoENeuronConfig, the router forced to fp32 softmax, shard-on-block experts, fused
    QKV, moe_tp 8 and ep 1, as PR 170's scripts run it. get_compiler_args() answers exactly the validated arguments
    (the lineage's DGE flag among them), every bucket's neuronx-cc flags hold ONE --auto-cast (matmult) and the bf16
    auto-cast type, and the bundle packages and loads."""
    from qbuild.model.tinymodel import write_tiny_checkpoint

    checkpoint = write_tiny_checkpoint(tmp_path / "qwen3_next", "qwen3_next", text_overrides=dict(
        num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=8, linear_num_value_heads=16))
    doc = yaml.safe_load((REPO / "recipes/coder-next-tp8.yaml").read_text())
    doc["extends"] = str(REPO / "recipes/bases/trn2.yaml")
    doc["model"] = {"path": str(checkpoint)}
    doc["port"] = {"lineage": doc["port"]["lineage"], "path": str(MOE_PORT)}
    recipe = tmp_path / "recipes" / "coder-next-tp8.yaml"
    recipe.parent.mkdir()
    recipe.write_text(yaml.safe_dump(doc))
    pins = RELEASES[doc["toolchain"]["sdk"]]
    overlay = metadata_overlay(tmp_path / "sdk-2.30", {dist: f"{version}+0" for dist, version in pins.items()})
    build = Build(tmp_path / "build", recipe=recipe)
    result, stderr = build.compile(recipe, overlay=(overlay,))
    require_bundle(result, stderr)
    (init,) = build.calls("app_init")
    assert "modeling_qwen35_moe.NeuronQwen35MoeForCausalLM" in init["mro"]
    assert init["config_cls"] == "Qwen35MoeInferenceConfig" and init["neuron_config_cls"] == "MoENeuronConfig"
    port_module = Path(init["files"]["modeling_qwen35_moe.NeuronQwen35MoeForCausalLM"])
    assert port_module.parent == Path(init["sys_path"][0]) and port_module.parent.name == "src"
    (config,) = [c for c in build.calls("NeuronConfig") if not c["load_path"]]
    assert config["cls"] == "MoENeuronConfig"
    assert config["kwargs"]["blockwise_matmul_config"] == {"block_size": 128, "use_shard_on_block_dynamic_while": True,
                                                           "block_sharding_strategy": "PING_PONG",
                                                           "logical_nc_config": 2}
    assert config["kwargs"]["moe_tp_degree"] == 8 and config["kwargs"]["moe_ep_degree"] == 1
    assert {c["returned"] for c in build.calls("get_compiler_args")} == {CODER_NEXT_ARGS}
    (call,) = build.calls("compile")
    nc = call["config"]["neuron_config"]
    assert nc["tp_degree"] == 8 and len(call["neffs"]) == 3
    assert nc["router_config"] == {"act_fn": "softmax", "dtype": "float32"} and nc["fused_qkv"] is True
    for neff in call["neffs"]:
        options = [t.split("=", 1)[0] for t in neff["flags"].split() if t.startswith("--auto-cast")]
        assert options == ["--auto-cast", "--auto-cast-type"], neff["flags"]
        assert " --auto-cast matmult --auto-cast-type bf16 " in f" {neff['flags']} "
    bundle = build.node_outputs("coder-next-tp8", "package", tmp_path / "bundle")
    assert load_bundles(build, bundle, log=tmp_path / "load.jsonl") == ["ok"]


# --- the Qwen3.5-27B port ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_qwen35_27b_port_takes_replicated_deltanet_shards(small_checkpoints, tmp_path, monkeypatch):
    """The Qwen3.5-27B port (PR 128) has the main port's module and classes, but its DeltaNet is whole on every rank.
    The main-replicated lineage packages shards its compiled model takes as they are; the main lineage's
    tensor-parallel DeltaNet shards would not load, and packaging refuses them naming the first such tensor.
    It has no use_text_only_cte_inputs either: its context encoding always takes vision inputs, and a prompt handed
    none loses its last token's embedding (modeling_qwen35.py L2317-2328 @ 550e2ab). verify gives each prompt the
    padding inputs, so none is overwritten; `serve --dry-run` says that vLLM's path keeps the loss."""
    from safetensors import safe_open

    from qbuild.backends.neuron.vllm_serve import TEXT_PROMPT_NOTE
    from qbuild.recipe.params import VerifyParams

    port = replicated_deltanet_port(tmp_path / "Qwen3.5-27B")
    build = Build(tmp_path / "build")
    checkpoint = small_checkpoints["qwen3_5"]
    build.recipe = write_recipe(build.root / "recipes" / "r27.yaml", checkpoint, port,
                                port={"lineage": "main-replicated"})
    result, stderr = build.compile(build.recipe)
    require_bundle(result, stderr)
    (init,) = build.calls("app_init")
    assert "src.modeling_qwen35.NeuronQwen35ForCausalLM" in init["mro"]
    config = json.loads((checkpoint / "config.json").read_text())["text_config"]
    conv_dim = (2 * config["linear_num_key_heads"] * config["linear_key_head_dim"]
                + config["linear_num_value_heads"] * config["linear_value_head_dim"])
    layer = config["layer_types"].index("linear_attention")
    bundle = build.node_outputs("r27", "package", tmp_path / "bundle")
    for rank in range(2):
        with safe_open(bundle / "weights" / f"tp{rank}_sharded_checkpoint.safetensors", "pt") as f:
            la = f"layers.{layer}.linear_attn."
            assert f.get_slice(la + "conv1d.weight").get_shape() == [conv_dim, 1, config["linear_conv_kernel_dim"]]
            assert f.get_slice(la + "A_log").get_shape() == [config["linear_num_value_heads"]]
            assert f.get_slice(la + "in_proj_qkv.weight").get_shape() == [conv_dim, config["hidden_size"]]
    assert load_bundles(build, bundle, log=tmp_path / "load.jsonl") == ["ok"]
    cte = [n["traced"]["vision_inputs"] for n in _compile_call(build)["neffs"] if n["tag"] == "context_encoding_model"]
    assert cte and all(cte)

    (tmp_path / "verify").mkdir()
    done = _verify(build, "r27", tmp_path / "verify", monkeypatch, VerifyParams(top1_min=0.0, token_match_min=0.0,
                                                                                 max_logit_err=1e9))
    contexts = [c for c in read_log(tmp_path / "verify" / "verify.jsonl") if c["call"] == "context_inputs"]
    assert len(contexts) == 2 and all(c["overwritten"] == [] and c.get("dummy") is None for c in contexts)
    for prompt, ref in zip(done["report"]["prompts"], done["reference"]["prompts"]):
        assert prompt["greedy"][0] == sum(ref["ids"]) % config["vocab_size"]
    pulled = build.cli("pull", "r27", "--to", str(tmp_path / "pulled"), "--allow-unverified")
    assert pulled.returncode == 0, pulled.stderr
    served = build.cli("serve", str(tmp_path / "pulled"), "--dry-run", "--json")
    assert served.returncode == 0 and json.loads(served.stdout)["text_prompts"] == TEXT_PROMPT_NOTE, served.stderr

    result, stderr = build.compile(write_recipe(build.root / "recipes" / "r27-main.yaml", checkpoint, port))
    (message,) = [v["error"] for v in result["failed"].values() if v["name"].startswith("package")]
    assert "linear_attn" in message, message


# --- FP8 ---------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_fp8_mlp_only_bundle_holds_exactly_the_weights_its_model_takes(tiny_checkpoints, tmp_path):
    """fp8: mlp_only as the Qwen3.6-27B FP8 port builds it: the inner layers' MLPs in float8_e4m3fn with float32
    per-channel scales, everything else in the model dtype, and no DeltaNet checkpoint banks, which the model takes only
    with the hybrid APC manager, which qbuild turns on for chunked prefill alone (tests/test_neuron_long_context.py).
    Packaging checks every shard against the compiled model."""
    from safetensors import safe_open

    build = Build(tmp_path)
    checkpoint = tiny_checkpoints["qwen3_5"]
    build.recipe = write_recipe(tmp_path / "fp8.yaml", checkpoint, MAIN_PORT, fp8="mlp_only")
    result, stderr = build.compile(build.recipe)
    require_bundle(result, stderr)
    call = _compile_call(build)
    nc = call["config"]["neuron_config"]
    assert nc["quantized"] is True and nc["quantization_dtype"] == "f8e4m3"
    assert call["env"]["XLA_HANDLE_SPECIAL_SCALAR"] == "1" and call["env"]["UNSAFE_FP8FNCAST"] == "1"
    layers = json.loads((checkpoint / "config.json").read_text())["text_config"]["num_hidden_layers"]
    bundle = build.node_outputs("fp8", "package", tmp_path / "bundle")
    for rank in range(2):
        with safe_open(bundle / "weights" / f"tp{rank}_sharded_checkpoint.safetensors", "pt") as f:
            names = set(f.keys())
            assert not any(n.startswith("hybrid_gdn_checkpoint_cache.") for n in names)
            for i in range(layers):
                inner = 0 < i < layers - 1
                assert f.get_slice(f"layers.{i}.mlp.down_proj.weight").get_dtype() == ("F8_E4M3" if inner else "BF16")
                assert (f"layers.{i}.mlp.down_proj.scale" in names) == inner
            assert f.get_slice("layers.1.mlp.gate_proj.scale").get_dtype() == "F32"
    assert load_bundles(build, bundle, log=tmp_path / "load.jsonl") == ["ok"]


# --- the toolchain -----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_mismatching_toolchain_fails_compile_naming_both_versions(dense, tmp_path):
    installed = "0.9.17334+0f1e2d3c"
    overlay = metadata_overlay(tmp_path / "overlay", {"neuronx-distributed-inference": installed})
    lock = tmp_path / "artifacts.lock"
    shutil.copyfile(dense.lock, lock)
    checkpoint = Path(json.loads(dense.recipe.read_text())["model"]["path"])
    recipe = write_recipe(tmp_path / "sdk.yaml", checkpoint, MAIN_PORT, text={"cte_buckets": [16, 64]})
    proc = dense.cli("compile", str(recipe), "--skip-device", lock=lock, overlay=(overlay,),
                     log=tmp_path / "log.jsonl")
    assert proc.returncode == 1, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if installed in ln]
    pinned = RELEASES[TOOLCHAIN["sdk"]]["neuronx-distributed-inference"]
    assert lines and all(pinned in ln for ln in lines), proc.stderr
    assert not [c for c in read_log(tmp_path / "log.jsonl") if c["call"] == "compile"]


def test_shipped_recipe_plans_the_same_with_or_without_the_sdk(tmp_path):
    """recipes/35b-a3b-tp8.yaml (its model pinned to a commit, so that it is keyed offline) plans offline, its git
    port neither fetched nor read by planning, to the same keys whether or not the SDK is importable: keys are made
    from the pins, never from what is installed. With its port fetched from a local repository instead, its compile
    without the SDK fails with one line naming the missing package, and the exit code of a failed step."""
    recipe = tmp_path / "35b-a3b-tp8.yaml"
    doc = yaml.safe_load((REPO / "recipes/35b-a3b-tp8.yaml").read_text())
    doc["extends"] = str(REPO / "recipes/bases/trn2.yaml")
    doc["model"]["revision"] = "0123456789abcdef0123456789abcdef01234567"
    recipe.write_text(yaml.safe_dump(doc))
    build = Build(tmp_path)
    plans = []
    for sdk in (True, False):
        proc = build.cli("plan", str(recipe), "--json", sdk=sdk)
        assert proc.returncode == 0, proc.stderr
        plans.append({n["id"]: (n["key"], n["status"]) for n in json.loads(proc.stdout)["nodes"]})
    assert plans[0] == plans[1]
    repo = port_repository(tmp_path / "nxdi")
    doc["port"].update(git=repo.url, rev=repo.first, subdir=MAIN_SUBDIR)
    recipe.write_text(yaml.safe_dump(doc))
    proc = build.cli("compile", str(recipe), "--keep-going", "--skip-device", "--mem", "1T", sdk=False)
    # Offline, the commit's fetch fails too (infrastructure, exit 3); what matters is the compile's own line.
    assert proc.returncode in (1, 3)
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("FAILED compile text")]
    assert "neuronx-distributed-inference" in line and "not installed" in line


# --- running the bundle ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_skip_device_leaves_verify_unbuilt(dense):
    """On a host without NeuronCores, --skip-device leaves verify unbuilt and says so, and with it the reference,
    which only verify needs; without it, the verify step is refused in one line."""
    require_bundle(dense.result, dense.stderr)
    assert [n for n in dense.result["deferred"] if n.startswith("reference")] == ["reference qwen3_5"]
    skipped = dense.cli("compile", str(dense.recipe), "--skip-device")
    assert skipped.returncode == 0, skipped.stderr
    assert "2 left unbuilt (--skip-device)" in skipped.stderr.splitlines()[-1]
    assert "skip   reference qwen3_5: left unbuilt (--skip-device): only verify dense needs it" in skipped.stderr
    (line,) = [ln for ln in skipped.stderr.splitlines() if ln.startswith("skip   verify dense")]
    assert line.endswith("this host has no Neuron device; run it on a trn host"), line   # no advice to pass the flag
    refused = dense.cli("compile", str(dense.recipe))
    assert refused.returncode == 1
    (line,) = [ln for ln in refused.stderr.splitlines() if ln.startswith("FAILED verify dense")]
    assert "NeuronCores" in line and line.endswith("or pass --skip-device to leave it unbuilt"), line


@pytest.mark.slow
def test_pull_prints_the_vllm_command(dense, tmp_path):
    require_bundle(dense.result, dense.stderr)
    bundle = tmp_path / "serve"
    proc = dense.cli("pull", "dense", "--to", str(bundle), "--allow-unverified")
    assert proc.returncode == 0, proc.stderr
    command = [ln for ln in proc.stdout.splitlines() if not ln.startswith("#")]
    assert len(command) == 1, proc.stdout
    assert f"NEURON_COMPILED_ARTIFACTS={bundle.resolve()}" in command[0]
    assert "python -m vllm.entrypoints.openai.api_server" in command[0] and "--tensor-parallel-size 2" in command[0]
    # The bundle's KV cache is contiguous: no paged (prefix-cached) or chunked prefill serving.
    assert "--no-enable-prefix-caching" in command[0] and "--no-enable-chunked-prefill" in command[0]
    # The bundle registers the port's class itself: its vLLM plugin is on the path and allowed (docs/vllm.md).
    assert "VLLM_PLUGINS=neuron,qbuild_bundle" in command[0] and f"PYTHONPATH={bundle.resolve()}/vllm:" in command[0]


@pytest.mark.slow
def test_neuron_verify_path_loads_and_generates(dense, tmp_path, monkeypatch):
    """qbuild.steps.verify.Verify.run on the packaged bundle, in this process, with the double: the bundle is loaded once
    with the port's class (config read back from neuron_config.json) and generate() runs once per text prompt the
    way NxDI's accuracy check calls it; thresholds of 0 pass whatever the double returns."""
    from qbuild.execution.source_files import locate_checkpoint
    from qbuild.planning.step import Context, Source
    from qbuild.recipe.params import ReferenceParams, VerifyParams
    from qbuild.steps.reference import Reference
    from qbuild.steps.verify import Verify

    require_bundle(dense.result, dense.stderr)
    inputs = {role: dense.node_outputs("dense", role, tmp_path / role) for role in ("package", "fetch", "port")}
    # --skip-device left the reference unbuilt (only verify needs it): computed here as its step computes it.
    inputs["reference"] = tmp_path / "reference"
    inputs["reference"].mkdir()
    (tmp_path / "ref-scratch").mkdir()
    source = Source(path=str(dense.checkpoint))
    Reference.run(Context(ReferenceParams(("Hello world", "The quick brown fox"), 4, False),
                          {"snapshot": inputs["fetch"]}, inputs["reference"], tmp_path / "ref-scratch", source,
                          locate_checkpoint(inputs["fetch"], source, tmp_path / "ref-scratch", print),
                          log=lambda s: None))
    log = tmp_path / "verify.jsonl"
    for key, value in dense.env(log=log).items():
        monkeypatch.setenv(key, value)
    monkeypatch.syspath_prepend(str(SITE))
    out = tmp_path / "out"
    out.mkdir()
    params = VerifyParams(top1_min=0.0, token_match_min=0.0, max_logit_err=1e9)
    Verify.run(Context(params, {"bundle": inputs["package"], "reference": inputs["reference"], "port": inputs["port"]},
                       out, tmp_path / "scratch", log=lambda s: None))
    assert json.loads((out / "report.json").read_text())["ok"] is True
    calls = read_log(log)
    (init,) = [c for c in calls if c["call"] == "app_init"]
    assert init["config_from_json"] is True and init["cls"] == "NeuronQwen35ForCausalLM"
    (load,) = [c for c in calls if c["call"] == "load"]
    assert load["ranks"] == [0, 1]
    generates = [c for c in calls if c["call"] == "generate"]
    assert len(generates) == 2
    for g in generates:
        assert g["kwargs"] == {"do_sample": False, "max_new_tokens": 4, "min_new_tokens": 4,
                               "output_scores": True, "return_dict_in_generate": True}


# --- on-device sampling (docs/nxdi.md section 21) -------------------------------------------------------------------

@pytest.fixture(scope="module")
def sampled(dense, tmp_path_factory) -> Build:
    """The tiny Qwen3.5, text only, compiled with on-device sampling as the ports compile it, in its own store."""
    build = Build(tmp_path_factory.mktemp("neuron-sampled"))
    build.recipe = write_recipe(build.root / "recipes" / "sampled.yaml", dense.checkpoint, MAIN_PORT,
                                text={"sampling": {"on_device": True, "top_k": 1}})
    build.result, build.stderr = build.compile(build.recipe)
    require_bundle(build.result, build.stderr)
    return build


def _verify(build: Build, recipe: str, tmp_path: Path, monkeypatch, thresholds) -> dict:
    """The verify step (qbuild.steps.verify) on the build's bundle in this process, with the double and a reference
    computed as its step computes it (--skip-device left it unbuilt); the report, or the BuildError."""
    from qbuild.execution.source_files import locate_checkpoint
    from qbuild.planning.step import Context, Source
    from qbuild.recipe.params import ReferenceParams
    from qbuild.steps.reference import Reference
    from qbuild.steps.verify import Verify

    inputs = {role: build.node_outputs(recipe, role, tmp_path / role) for role in ("package", "fetch", "port")}
    inputs["reference"] = tmp_path / "reference"
    inputs["reference"].mkdir()
    (tmp_path / "ref-scratch").mkdir()
    source = Source(path=str(build.checkpoint))
    Reference.run(Context(ReferenceParams(("Hello world", "The quick brown fox"), 4, False),
                          {"snapshot": inputs["fetch"]}, inputs["reference"], tmp_path / "ref-scratch", source,
                          locate_checkpoint(inputs["fetch"], source, tmp_path / "ref-scratch", print),
                          log=lambda s: None))
    for key, value in build.env(log=tmp_path / "verify.jsonl").items():
        monkeypatch.setenv(key, value)
    monkeypatch.syspath_prepend(str(SITE))
    out = tmp_path / "out"
    out.mkdir()
    Verify.run(Context(thresholds, {"bundle": inputs["package"], "reference": inputs["reference"],
                                    "port": inputs["port"]}, out, tmp_path / "scratch", log=lambda s: None))
    return {"report": json.loads((out / "report.json").read_text()),
            "reference": json.loads((inputs["reference"] / "reference.json").read_text())}


@pytest.mark.slow
def test_on_device_sampling_is_compiled_as_the_ports_and_verified_by_its_tokens(sampled, tmp_path, monkeypatch):
    """`text.sampling: {on_device: true, top_k: 1}` reaches NxDI as the ports pass it: on_device_sampling_config with
    top_k 1 (a dict NeuronConfig turns into OnDeviceSamplingConfig(top_k=1)), saved so in the bundle's
    neuron_config.json. NxDI then returns tokens and no logits, so generate's scores are empty; verify asks for none,
    compares the tokens, takes the first token as the last position's top-1 and claims no logit error. A gate of
    max_logit_err 0, which any logits would fail, is not applied to a bundle that has none."""
    from qbuild.recipe.params import VerifyParams

    (kwargs,) = [c["kwargs"] for c in sampled.calls("NeuronConfig") if not c["load_path"]]
    assert kwargs["on_device_sampling_config"] == {"top_k": 1} and "output_logits" not in kwargs
    bundle = tmp_path / "bundle"
    assert sampled.cli("pull", "sampled", "--to", str(bundle), "--allow-unverified").returncode == 0
    saved = json.loads((bundle / "neuron_config.json").read_text())["neuron_config"]
    assert {k: saved["on_device_sampling_config"][k] for k in ("top_k", "do_sample", "dynamic")} == \
        {"top_k": 1, "do_sample": False, "dynamic": False}
    assert json.loads((bundle / "vllm" / "serve.json").read_text())["sampling"] == {"on_device": True, "top_k": 1}
    done = _verify(sampled, "sampled", tmp_path, monkeypatch,
                   VerifyParams(top1_min=0.0, token_match_min=0.0, max_logit_err=0.0))
    report, reference = done["report"], done["reference"]
    assert report["ok"] is True and report["logit_gate"] == "not applied (tokens only)"
    for prompt in report["prompts"]:
        assert prompt["max_logit_err"] is None and prompt["tokens"] == 1 and len(prompt["greedy"]) == 4
        assert prompt["top1"] == float(prompt["greedy"][0] == reference["prompts"][prompt["index"]]["greedy"][0])
    generates = [c for c in read_log(tmp_path / "verify.jsonl") if c["call"] == "generate"]
    assert len(generates) == 2 and all(g["on_device_sampling"] for g in generates)
    assert all(g["kwargs"]["output_scores"] is False and g["generation_config"]["top_k"] == 1 for g in generates)


@pytest.mark.slow
def test_the_double_refuses_a_config_that_reads_sampled_graphs_as_logits(sampled, tmp_path):
    """model.pt compiled with on-device sampling, loaded with a config without it: NxDI would read the graphs' tokens
    as logits; the double refuses the load naming the setting."""
    bundle = tmp_path / "bundle"
    assert sampled.cli("pull", "sampled", "--to", str(bundle), "--allow-unverified").returncode == 0
    config = bundle / "neuron_config.json"
    doc = json.loads(config.read_text())
    doc["neuron_config"]["on_device_sampling_config"] = None
    config.unlink()                        # a hardlink into the store: replaced, never written through
    config.write_text(json.dumps(doc))
    (result,) = load_bundles(sampled, bundle, log=tmp_path / "load.jsonl")
    assert result.startswith("RuntimeError: model.pt was compiled with on_device_sampling_config={") and \
        result.endswith("and is loaded with a config that says None"), result


# --- the double itself ---------------------------------------------------------------------------------------------

@pytest.fixture
def sdk(monkeypatch):
    """The double importable in this process for one test, then forgotten (qbuild decides whether the SDK is
    installed with importlib.util.find_spec, which would otherwise find the imported modules for later tests)."""
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    monkeypatch.syspath_prepend(str(SITE))
    yield
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and Path(path).resolve().is_relative_to(ROOT):
            del sys.modules[name]


def test_double_rejects_what_nxdi_would_silently_drop(sdk):
    import torch
    from neuronx_distributed_inference.models.config import MoENeuronConfig, NeuronConfig

    with pytest.raises(TypeError, match="normalize_top_k_affinities"):
        MoENeuronConfig(tp_degree=2, normalize_top_k_affinities=True)
    with pytest.raises(AssertionError, match="quantized_checkpoints_path is required"):
        NeuronConfig(quantized=True)
    with pytest.raises(ValueError, match="use_shard_on_intermediate"):
        MoENeuronConfig(blockwise_matmul_config={"use_shard_on_intermediate": True})
    nc = MoENeuronConfig(tp_degree=2, ep_degree=2, torch_dtype="bfloat16", moe_tp_degree=2, moe_ep_degree=2)
    assert nc.torch_dtype is torch.bfloat16 and nc.world_size == 4 and nc.normalize_top_k_affinities is True
    assert nc.router_config.dtype is torch.float32 and nc.router_config.act_fn == "softmax"


def test_double_load_reads_back_what_save_wrote(sdk, tmp_path, monkeypatch):
    """InferenceConfig.save writes to_dict as NxDI does; load reads it back, dropping (as NxDI does) what is not a
    constructor argument, and through the main port's NeuronConfig even for an MoE config."""
    monkeypatch.syspath_prepend(str(MAIN_PORT))
    from neuronx_distributed_inference.models.config import MoENeuronConfig
    from src.modeling_qwen35 import Qwen35InferenceConfig

    with pytest.raises(AssertionError, match="Config must define"):
        Qwen35InferenceConfig(MoENeuronConfig(tp_degree=2), hidden_size=64)
    fields = dict(head_dim=32, hidden_act="silu", hidden_size=64, max_position_embeddings=4096, num_attention_heads=4,
                  num_hidden_layers=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1e4, vocab_size=512,
                  linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_conv_kernel_dim=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                  model_type="qwen3_5_moe_text", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=32)
    config = Qwen35InferenceConfig(MoENeuronConfig(tp_degree=2, moe_tp_degree=2), **fields)
    config.save(str(tmp_path))
    text = (tmp_path / "neuron_config.json").read_text()
    assert text.endswith("}\n") and json.loads(text)["neuron_config"]["torch_dtype"] == "bfloat16"
    back = Qwen35InferenceConfig.load(str(tmp_path))
    assert type(back.neuron_config).__name__ == "NeuronConfig" and not hasattr(back.neuron_config, "moe_tp_degree")
    assert back.neuron_config.tp_degree == 2 and back.intermediate_size == 32 and back._is_moe is True


def test_double_metaneff_and_expert_parallel_weights(sdk, monkeypatch):
    """The metaneff round-trips with bytes checkpoint keys; with moe_ep 2 each rank holds its own contiguous experts,
    rank_util carries r % tp and spmd_rank the global rank; token generation under EP fails in the trace as NxD's
    selective loading does."""
    from neuronx_distributed_inference._nxd import rank_value
    from neuronx_distributed_inference.models.config import MoENeuronConfig
    from torch_neuronx.proto import metaneff_pb2

    meta = metaneff_pb2.MetaNeff()
    meta.input_tensors.add(name=b"w", shape=[4, 64], data_type=14, checkpoint_key=b"layers.0.mlp.gate_proj.weight",
                           type=metaneff_pb2.MetaTensor.Type.INPUT_WEIGHT)
    back = metaneff_pb2.MetaNeff()
    back.ParseFromString(meta.SerializeToString())
    (t,) = back.input_tensors
    assert t.type == metaneff_pb2.MetaTensor.Type.INPUT_WEIGHT
    assert t.checkpoint_key.decode() == "layers.0.mlp.gate_proj.weight"
    assert list(t.shape) == [4, 64]

    monkeypatch.syspath_prepend(str(MOE_PORT / "src"))
    from modeling_qwen35_moe import NeuronQwen35MoeModel, Qwen35MoeInferenceConfig

    nc = MoENeuronConfig(tp_degree=2, ep_degree=2, moe_tp_degree=2, moe_ep_degree=2,
                         blockwise_matmul_config={"block_size": 128})
    config = Qwen35MoeInferenceConfig(
        nc, head_dim=32, hidden_act="silu", hidden_size=64, max_position_embeddings=4096, moe_intermediate_size=32,
        num_attention_heads=4, num_experts=8, num_experts_per_tok=2, num_hidden_layers=1, num_key_value_heads=2,
        rms_norm_eps=1e-6, rope_theta=1e4, vocab_size=512, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, layer_types=["full_attention"],
        shared_expert_intermediate_size=32)
    weights = NeuronQwen35MoeModel.rank_weights(config)
    assert weights["layers.0.mlp.expert_mlps.mlp_op.gate_up_proj.weight"].shape == (4, 64, 32)
    assert weights["layers.0.mlp.expert_mlps.mlp_op.down_proj.weight"].shape == (4, 16, 64)
    indices = weights["layers.0.mlp.expert_mlps.spmd_rank.local_expert_indices"]
    assert [rank_value(indices, r, 2) for r in range(4)] == [[[0, 1, 2, 3]]] * 2 + [[[4, 5, 6, 7]]] * 2
    assert [rank_value(weights["rank_util.rank"], r, 2) for r in range(4)] == [[0], [1], [0], [1]]
    assert rank_value(weights["layers.0.mlp.expert_mlps.spmd_rank.rank"], 3, 2) == [3]
    assert NeuronQwen35MoeModel.trace(config, "context_encoding_model", 64, 64, 64)["experts"] == "forward_blockwise"
    with pytest.raises(NotImplementedError, match="Selective Loading with Expert parallelism"):
        NeuronQwen35MoeModel.trace(config, "token_generation_model", 64, 1, 1)


def test_double_load_names_the_first_wrong_tensor(sdk, tmp_path, monkeypatch):
    """The double's compile refuses to run without its own work dir or to shard a checkpoint; its load fails on the
    first shard tensor the compiled model does not take as it is."""
    import torch
    from neuronx_distributed_inference._double import DoubleRefusal
    from neuronx_distributed_inference.models.config import NeuronConfig
    from safetensors.torch import save_file

    monkeypatch.syspath_prepend(str(MAIN_PORT))
    from src.modeling_qwen35 import NeuronQwen35ForCausalLM, NeuronQwen35Model, Qwen35InferenceConfig

    fields = dict(head_dim=32, hidden_act="silu", hidden_size=64, intermediate_size=96, max_position_embeddings=4096,
                  num_attention_heads=4, num_hidden_layers=1, num_key_value_heads=2, rms_norm_eps=1e-6,
                  rope_theta=1e4, vocab_size=512, linear_num_value_heads=4, linear_num_key_heads=2,
                  linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                  layer_types=["full_attention"])
    monkeypatch.delenv("BASE_COMPILE_WORK_DIR", raising=False)
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", str(tmp_path / "cache"))
    nc = NeuronConfig(tp_degree=2, seq_len=128, enable_bucketing=True, context_encoding_buckets=[32],
                      token_generation_buckets=[128], save_sharded_checkpoint=True)
    app = NeuronQwen35ForCausalLM(str(tmp_path / "hf"), config=Qwen35InferenceConfig(nc, **fields))
    out = tmp_path / "compiled"
    out.mkdir()
    with pytest.raises(DoubleRefusal, match="BASE_COMPILE_WORK_DIR"):
        app.compile(str(out))
    monkeypatch.setenv("BASE_COMPILE_WORK_DIR", str(tmp_path / "work"))
    with pytest.raises(DoubleRefusal, match="would shard the checkpoint"):
        app.compile(str(out))
    assert (out / "model.pt").is_file()       # sharding comes last, after model.pt
    weights = NeuronQwen35Model.rank_weights(app.config)
    (out / "weights").mkdir()
    for rank in range(2):
        tensors = {name: torch.full(w.shape, rank, dtype=torch.int32) if w.value else
                   torch.zeros(w.shape, dtype=getattr(torch, w.dtype)) for name, w in weights.items()}
        if rank == 1:
            tensors["layers.0.self_attn.qkv_proj.k_proj.weight"] = torch.zeros(64, 64, dtype=torch.bfloat16)
        save_file(tensors, out / "weights" / f"tp{rank}_sharded_checkpoint.safetensors")
    loaded = NeuronQwen35ForCausalLM(str(out))
    with pytest.raises(RuntimeError, match=r"tp1_sharded_checkpoint.safetensors: layers.0.self_attn.qkv_proj.k_proj."
                                           r"weight: shape \[64, 64\], the compiled model takes \[32, 64\]"):
        loaded.load(str(out))
    # Right in names, shapes and dtypes, the shards still need the HF checkpoint to check their values against.
    rank1 = {name: torch.full(w.shape, 1, dtype=torch.int32) if w.value else
             torch.zeros(w.shape, dtype=getattr(torch, w.dtype)) for name, w in weights.items()}
    save_file(rank1, out / "weights" / "tp1_sharded_checkpoint.safetensors")
    with pytest.raises(DoubleRefusal, match="settings name none"):
        NeuronQwen35ForCausalLM(str(out)).load(str(out))
    # A port whose arguments set an option the caller sets again: which value wins is in no public source.
    class Twice(NeuronQwen35ForCausalLM):
        def get_compiler_args(self):
            return super().get_compiler_args() + " --auto-cast matmult"

    (tmp_path / "twice").mkdir()
    with pytest.raises(DoubleRefusal, match="--auto-cast twice"):
        Twice(str(tmp_path / "hf"), config=Qwen35InferenceConfig(nc, **fields)).compile(str(tmp_path / "twice"))


def test_recipe_flags_replace_the_port_option_they_name():
    """compiler.flags that set an option the port's arguments already set replace it (either spelling, `--x=v` or
    `--x v`; `-O2` replaces `-O1`); other flags are appended; the target and LNC come between."""
    from qbuild.backends.neuron.config import compiler_args
    from qbuild.backends.neuron.params import CompilerSettings
    from qbuild.backends.neuron.ports import LINEAGES, VISION_COMPILER_ARGS

    moe = LINEAGES["moe"].compiler_args
    validated = compiler_args(moe, CompilerSettings("trn2", 2, ("--auto-cast", "matmult", "--auto-cast-type", "bf16")))
    assert validated == CODER_NEXT_ARGS
    assert compiler_args(moe, CompilerSettings("trn2", 2, (RECIPE_FLAG,))) == \
        f"{MOE_PORT_ARGS} --target=trn2 --lnc=2 {RECIPE_FLAG}"
    assert compiler_args(VISION_COMPILER_ARGS, CompilerSettings("trn1", 1, ("--auto-cast=all", "-O2"))) == \
        "--model-type=transformer --enable-mixed-precision-accumulation --target=trn1 --lnc=1 --auto-cast=all -O2"
