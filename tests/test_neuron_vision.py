"""The VL facts of a neuron build against the NxDI contract double (tests/nxdi_double): the vision buckets, the
TP-sharded encoder (NxD's parallel_model_trace, `bucket_<N>/tp_<r>.pt`), the 2x2 tiling the port's wrapper applies to
the bundle's encoders, and the DeltaNet switches the ports' VL scripts set; and what vLLM's Neuron plugin does with a
VL bundle's images (it cannot serve them: docs/vllm.md section 11).

The double plays the port's vision wrapper from its source (load_compiled, the bucket and tiling choice of forward),
written from the facts in docs/vision.md, not from qbuild's code, and refuses what the facts say would go wrong: a
text model traced for image features with the fused DeltaNet prefill, a TP encoder for a port that cannot load one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from qbuild.model.tiling import ImageTooLarge, plan_image
from tests.conftest import REPO, qbuild
from tests.nxdi_double import MAIN_PORT, SITE, read_log, vision_tp_port
from tests.test_neuron_double import RECIPE_FLAG, VL_ENV, Build, compiled, require_bundle, write_recipe

pytestmark = pytest.mark.xdist_group("neuron-vision")

VISION_ARGS = "--model-type=transformer --auto-cast=none -O1 --enable-mixed-precision-accumulation"


def _shipped(tmp_path: Path, name: str) -> dict:
    """`qbuild plan --json` of a shipped recipe, its model pinned to a commit so that it plans offline."""
    doc = yaml.safe_load((REPO / "recipes" / f"{name}.yaml").read_text())
    doc["extends"] = str(REPO / "recipes/bases/trn2.yaml")
    doc["model"]["revision"] = "0123456789abcdef0123456789abcdef01234567"
    recipe = tmp_path / f"{name}.yaml"
    recipe.write_text(yaml.safe_dump(doc))
    return json.loads(qbuild("plan", str(recipe), "--json", check=True, env={"HF_HUB_OFFLINE": "1"}).stdout)


@pytest.mark.parametrize("name,tp", [("2b-vl-tp8", 4), ("35b-a3b-vl-tp8", 1)])
def test_vl_recipes_plan_the_validated_configuration(tmp_path, name, tp):
    """The shipped VL recipes plan one vision node per bucket, 1024 and 4096 (the 2B's TP-sharded over 4 ranks as the
    port's compile_vision_encoder_tp.py builds it, the 35B-A3B's on one core: its port loads no TP encoder), a text
    compile of the VL benchmark's context buckets up to 8192 that takes image features, and the VL scripts' DeltaNet
    switches in the compile's environment."""
    plan = _shipped(tmp_path, name)
    compiles = [n for n in plan["nodes"] if n["kind"] == "compile"]
    vision = {n["params"]["bucket"]: n for n in compiles if n["params"]["graph"] == "vision"}
    assert sorted(vision) == [1024, 4096]
    for bucket, node in vision.items():
        cfg = node["neuron_config"]
        assert node["params"]["tp"] == tp and node["neffs"] == tp
        if tp == 1:
            assert (cfg["trace"], cfg["model_class"], cfg["file"]) == ("torch_neuronx.trace", "CPUVisionModel",
                                                                         f"vision_encoder_{bucket}.pt")
        else:
            assert (cfg["trace"], cfg["model_class"], cfg["file"]) == ("parallel_model_trace",
                                                                         "NeuronQwen35VisionModel", f"bucket_{bucket}")
            assert cfg["tp_degree"] == tp and cfg["shards"] == [f"tp_{r}.pt" for r in range(tp)]
            assert node["name"] == f"compile vision-{bucket} (neuron, tp{tp})"
    (text,) = [n for n in compiles if n["params"]["graph"] == "text"]
    nc = text["neuron_config"]["neuron_config"]
    assert nc["context_encoding_buckets"] == [512, 1024, 2048, 4096, 8192] and nc["token_generation_buckets"] == [8192]
    assert text["params"]["vision_inputs"] is True
    assert text["neuron_config"]["env"].items() >= VL_ENV.items()
    # The largest image (2048x2048: four 4096-patch tiles, 4096 image tokens) fits the largest context bucket.
    assert plan_image((1, 128, 128), sorted(vision), 2).tiled and 4096 + 2 + 24 <= max(nc["context_encoding_buckets"])


@pytest.mark.parametrize("env,field", [
    ({}, "port.env.QWEN36_DELTANET_CTE_IMPL"),
    ({"QWEN36_DELTANET_CTE_IMPL": "legacy_direct"}, "port.env.QWEN36_DELTANET_MULTIHEAD_CTE"),
    ({"QWEN36_DELTANET_CTE_IMPL": "current", "QWEN36_DELTANET_MULTIHEAD_CTE": "0"},
     "port.env.QWEN36_DELTANET_CTE_IMPL"),
])
def test_a_vl_recipe_without_the_vl_switches_is_refused(tmp_path, small_checkpoints, env, field):
    """A main-lineage recipe with vision and without the switches its port's VL scripts set is refused in one line
    naming the switch, exit 2, before anything is built."""
    recipe = write_recipe(tmp_path / "vl.yaml", small_checkpoints["qwen3_5"], MAIN_PORT, vision={"buckets": [64]},
                          port={"env": env})
    proc = qbuild("plan", str(recipe), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert f": {field}: a recipe with vision needs" in line and "docs/vision.md section 4" in line


def test_a_vision_tp_that_does_not_split_the_encoder_is_refused(tmp_path, small_checkpoints):
    recipe = write_recipe(tmp_path / "vl.yaml", small_checkpoints["qwen3_5"], MAIN_PORT, port={"env": VL_ENV},
                          vision={"buckets": [64], "tp": 3})
    proc = qbuild("plan", str(recipe), cwd=tmp_path)
    assert proc.returncode == 2
    assert "vision.tp: tp=3 does not divide the vision encoder's hidden size 32" in proc.stderr


def test_the_double_refuses_image_features_traced_with_the_fused_prefill():
    """The port traces context encoding for image features with whatever DeltaNet prefill the environment selects;
    with the fused multi-head one the bundle answers images with degenerate text (2B README), so the double refuses
    that trace, and takes it with the VL scripts' switches."""
    code = ("import json, os, sys; from types import SimpleNamespace as NS\n"
            "sys.path.insert(0, sys.argv[1])\n"
            "from src.modeling_qwen35 import NeuronQwen35Model\n"
            "from neuronx_distributed_inference.models.model_wrapper import CONTEXT_ENCODING_MODEL_TAG as CTE\n"
            "config = NS(use_text_only_cte_inputs=False, _is_moe=False)\n"
            "try:\n    NeuronQwen35Model.trace(config, CTE, 32, 32, 64); print('traced')\n"
            "except ValueError as e:\n    print(e)\n")
    outs = []
    for env in ({}, VL_ENV):
        proc = subprocess.run([sys.executable, "-c", code, str(MAIN_PORT)], capture_output=True, text=True,
                              env={**{k: v for k, v in os.environ.items() if not k.startswith("QWEN36_")}, **env,
                                   "PYTHONPATH": os.pathsep.join((str(SITE), str(REPO)))})
        assert proc.returncode == 0, proc.stderr
        outs.append(proc.stdout.strip())
    assert "the fused DeltaNet prefill degenerates on vision embeddings" in outs[0] and outs[1] == "traced"


# --- a VL build with a TP-sharded encoder --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vl_tp(tmp_path_factory, small_checkpoints):
    """The tiny Qwen3.5 with vision buckets 16 and 64 and its encoder over 2 ranks, built with the double and the
    fake of the 2B port (whose wrapper loads TP encoders), and its bundle pulled."""
    build = Build(tmp_path_factory.mktemp("neuron-vision"))
    port = vision_tp_port(build.root / "port-2b")
    build.recipe = write_recipe(build.root / "recipes" / "vl.yaml", small_checkpoints["qwen3_5"], port,
                                vision={"buckets": [16, 64], "tp": 2}, port={"env": VL_ENV})
    build.result, build.stderr = build.compile(build.recipe)
    compiled(build.result, build.stderr)
    require_bundle(build.result, build.stderr)
    bundle = build.root / "bundle"
    pulled = build.cli("pull", "vl", "--to", str(bundle), "--allow-unverified")
    assert pulled.returncode == 0, pulled.stderr
    return build, bundle


@pytest.mark.slow
def test_the_tp_encoder_is_traced_by_nxd_per_bucket(vl_tp):
    """One parallel_model_trace per bucket of the port's NeuronQwen35VisionModel over 2 ranks, from qbuild's picklable
    factory, with the vision compiler arguments and the (hidden, mask, (cos, sin)) inputs; each rank holds its slice
    of the column (qkv, fc1) and row (proj, fc2) layers and the whole merger, in bfloat16. The text model was traced
    for image features with the VL switches."""
    build, _ = vl_tp
    traces = sorted(build.calls("parallel_model_trace"), key=lambda c: c["example_inputs"][0]["shape"][0])
    assert [t["example_inputs"][0]["shape"][0] for t in traces] == [16, 64]
    assert not build.calls("torch_neuronx.trace")
    for trace in traces:
        s = trace["example_inputs"][0]["shape"][0]
        assert trace["tp_degree"] == 2 and trace["func"] == "qbuild.backends.neuron.sdk_worker.tp_vision_model"
        assert trace["module"] == "src.modeling_qwen35_vision.NeuronQwen35VisionModel"
        assert trace["compiler_args"] == f"{VISION_ARGS} --target=trn2 --lnc=2 {RECIPE_FLAG}".split()
        assert trace["example_inputs"] == [{"shape": [s, 32], "dtype": "bfloat16"},
                                           {"shape": [1, 1, s, s], "dtype": "bfloat16"},
                                           [{"shape": [s, 16], "dtype": "bfloat16"}] * 2]
        for rank in trace["ranks"]:
            shapes = {k: v["shape"] for k, v in rank.items()}
            assert shapes["blocks.0.attn.qkv.weight"] == [48, 32] and shapes["blocks.0.attn.qkv.bias"] == [48]
            assert shapes["blocks.0.attn.proj.weight"] == [32, 16] and shapes["blocks.0.attn.proj.bias"] == [32]
            assert shapes["blocks.1.mlp.linear_fc1.weight"] == [32, 32]
            assert shapes["blocks.1.mlp.linear_fc2.weight"] == [32, 32]
            assert shapes["merger_fc1.weight"] == [128, 128]
            assert {v["dtype"] for v in rank.values()} == {"bfloat16"}
    (call,) = build.calls("compile")
    vision = [n for n in call["neffs"] if n["traced"]["vision_inputs"]]
    assert vision and all(n["traced"]["env"]["QWEN36_DELTANET_CTE_IMPL"] == "legacy_direct" and
                          n["traced"]["deltanet_multihead_cte"] is False for n in vision)


_WRAPPER = """
import json, sys
from types import SimpleNamespace
port, bundle, grids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
sys.path.insert(0, port)
from src.modeling_qwen35_vision import NeuronQwen35VisionModelWrapper
config = SimpleNamespace(**json.load(open(f"{bundle}/config.json"))["vision_config"])
wrapper = NeuronQwen35VisionModelWrapper(config, model_cls=None, vision_seq_len_buckets=[1024, 4096, 16384])
wrapper.load_compiled(bundle)
print(json.dumps({"buckets": wrapper.vision_seq_len_buckets, "tp": wrapper.tp_buckets,
                  "routes": [wrapper.route([g]) for g in grids]}))
"""

GRIDS = [(1, 4, 4), (1, 8, 6), (1, 8, 8), (1, 16, 16), (1, 16, 8), (1, 14, 16), (1, 18, 16)]


@pytest.mark.slow
def test_the_port_loads_the_bundles_encoders_and_tiles_as_the_record_says(vl_tp):
    """The port's wrapper, from the bundle's own copy of the port, loads its vision directory: both buckets, TP-sharded
    over 2 ranks. For every image grid it then picks the bucket (or the 2x2 tiles) qbuild's runtime picks and the
    bundle's qbuild-vision.json describes; the images qbuild refuses are those the port would assert on, or run on a
    CPU encoder."""
    build, bundle = vl_tp
    for b in (16, 64):
        assert sorted(p.name for p in (bundle / f"bucket_{b}").iterdir()) == ["tp_0.pt", "tp_1.pt"]
    record = json.loads((bundle / "qbuild-vision.json").read_text())
    assert record["buckets"] == [16, 64] and record["env"] == VL_ENV
    assert {b: e["tp"] for b, e in record["encoders"].items()} == {"16": 2, "64": 2}
    assert record["tiling"] == {"tiles": [2, 2], "above_patches": 64, "max_patches": 256,
                                "tile_bucket": "the smallest bucket of at least patches / 4"}
    env = dict(os.environ, **build.env(log=build.root / "wrapper.jsonl"))
    proc = subprocess.run([sys.executable, "-c", _WRAPPER, str(bundle / "port"), str(bundle), json.dumps(GRIDS)],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    port = json.loads(proc.stdout.strip().splitlines()[-1])
    assert port["buckets"] == [16, 64] and port["tp"] == {"16": 2, "64": 2}
    for grid, route in zip(GRIDS, port["routes"]):
        try:
            plan = plan_image(grid, record["buckets"], merge=2)
        except ImageTooLarge:
            assert route[0] in ("assert", "cpu-fallback"), (grid, route)
            continue
        assert route == ["tiled" if plan.tiled else "bucket", plan.bucket], (grid, route)
        assert plan.tiled == (grid[0] * grid[1] * grid[2] > record["tiling"]["above_patches"])


@pytest.mark.slow
def test_a_port_without_tp_encoders_fails_the_vision_compile_in_one_line(vl_tp, small_checkpoints, tmp_path):
    """The 35B-A3B port's wrapper loads no TP encoder: a recipe asking for one fails its vision compile naming that,
    rather than package a bundle the port cannot load."""
    build, _ = vl_tp
    recipe = write_recipe(tmp_path / "vl35.yaml", small_checkpoints["qwen3_5"], MAIN_PORT,
                          vision={"buckets": [16], "tp": 2}, port={"env": VL_ENV})
    result, stderr = build.compile(recipe, "--keep-going", lock=tmp_path / "x.lock")
    (failed,) = [f for f in result["failed"].values() if f["name"].startswith("compile vision-16")]
    assert "loads no TP-sharded vision encoder (it has no _TPVisionAdapter" in failed["error"]
    assert "\n" not in failed["error"].strip()


@pytest.mark.slow
def test_vllm_serves_a_vl_bundle_as_text_and_says_so(vl_tp, tmp_path):
    """`qbuild serve --server vllm --dry-run` of the VL bundle says images are not served and why (vllm-neuron 0.5's
    multimodal path, cited) and where they are; --allow-image-urls is refused in one line; served through the vLLM
    double, an image part gets vLLM's own 400, since the bundle's plugin registers the text model."""
    from tests.test_neuron_serve import Served, _post

    build, bundle = vl_tp
    proc = build.cli("serve", str(bundle), "--server", "vllm", "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    images = json.loads(proc.stdout)["images"]
    assert images["served"] is False and images["vision_buckets"] == [16, 64]
    assert "NEURON_MULTI_MODAL_MODELS (vllm_neuron/worker/constants.py:4-10 @ 3afb0a9)" in images["why"]
    assert images["images_elsewhere"].startswith("`qbuild serve` of this bundle without --server vllm")
    refused = build.cli("serve", str(bundle), "--server", "vllm", "--dry-run", "--allow-image-urls")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "error: --allow-image-urls: vLLM's Neuron plugin cannot serve this VL bundle's images; drop the flag (or drop "
        "--server vllm: qbuild's server takes them) (docs/vllm.md section 11)"]
    served = Served(build, str(bundle), tmp_path, "--server", "vllm")
    try:
        url = served.url()
        assert url, served.stop()[1]
        chat = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                                             {"type": "text", "text": "hi"}]}]
        status, answer = _post(url + "/chat/completions", {"model": "bundle", "messages": chat})
        assert status == 400 and answer["error"]["message"] == f"{bundle} is not a multimodal model"
    finally:
        code, err = served.stop()
    assert code == 0, err
    assert "warning: images are not served" in err
    assert not [c for c in read_log(served.log) if c["call"] == "compile"]
