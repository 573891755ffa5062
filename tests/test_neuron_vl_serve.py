"""`qbuild serve` of a neuron VL bundle: qbuild's own OpenAI server (the CPU bundles' server) over the port's VL classes,
which take images (docs/vision.md section 8), against the NxDI contract double (tests/nxdi_double): its copy of the
port's NeuronQwen35VLForCausalLM, vision wrapper and text model refuse the wrong classes, files, call order, input
shapes per bucket and per tile, and a config that reads the compiled graphs otherwise than they were compiled.

The tiny analogue of recipes/2b-vl-tp8.yaml: vision buckets 16 and 64 patch tokens (for 1024 and 4096), the encoder
TP-sharded over 2 ranks with the fake of the 2B port (whose wrapper loads TP buckets), on-device sampling, images of
64x64 (16 patches, the 16 bucket), 128x128 (64: the 64 bucket) and 256x256 pixels (256 patches: four 64-patch tiles).
A real-SDK test (skipped here) serves an image chat from such a bundle on a Trainium host.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, qbuild
from tests.nxdi_double import read_log, vision_tp_port
from tests.test_neuron_double import VL_ENV, Build, require_bundle, write_recipe
from tests.test_neuron_serve import Served
from tests.test_vision_images import PREPROCESSOR, picture

pytestmark = pytest.mark.xdist_group("neuron-vl-serve")

TEXT = {"batch_size": 1, "seq_len": 256, "cte_buckets": [32, 128], "tkg_buckets": [256],
        "sampling": {"on_device": True, "top_k": 1}}
# name -> (pixels, the vision bucket it runs through, tiled)
IMAGES = {"64px": ((64, 64), 16, False), "128px": ((128, 128), 64, False), "256px": ((256, 256), 64, True)}


@pytest.fixture(scope="module")
def vl(tmp_path_factory, small_checkpoints) -> tuple[Build, Path, dict[str, Path]]:
    """The tiny VL bundle built with the double and pulled, and the three pictures."""
    build = Build(tmp_path_factory.mktemp("neuron-vl-serve"))
    checkpoint = build.root / "checkpoint"
    shutil.copytree(small_checkpoints["qwen3_5"], checkpoint)
    (checkpoint / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    port = vision_tp_port(build.root / "port-2b")
    build.recipe = write_recipe(build.root / "recipes" / "vl.yaml", checkpoint, port, text=TEXT,
                                vision={"buckets": [16, 64], "tp": 2}, port={"env": VL_ENV})
    build.result, build.stderr = build.compile(build.recipe)
    require_bundle(build.result, build.stderr)
    bundle = build.root / "bundle"
    pulled = build.cli("pull", "vl", "--to", str(bundle), "--allow-unverified")
    assert pulled.returncode == 0, pulled.stderr
    pictures = {name: picture(build.root / f"{name}.png", size, seed=i)
                for i, (name, (size, _, _)) in enumerate(IMAGES.items())}
    return build, bundle, pictures


def _dry_run(build: Build, bundle: Path, *args: str) -> dict:
    proc = build.cli("serve", str(bundle), "--dry-run", "--json", *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _image_part(path: Path) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(
        path.read_bytes()).decode()}}


@pytest.mark.slow
def test_dry_run_shows_qbuilds_server_over_the_ports_vl_classes(vl):
    """A VL bundle is served by qbuild's server in a child process whose environment is the bundle's record (the
    compile's LNC, target and port switches, set before NxDI is imported; the port on PYTHONPATH), loading the port's
    NeuronQwen35VLForCausalLM over the bundle's compiled text model, its vision encoders (TP over 2 ranks) and the
    host-side embeddings; the limits and images are the CPU server's; the key is never printed. --server vllm gives
    vLLM's command, which serves no image."""
    build, bundle, _ = vl
    doc = _dry_run(build, bundle, "--port", "8123", "--api-key", "sekrit")
    assert doc["server"] == "qbuild" and doc["url"] == "http://127.0.0.1:8123/v1"
    assert doc["command"][:3] == [sys.executable, "-m", "qbuild.backends.neuron.vl_serve"]
    assert doc["command"][3:] == [str(bundle), "--name", "bundle", "--host", "127.0.0.1", "--port", "8123"]
    record = json.loads((bundle / "qbuild-neuron.json").read_text())
    assert {k: doc["env"][k] for k in record["config"]["env"]} == record["config"]["env"]
    assert doc["env"]["PYTHONPATH"] == str(bundle / "port") and doc["env"]["QBUILD_API_KEY"] == "***"
    assert "sekrit" not in json.dumps(doc)
    assert (doc["max_prompt_tokens"], doc["max_model_len"]) == (127, 256)
    assert doc["images"]["buckets"] == [16, 64] and doc["images"]["tiled_above"] == 64
    runtime = doc["runtime"]
    assert runtime["classes"].startswith("src.modeling_qwen35_vl.NeuronQwen35VLForCausalLM over "
                                         "src.modeling_qwen35.NeuronQwen35ForCausalLM")
    assert runtime["vision_encoders"] == {"16": "bucket_16", "64": "bucket_64"}
    assert runtime["vision_host_weights"] == str(bundle / "vision" / "host")
    assert runtime["sampling"] == {"on_device": True, "top_k": 1}
    vllm = _dry_run(build, bundle, "--server", "vllm")
    assert vllm["server"] == "vllm" and vllm["images"]["served"] is False
    refused = build.cli("serve", str(bundle), "--dry-run", "--server", "vllm", "--allow-image-urls")
    assert refused.returncode == 2 and "drop --server vllm: qbuild's server takes them" in refused.stderr
    extra = build.cli("serve", str(bundle), "--dry-run", "--", "--chat-template", "x")
    assert extra.returncode == 2 and "served by qbuild's own server, which takes no arguments" in extra.stderr


@pytest.mark.slow
def test_the_bundle_holds_the_host_embeddings_under_the_names_the_port_reads(vl):
    """vision/host/model.safetensors: the patch and position embeddings under the HF checkpoint's names, equal to the
    converted ones beside them, and nothing else."""
    from safetensors.torch import load_file

    _, bundle, _ = vl
    host = load_file(bundle / "vision" / "host" / "model.safetensors")
    converted = load_file(bundle / "vision" / "model.safetensors")
    assert sorted(host) == ["model.visual.patch_embed.proj.bias", "model.visual.patch_embed.proj.weight",
                            "model.visual.pos_embed.weight"]
    for name, tensor in host.items():
        assert tensor.equal(converted[name.removeprefix("model.visual.")])


@pytest.mark.slow
def test_an_image_chat_tiled_and_untiled_over_http(vl, tmp_path):
    """The OpenAI client chats with each picture: the port's VL classes are built and loaded once, in the benchmark's
    order; each image reaches the wrapper as the processor cut it and runs through its bucket whole, or as four tiles
    of the 64 bucket, with each bucket's input shapes; context encoding gets the features at the prompt's image tokens,
    padded to the text bucket the prompt takes; every decode follows its step. A streamed answer is the same text,
    the same request gives the same tokens, different pictures other tokens, and a text chat runs without the
    wrapper. Ctrl-C stops the server, 0, and the bundle is unchanged."""
    import openai

    from tests.test_neuron_serve import _unchanged

    build, bundle, pictures = vl
    served = Served(build, str(bundle), tmp_path)
    answers = {}
    try:
        url = served.url()
        assert url, served.stop()[1]
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        for name, path in pictures.items():
            messages = [{"role": "user", "content": [_image_part(path), {"type": "text", "text": "What is it?"}]}]
            reply = client.chat.completions.create(model="bundle", messages=messages, max_tokens=5)
            assert reply.usage.completion_tokens >= 1 and reply.choices[0].finish_reason in ("stop", "length")
            answers[name] = (reply.choices[0].message.content, reply.usage.prompt_tokens)
            again = client.chat.completions.create(model="bundle", messages=messages, max_tokens=5)
            assert again.choices[0].message.content == answers[name][0]
        stream = client.chat.completions.create(model="bundle", max_tokens=5, stream=True, messages=[
            {"role": "user", "content": [_image_part(pictures["256px"]), {"type": "text", "text": "What is it?"}]}])
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == answers["256px"][0]
        text = client.chat.completions.create(model="bundle", max_tokens=3,
                                              messages=[{"role": "user", "content": "Hello there"}])
        assert text.usage.completion_tokens >= 1
    finally:
        code, err = served.stop()
    assert code == 0, err
    assert len({a for a, _ in answers.values()}) == 3, answers
    calls = read_log(served.log)
    names = [c["call"] for c in calls]
    first = {name: names.index(name) for name in ("vl_init", "load", "vision_load_compiled",
                                                   "vision_load_host_weights", "vl_generate")}
    assert first["vl_init"] < first["load"] < first["vision_load_compiled"] < first["vision_load_host_weights"] \
        < first["vl_generate"], names
    (init,) = served.calls("vl_init")
    assert init["use_text_only_cte_inputs"] is False and init["model_path"] == str(bundle)
    (load,) = served.calls("load")
    assert load["path"].rstrip("/") == str(bundle) and load["ranks"] == [0, 1]
    (vision,) = served.calls("vision_load_compiled")
    assert vision["buckets"] == [16, 64] and vision["tp"] == {"16": 2, "64": 2}
    (host,) = served.calls("vision_load_host_weights")
    assert host["path"] == str(bundle / "vision" / "host") and len(host["loaded"]) == 3
    encodes = served.calls("vision_encode")
    # 64px twice, 128px twice, 256px twice as four tiles, and once more streamed.
    assert [e["bucket"] for e in encodes] == [16, 16, 64, 64] + [64] * 12
    for e in encodes:
        b = e["bucket"]
        assert e["inputs"] == [{"shape": [b, 32], "dtype": "bfloat16"}, {"shape": [1, 1, b, b], "dtype": "bfloat16"},
                               {"shape": [b, 16], "dtype": "bfloat16"}, {"shape": [b, 16], "dtype": "bfloat16"}]
        assert e["tp"] == 2
    assert [e["grid"] for e in encodes[4:8]] == [[[1, 8, 8]]] * 4      # the tiles of the 16x16-patch picture
    contexts = [c for c in served.calls("context_inputs") if c["image_tokens"]]
    assert [c["image_tokens"] for c in contexts] == [4, 4, 16, 16, 64, 64, 64]
    for c, (_, tokens) in zip(contexts, [answers[n] for n in ("64px", "64px", "128px", "128px", "256px", "256px")]):
        assert c["bucket"] == (32 if tokens <= 32 else 128)
    for c in contexts:
        b = c["bucket"]
        assert c["inputs"] == {"vision_embeddings": {"shape": [1, b, 64], "dtype": "bfloat16"},
                               "vision_mask": {"shape": [1, b, 1], "dtype": "int32"},
                               "mrope_position_ids": {"shape": [3, 1, b], "dtype": "int32"}}
    generates = served.calls("vl_generate")
    assert [g["image"] for g in generates] == [True] * 7 + [False]
    assert all(g["temperature"] == 0.0 for g in generates)
    _unchanged(bundle)


@pytest.mark.slow
def test_an_image_no_bucket_takes_is_refused_before_it_reaches_the_port(vl, tmp_path):
    """A picture larger than the largest bucket whose patch grid the port cannot cut 2x2 (14 x 18 patches: rows not a
    multiple of 4) is a 400 naming the part, as from a CPU bundle; the port's wrapper is never called for it (its
    _tiled_forward would assert)."""
    import openai

    build, bundle, _ = vl
    big = picture(tmp_path / "big.png", (288, 224))
    served = Served(build, str(bundle), tmp_path)
    try:
        url = served.url()
        assert url, served.stop()[1]
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="messages.0.content.0.image_url: .*multiples of 4"):
            client.chat.completions.create(model="bundle", max_tokens=2, messages=[
                {"role": "user", "content": [_image_part(big), {"type": "text", "text": "What is it?"}]}])
    finally:
        code, err = served.stop()
    assert code == 0, err
    assert not served.calls("vision_encode") and not served.calls("vl_generate")


@pytest.mark.slow
def test_host_embeddings_the_wrapper_did_not_load_stop_the_server_in_one_line(vl, tmp_path):
    """The port's load_vision_weights_from_hf loads the keys it finds and says nothing of the others; a bundle whose
    host file lacks one (bundle.json rewritten to match, so only the runtime can see it) is refused naming the
    tensor: the server exits 2, serve exits 3, nothing is generated."""
    from safetensors.torch import load_file, save_file

    from qbuild.model.bundle import read_manifest, write_manifest

    build, bundle, _ = vl
    copy = Path(shutil.copytree(bundle, tmp_path / "copy"))
    host = copy / "vision" / "host" / "model.safetensors"
    tensors = load_file(host)
    host.unlink()       # a hardlink into the store: replaced, never written through
    save_file({k: v for k, v in tensors.items() if k != "model.visual.pos_embed.weight"}, host)
    manifest = read_manifest(copy)
    (copy / "bundle.json").unlink()
    write_manifest(copy, {k: v for k, v in manifest.items() if k != "files"})
    served = Served(build, str(copy), tmp_path)
    assert served.url() == ""
    code, err = served.stop()
    assert code == 3, err
    assert f"error: {host}: the port's vision wrapper did not load model.visual.pos_embed.weight from it" in err
    assert err.strip().splitlines()[-1] == ("error: qbuild's server exited with code 2 before it was stopped; its "
                                           "output is above")
    assert not served.calls("vl_generate")


@pytest.mark.slow
def test_a_text_bundle_is_vllms_and_qbuilds_server_is_refused_for_it(small_checkpoints, tmp_path):
    """A neuron text bundle keeps vLLM; --server qbuild is refused in one line, exit 2."""
    from tests.test_neuron_serve import TEXT as VLLM_TEXT, _bundle

    build, bundle = _bundle(tmp_path / "build", small_checkpoints["qwen3_5"], vision_tp_port(tmp_path / "port"),
                            text=VLLM_TEXT)
    assert _dry_run(build, bundle)["server"] == "vllm"
    proc = build.cli("serve", str(bundle), "--dry-run", "--server", "qbuild")
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"error: --server qbuild: {bundle} is a neuron text bundle, which vLLM's Neuron plugin serves; drop --server "
        "(docs/vllm.md)")


def _shipped_vl_bundle(name: str, tmp_path: Path) -> tuple[Path, dict]:
    """The layout of a shipped VL recipe's bundle (its vllm/serve.json, qbuild-vision.json and bundle.json as the
    package step writes them from the planned params and compile record), and the recipe's planned text compile."""
    from qbuild.backends.neuron.package import serve_record, vision_record
    from qbuild.backends.neuron.params import NeuronPackageParams
    from qbuild.recipe.params import parse
    from qbuild.model.bundle import write_manifest

    nodes = json.loads(qbuild("plan", str(REPO / "recipes" / f"{name}.yaml"), "--json", check=True).stdout)["nodes"]
    (package,) = [n for n in nodes if n["kind"] == "package"]
    (text,) = [n for n in nodes if n["kind"] == "compile" and n["params"].get("graph") == "text"]
    vision = {n["params"]["bucket"]: n["neuron_config"] for n in nodes
              if n["kind"] == "compile" and n["params"].get("graph") == "vision"}
    params = parse(NeuronPackageParams, package["params"])
    record = {"params": text["params"], "config": {"env": text["neuron_config"]["env"],
                                                   "neuron_config": text["neuron_config"]["neuron_config"]}}
    bundle = tmp_path / name
    (bundle / "vllm").mkdir(parents=True)
    (bundle / "vllm" / "serve.json").write_text(json.dumps(serve_record(params, record)))
    (bundle / "vllm" / "qbuild_vllm_plugin.json").write_text(json.dumps({
        "port_dir": "../port", "module": "src.modeling_qwen35", "app_class": "NeuronQwen35ForCausalLM"}))
    (bundle / "qbuild-vision.json").write_text(json.dumps(vision_record(vision)))
    (bundle / "vision" / "host").mkdir(parents=True)
    (bundle / "vision" / "host" / "model.safetensors").write_bytes(b"")
    write_manifest(bundle, {"backend": "neuron", **params.bundle_meta()})
    return bundle, text


@pytest.mark.parametrize("name,tp", [("2b-vl-tp8", 4), ("35b-a3b-vl-tp8", 1)])
def test_the_shipped_vl_recipes_are_served_by_qbuilds_server_over_the_ports_vl_classes(name, tp, tmp_path):
    """`qbuild serve --dry-run` of each shipped VL recipe's bundle layout: qbuild's server in a child process with the
    compile's environment, over the port's NeuronQwen35VLForCausalLM with the bundle's encoders (the 2B's over 4
    ranks), prompts up to 8191 tokens (a prompt of the largest bucket's length would lose its last token), images
    tiled past 4096 patches, decode sampled on the device."""
    bundle, text = _shipped_vl_bundle(name, tmp_path)
    proc = qbuild("serve", str(bundle), "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["server"] == "qbuild" and doc["command"][1:3] == ["-m", "qbuild.backends.neuron.vl_serve"]
    assert doc["env"].items() >= text["neuron_config"]["env"].items() and doc["env"]["PYTHONPATH"] == str(
        bundle / "port")
    assert (doc["max_prompt_tokens"], doc["max_model_len"]) == (8191, 8192)
    assert doc["images"]["buckets"] == [1024, 4096] and doc["images"]["max_patches"] == 16384
    folder = "bucket_{}" if tp > 1 else "vision_encoder_{}.pt"
    assert doc["runtime"]["vision_encoders"] == {str(b): folder.format(b) for b in (1024, 4096)}
    assert doc["runtime"]["sampling"] == {"on_device": True, "top_k": 1}
    text_doc = qbuild("serve", str(bundle), "--dry-run").stdout
    assert text_doc.splitlines()[0] == "# server: qbuild" and "-m qbuild.backends.neuron.vl_serve" in text_doc


def test_the_servers_child_drops_the_api_key_from_its_environment_once_read(monkeypatch, tmp_path):
    """The key reaches the child in QBUILD_API_KEY; the child takes it into the server's options and removes it from
    its environment before it loads the bundle, so neither the SDK nor anything the child starts inherits it."""
    from qbuild.backends.neuron import vl_runtime, vl_serve
    from qbuild.backends.openai_server import serve as openai_serve

    seen = {}

    def load(cls, bundle):
        seen["at_load"] = os.environ.get(vl_serve.API_KEY_ENV)
        return "runtime"

    def serve(runtime, options):
        seen["api_key"] = options.api_key
        seen["spawned"] = subprocess.run(
            [sys.executable, "-c", f"import os; print(os.environ.get({vl_serve.API_KEY_ENV!r}, '<unset>'))"],
            capture_output=True, text=True, check=True).stdout.strip()
        return 0

    monkeypatch.setattr(vl_runtime.NeuronVLRuntime, "load", classmethod(load))
    monkeypatch.setattr(openai_serve, "serve", serve)
    monkeypatch.setenv(vl_serve.API_KEY_ENV, "sekrit")
    assert vl_serve.main([str(tmp_path), "--name", "b", "--host", "127.0.0.1", "--port", "1"]) == 0
    assert seen == {"at_load": None, "api_key": "sekrit", "spawned": "<unset>"}
    assert vl_serve.API_KEY_ENV not in os.environ


@pytest.mark.parametrize("dry_run", [True, False])
def test_vllm_arguments_to_a_vl_bundle_are_refused_naming_server_vllm(tmp_path, dry_run):
    """A neuron VL bundle took vLLM's arguments after `--` before qbuild's server became its default; now they are
    refused in one line, exit 2, which says that --server vllm serves it with them. With --server vllm they reach
    vLLM's command."""
    bundle, _ = _shipped_vl_bundle("2b-vl-tp8", tmp_path)
    proc = qbuild("serve", str(bundle), *(["--dry-run"] if dry_run else []), "--", "--chat-template", "t.jinja",
                  "--api-key", "sekrit-2")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.strip() == (
        f"error: {bundle}: a neuron VL bundle is served by qbuild's own server, which takes no arguments after `--` "
        "(given: --chat-template, --api-key); pass --server vllm to serve it with vLLM (text only), which takes them")
    vllm = qbuild("serve", str(bundle), "--dry-run", "--json", "--server", "vllm", "--", "--chat-template", "t.jinja")
    assert vllm.returncode == 0, vllm.stderr
    assert json.loads(vllm.stdout)["command"][-2:] == ["--chat-template", "t.jinja"]


# --- the double's contract, without a server -------------------------------------------------------------------

_DIRECT = """
import json, sys, traceback
import torch
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from qbuild.backends.neuron.vl_runtime import NeuronVLRuntime
bundle, case = Path(sys.argv[1]), sys.argv[3]
runtime = NeuronVLRuntime.load(bundle)
vl = runtime.vl
image = runtime.prepare_image(Path(sys.argv[4]).read_bytes())
ids = runtime.place_image(runtime.image_marker() + runtime.encode(" What is it?"), image)
try:
    if case == "features short":
        ids.remove(runtime.arch.image_token_id)
        vl.generate(input_ids=torch.tensor([ids]), pixel_values=image.pixel_values, image_grid_thw=image.grid,
                    max_new_tokens=2, temperature=0.0)
    elif case == "pixels of another grid":
        vl.vision_model_wrapper(image.pixel_values[:-4], image.grid)
    elif case == "decode before prefill":
        vl.text_model.reset()
        vl.text_model(input_ids=torch.tensor([[5]]), position_ids=torch.tensor([[7]]))
    elif case == "decode of another token":
        vl.text_model.reset()
        vl.text_model(input_ids=torch.tensor([ids[:8]]), position_ids=torch.arange(8)[None])
        vl.text_model(input_ids=torch.tensor([[1]]), position_ids=torch.tensor([[8]]))
    elif case == "image features of the wrong dtype":
        vl.text_model.reset()
        n = len(ids)
        vl.text_model(input_ids=torch.tensor([ids]), position_ids=torch.arange(n)[None], llava_args=[
            torch.zeros(1, 256, 64), torch.zeros(1, 256, 1, dtype=torch.int32), torch.zeros(3, 1, 256,
                                                                                            dtype=torch.int32)])
    print("accepted")
except Exception as e:
    print(f"{type(e).__name__}: {e}")
"""


@pytest.mark.slow
@pytest.mark.parametrize("case,refusal", [
    ("features short", "ValueError: 16 image features for 15 image tokens"),
    ("pixels of another grid", "ValueError: pixel_values [60, 1536] for a grid of [[1, 8, 8]]: expected [64, 1536]"),
    ("decode before prefill", "RuntimeError: forward: token generation before context encoding"),
    ("decode of another token", "RuntimeError: forward: a decode fed [[1]]; the step before chose"),
    ("image features of the wrong dtype", "ValueError: llava_args vision_embeddings: [1, 256, 64] torch.float32; the "
                                          "port passes [1, 256, 64] torch.bfloat16"),
])
def test_the_double_refuses_what_the_compiled_graphs_could_not_take(vl, tmp_path, case, refusal):
    """The runtime loaded directly (no server), then one wrong call: features that are not the prompt's image tokens,
    pixels of another grid than they claim, a decode before the prefill, a decode fed another token than the step
    before chose, image features in another dtype than the graph's."""
    build, bundle, pictures = vl
    record = json.loads((bundle / "qbuild-neuron.json").read_text())
    env = dict(os.environ, **build.env(log=tmp_path / "direct.jsonl"), **record["config"]["env"])
    env["PYTHONPATH"] = os.pathsep.join((env["PYTHONPATH"], str(REPO)))
    proc = subprocess.run([sys.executable, "-c", _DIRECT, str(bundle), str(bundle / "port"), case,
                           str(pictures["128px"])], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith(refusal), proc.stdout


_TEXT = """
import json, sys
import torch
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from qbuild.backends.neuron.vl_runtime import NeuronVLRuntime
from qbuild.core.errors import UserError
runtime = NeuronVLRuntime.load(Path(sys.argv[1]))
vocab = runtime.vl.text_model.config.vocab_size
short = runtime.encode("Hello there")
prompts = {"short": short, "32": (short * 32)[:32], "128": (short * 128)[:128]}
out = {"vocab": vocab, "max_prompt_tokens": runtime.max_prompt_tokens}
for name, ids in prompts.items():
    port = runtime.vl.generate(input_ids=torch.tensor([ids]), max_new_tokens=1, temperature=0.0)
    try:
        served = runtime.generate(ids, 1).token_ids[0]
    except UserError as e:
        served = str(e)
    out[name] = {"ids": ids, "port": int(port[0, -1]), "served": served}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_text_chat_keeps_its_last_prompt_token_on_a_graph_traced_with_vision_inputs(vl, tmp_path):
    """The port's generate passes a text-only prompt no image inputs, and its text model then builds a mask whose
    every slot is the unpadded prompt's last position (modeling_qwen35.py L7650, L7666-7675 @ 4bcdc54), so the
    graph's scatter zeroes that token's embedding (L5688): the double records it and the token adds nothing. qbuild's
    runtime gives the context encoding the image path's padding inputs instead, which land on the bucket's last,
    padding, slot: nothing is overwritten and the first token is the whole prompt's. A prompt as long as the 32
    bucket runs in the 128 one (NxDI's strict first fit), so it loses nothing; one as long as the largest bucket (128)
    has its last token in that slot whatever the inputs, so the runtime refuses it (docs/vision.md section 8)."""
    build, bundle, _ = vl
    record = json.loads((bundle / "qbuild-neuron.json").read_text())
    log = tmp_path / "text.jsonl"
    env = dict(os.environ, **build.env(log=log), **record["config"]["env"])
    env["PYTHONPATH"] = os.pathsep.join((env["PYTHONPATH"], str(REPO)))
    proc = subprocess.run([sys.executable, "-c", _TEXT, str(bundle), str(bundle / "port")], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    vocab, short, at32, at128 = out["vocab"], out["short"], out["32"], out["128"]
    contexts = [c for c in read_log(log) if c["call"] == "context_inputs"]
    n = len(short["ids"])
    assert n < 32 and len(at32["ids"]) == 32 and len(at128["ids"]) == 128 and out["max_prompt_tokens"] == 127
    # Per prompt, the port's own text path, then the runtime's (none for the prompt it refuses).
    assert [(c["bucket"], c["image_tokens"], c["overwritten"]) for c in contexts] == [
        (32, 0, [n - 1]), (32, 0, []), (128, 0, [31]), (128, 0, []), (128, 0, [127])]
    for prompt, last in ((short, n - 1), (at32, 31)):
        assert prompt["port"] == (sum(prompt["ids"]) - prompt["ids"][last]) % vocab
        assert prompt["served"] == sum(prompt["ids"]) % vocab != prompt["port"]
    assert at128["port"] == (sum(at128["ids"]) - at128["ids"][127]) % vocab
    assert at128["served"].startswith("the prompt has 128 tokens, as many as the largest context-encoding bucket")
    assert contexts[1]["inputs"] == {"vision_embeddings": {"shape": [1, 32, 64], "dtype": "bfloat16"},
                                     "vision_mask": {"shape": [1, 32, 1], "dtype": "int32"},
                                     "mrope_position_ids": {"shape": [3, 1, 32], "dtype": "int32"}}


@pytest.mark.slow
def test_verify_of_a_vl_bundle_keeps_its_text_prompts_last_token(vl, tmp_path, monkeypatch):
    """qbuild's verify runs a VL bundle's text prompts through NxDI's generation adapter, which passes no image
    inputs either: its context encodings get the padding inputs too, so no prompt token is overwritten, and its
    tokens are the whole prompt's."""
    from qbuild.recipe.params import VerifyParams
    from tests.test_neuron_double import _verify

    build, _, _ = vl
    done = _verify(build, "vl", tmp_path, monkeypatch, VerifyParams(top1_min=0.0, token_match_min=0.0,
                                                                     max_logit_err=1e9))
    assert done["report"]["ok"] is True
    contexts = [c for c in read_log(tmp_path / "verify.jsonl") if c["call"] == "context_inputs"]
    assert len(contexts) == 2 and all(c["overwritten"] == [] and c["image_tokens"] == 0 for c in contexts)
    vocab = json.loads((build.checkpoint / "config.json").read_text())
    vocab = vocab.get("text_config", vocab)["vocab_size"]
    for prompt, ref in zip(done["report"]["prompts"], done["reference"]["prompts"]):
        assert prompt["greedy"][0] == sum(ref["ids"]) % vocab


_LOAD = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from qbuild.backends.neuron.vl_runtime import NeuronVLRuntime
from qbuild.core.errors import UserError
try:
    NeuronVLRuntime.load(Path(sys.argv[1]))
    print("loaded")
except Exception as e:
    print(f"{type(e).__name__}: {e}")
"""


@pytest.mark.slow
@pytest.mark.parametrize("change,field,compiled,rebuilt", [
    ("params.vision_inputs", "use_text_only_cte_inputs", "false", "true"),
    ("config.neuron_config.on_device_sampling_config", "neuron_config.on_device_sampling_config", None, "null"),
    ("config.neuron_config.context_encoding_buckets", "neuron_config.context_encoding_buckets", "[32, 128]", "[128]"),
])
def test_a_config_rebuilt_otherwise_than_compiled_is_refused_before_load(vl, tmp_path, change, field, compiled,
                                                                          rebuilt):
    """The runtime rebuilds the text config from the bundle's record with this qbuild's code; where that differs from
    NxDI's saved neuron_config.json in a field that says how the graphs are called or what they return (a bundle of
    another qbuild: here its record edited), it refuses in one line naming the field and both values, before the
    text model is loaded (NxDI itself would load it and misread the graphs)."""
    build, bundle, _ = vl
    copy = Path(shutil.copytree(bundle, tmp_path / "copy"))
    path = copy / "qbuild-neuron.json"
    record = json.loads(path.read_text())
    owner, *middle, key = change.split(".")
    doc = record[owner]
    for part in middle:
        doc = doc[part]
    doc[key] = {"params.vision_inputs": False, "config.neuron_config.on_device_sampling_config": None,
                "config.neuron_config.context_encoding_buckets": [128]}[change]
    path.unlink()
    path.write_text(json.dumps(record))
    log = tmp_path / "load.jsonl"
    env = dict(os.environ, **build.env(log=log), **record["config"]["env"])
    env["PYTHONPATH"] = os.pathsep.join((env["PYTHONPATH"], str(REPO)))
    proc = subprocess.run([sys.executable, "-c", _LOAD, str(copy), str(copy / "port")], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip().splitlines()[-1]
    saved = json.loads((copy / "neuron_config.json").read_text())
    was = saved["neuron_config"].get(field.split(".")[-1]) if field.startswith("neuron_config.") else saved[field]
    assert line == (f"UserError: {copy / 'neuron_config.json'}: {field} is {json.dumps(was)} there, and "
                    f"{rebuilt} in the config this qbuild builds from qbuild-neuron.json: the bundle was compiled by "
                    "a qbuild or Neuron SDK that builds it otherwise; serve it with those, or build it again"), line
    assert compiled is None or json.dumps(was) == compiled
    assert not [c for c in read_log(log) if c["call"] == "load"]


@pytest.mark.slow
def test_a_field_the_saved_sampling_config_lacks_is_not_a_difference(vl, tmp_path):
    """A bundle compiled where NxDI's OnDeviceSamplingConfig had fewer fields (sampling_dp_degree came with SDK 2.28)
    and served where it has more loads: the fields both configs hold are compared, and they agree."""
    build, bundle, _ = vl
    copy = Path(shutil.copytree(bundle, tmp_path / "copy"))
    saved = json.loads((copy / "neuron_config.json").read_text())
    sampling = saved["neuron_config"]["on_device_sampling_config"]
    del sampling["sampling_dp_degree"]
    (copy / "neuron_config.json").unlink()
    (copy / "neuron_config.json").write_text(json.dumps(saved))
    record = json.loads((copy / "qbuild-neuron.json").read_text())
    env = dict(os.environ, **build.env(log=tmp_path / "load.jsonl"), **record["config"]["env"])
    env["PYTHONPATH"] = os.pathsep.join((env["PYTHONPATH"], str(REPO)))
    proc = subprocess.run([sys.executable, "-c", _LOAD, str(copy), str(copy / "port")], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "loaded", proc.stdout


# --- on a Trainium host ----------------------------------------------------------------------------------------

def _real_sdk_skip() -> str | None:
    import importlib.util

    spec = importlib.util.find_spec("neuronx_distributed_inference")
    if spec is None:
        return "neuronx_distributed_inference does not import here"
    if Path(spec.origin).resolve().is_relative_to(REPO / "tests" / "nxdi_double"):
        return "neuronx_distributed_inference is the contract double here, not the Neuron SDK"
    if not os.environ.get("QBUILD_TEST_PORTS"):
        return "QBUILD_TEST_PORTS is unset: it names the directory of NxDI contrib port checkouts"
    return None


@pytest.mark.skipif(_real_sdk_skip() is not None, reason=str(_real_sdk_skip()))
def test_serve_an_image_chat_from_a_tiny_vl_bundle_on_neuron(small_checkpoints, tmp_path):
    """On a Trainium host with the Neuron SDK and the Qwen3.5-2B port checkout: a tiny VL bundle (vision buckets 16
    and 64, encoder over 2 ranks, on-device sampling) built, verified on the NeuronCores and pulled, served by
    `qbuild serve` as a user starts it; the OpenAI client chats with a whole and a tiled image, Ctrl-C stops it with
    exit 0, and the bundle is unchanged."""
    import importlib.metadata
    import signal

    import openai

    from tests.conftest import wait_until
    from tests.test_neuron_serve import _unchanged

    port = Path(os.environ["QBUILD_TEST_PORTS"]) / "Qwen3.5-2B"
    if not (port / "src").is_dir():
        pytest.skip(f"{port}: no port checkout")
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(small_checkpoints["qwen3_5"], checkpoint)
    (checkpoint / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    toolchain = {d.replace("-", "_"): importlib.metadata.version(d).split("+")[0]
                 for d in ("neuronx-cc", "neuronx-distributed", "neuronx-distributed-inference", "torch-neuronx")}
    recipe = tmp_path / "vl.yaml"
    recipe.write_text(json.dumps({
        "model": {"path": str(checkpoint)}, "backend": "neuron", "port": {"path": str(port), "env": VL_ENV},
        "parallel": {"tp": 2}, "dtype": "bfloat16", "text": TEXT, "vision": {"buckets": [16, 64], "tp": 2},
        "compiler": {"target": "trn2"}, "toolchain": toolchain,
        "verify": {"prompts": ["Hello world"], "new_tokens": 4, "image_prompt": False}}))
    env = {"QBUILD_STORE": str(tmp_path / "store")}
    lock = ["--lock", str(tmp_path / "artifacts.lock")]
    built = qbuild("compile", str(recipe), *lock, env=env, timeout=7200)
    assert built.returncode == 0, built.stderr[-4000:]
    bundle = tmp_path / "bundle"
    assert qbuild("pull", "vl", "--to", str(bundle), *lock, env=env).returncode == 0
    ready = tmp_path / "url"
    server = subprocess.Popen([str(Path(sys.executable).with_name("qbuild")), "serve", str(bundle), "--port", "0",
                               "--ready-file", str(ready)], env=dict(os.environ, **env), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        url = wait_until(lambda: ready.exists() and ready.read_text().strip(), 1800, "qbuild's server to answer")
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
        for size in ((128, 128), (256, 256)):
            reply = client.chat.completions.create(model="bundle", max_tokens=4, messages=[{"role": "user", "content": [
                _image_part(picture(tmp_path / f"{size[0]}.png", size)), {"type": "text", "text": "What is it?"}]}])
            assert reply.usage.completion_tokens >= 1 and reply.choices[0].finish_reason in ("stop", "length")
    finally:
        server.send_signal(signal.SIGINT)
        _, err = server.communicate(timeout=300)
    assert server.returncode == 0, err[-4000:]
    _unchanged(bundle)
