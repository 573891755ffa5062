"""The bad-input corpus: every broken recipe exits 2 with one line naming the file and field, writing nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qbuild import backends
from qbuild.core.errors import RecipeError, UserError
from qbuild.recipe.schema import HFSource, PathSource, load_recipe
from qbuild.hub.source import shipped_config_path
from tests.conftest import qbuild

BASE = """\
text:
  seq_len: 128
  cte_buckets: [32, 64]
dtype: float32
backend: export
"""


def _checkpoint(root: Path, repo: str, **overrides) -> Path:
    """A checkpoint directory holding just a config.json (planning reads nothing else)."""
    cfg = json.loads(shipped_config_path(repo).read_text())
    text = cfg.get("text_config", cfg)
    text.update(overrides)
    d = root / repo.replace("/", "--")
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


NEURON_BASE = """\
text:
  seq_len: 512
  cte_buckets: [128, 512]
backend: neuron
toolchain: {neuronx_cc: 2.26.6360.0, neuronx_distributed: 0.19.28492, neuronx_distributed_inference: 0.10.18399,
            torch_neuronx: 2.9.0.2}
"""

CASES = {
    # name: (recipe text, the field the message must name)
    "yaml-syntax": ("model: {hf: Qwen/Qwen3.5-2B\ntext: [", "invalid YAML"),
    "unknown-key": ("model: {hf: Qwen/Qwen3.5-2B}\nturbo: true\n" + BASE, "turbo: unknown field"),
    "unknown-nested-key": ("model: {hf: Qwen/Qwen3.5-2B}\nparallel: {tp: 2, pp: 2}\n" + BASE, "parallel.pp"),
    "wrong-type": ("model: {hf: Qwen/Qwen3.5-2B}\nparallel: {tp: eight}\n" + BASE, "parallel.tp"),
    "tp-not-dividing-heads": ("model: {hf: Qwen/Qwen3.5-2B}\nparallel: {tp: 3}\n" + BASE, "parallel.tp"),
    "unsorted-buckets": ("model: {hf: Qwen/Qwen3.5-2B}\ntext: {seq_len: 128, cte_buckets: [64, 32]}\n",
                         "text.cte_buckets"),
    "duplicate-buckets": ("model: {hf: Qwen/Qwen3.5-2B}\ntext: {seq_len: 128, cte_buckets: [32, 32]}\n",
                          "text.cte_buckets"),
    "bucket-over-seq-len": ("model: {hf: Qwen/Qwen3.5-2B}\ntext: {seq_len: 64, cte_buckets: [32, 128]}\n",
                            "text"),
    "bad-fp8-value": ("model: {hf: Qwen/Qwen3.5-2B}\nfp8: int4\n" + BASE, "fp8"),
    "fp8-full-on-moe": ("model: {hf: Qwen/Qwen3.5-35B-A3B}\nparallel: {tp: 8}\nfp8: full\n" + BASE, "fp8"),
    "missing-model-source": ("model: {revision: main}\n" + BASE, "model"),
    "two-model-sources": ("model: {hf: Qwen/Qwen3.5-2B, path: ./x}\n" + BASE, "model"),
    "missing-text": ("model: {hf: Qwen/Qwen3.5-2B}\n", "text"),
    "vision-on-text-only": ("model: {hf: Qwen/Qwen3-Coder-Next}\nparallel: {tp: 8}\nvision: {buckets: [1024]}\n"
                            + BASE, "vision"),
    "vision-bucket-not-mergeable": ("model: {hf: Qwen/Qwen3.5-2B}\nvision: {buckets: [1022]}\n" + BASE,
                                    "vision.buckets.0"),
    "moe-backend-on-dense": ("model: {hf: Qwen/Qwen3.5-2B}\nmoe_backend: torch_blockwise\n" + BASE, "moe_backend"),
    "ep-on-dense": ("model: {hf: Qwen/Qwen3.5-2B}\nparallel: {tp: 2, ep: 2}\n" + BASE, "parallel.ep"),
    "ep-not-dividing-tp": ("model: {hf: Qwen/Qwen3.5-35B-A3B}\nparallel: {tp: 4, ep: 3}\n" + BASE, "parallel"),
    "over-device-memory": ("model: {hf: Qwen/Qwen3-Coder-Next}\nparallel: {tp: 4}\ndtype: bfloat16\n"
                           "text: {seq_len: 1024, cte_buckets: [128]}\n", "parallel.tp"),
    "path-not-a-dir": ("model: {path: ./does-not-exist}\n" + BASE, "model.path"),
    "bad-name": ("name: 'bad name!'\nmodel: {hf: Qwen/Qwen3.5-2B}\n" + BASE, "name"),
    "duplicate-key": ("model: {hf: Qwen/Qwen3.5-2B}\ndtype: float32\n" + BASE, "duplicate key"),
    "bad-target": ("model: {hf: Qwen/Qwen3.5-2B}\ncompiler: {target: trn9}\n" + BASE, "compiler.target"),
    # neuron builds: a port that serves the recipe and a pinned SDK
    "backend-auto-is-gone": ("model: {hf: Qwen/Qwen3.5-2B}\n" + BASE.replace("export", "auto"), "backend"),
    "neuron-without-port": ("model: {hf: Qwen/Qwen3.5-2B}\n" + NEURON_BASE, "port"),
    "neuron-without-pins": ("model: {hf: Qwen/Qwen3.5-2B}\nport: {path: ./p}\n" + NEURON_BASE.split("toolchain")[0],
                            "toolchain"),
    "moe-lineage-for-dense": ("model: {hf: Qwen/Qwen3.5-2B}\nport: {lineage: moe, path: ./p}\n" + NEURON_BASE,
                              "port.lineage"),
    "main-lineage-for-coder-next": ("model: {hf: Qwen/Qwen3-Coder-Next}\nparallel: {tp: 8}\n"
                                    "port: {lineage: main, path: ./p}\n" + NEURON_BASE, "port.lineage"),
    "main-lineage-with-ep": ("model: {hf: Qwen/Qwen3.5-35B-A3B}\nparallel: {tp: 8, ep: 2}\nport: {path: ./p}\n"
                             + NEURON_BASE, "parallel.ep"),
    "moe-lineage-with-ep": ("model: {hf: Qwen/Qwen3-Coder-Next}\nparallel: {tp: 8, ep: 2}\n"
                            "port: {path: ./p}\n" + NEURON_BASE, "parallel.ep"),
    "moe-lineage-with-vision": ("model: {hf: Qwen/Qwen3.5-35B-A3B}\nparallel: {tp: 8}\nvision: {buckets: [1024]}\n"
                                "port: {lineage: moe, path: ./p}\n" + NEURON_BASE, "vision"),
    "neuron-vision-not-bf16": ("model: {hf: Qwen/Qwen3.5-2B}\nvision: {buckets: [1024]}\ndtype: float32\n"
                               "port: {path: ./p}\n" + NEURON_BASE, "dtype"),
    "neuron-fp8-full": ("model: {hf: Qwen/Qwen3.5-27B}\nparallel: {tp: 8}\nfp8: full\nport: {path: ./p}\n"
                        + NEURON_BASE, "fp8"),
    "neuron-fp8-moe": ("model: {hf: Qwen/Qwen3.5-35B-A3B}\nparallel: {tp: 8}\nfp8: mlp_only\nport: {path: ./p}\n"
                       + NEURON_BASE, "fp8"),
    "port-path-and-module": ("model: {hf: Qwen/Qwen3.5-2B}\nport: {path: ./p, module: x}\n" + NEURON_BASE, "port"),
    # fields that can never work together, refused before anything is fetched or built
    "tkg-below-largest-cte": ("model: {hf: Qwen/Qwen3.5-2B}\n"
                              + BASE.replace("[32, 64]", "[32, 64]\n  tkg_buckets: [48]"),
                              "text.tkg_buckets: the largest token-generation bucket 48 is smaller than the largest "
                              "context-encoding bucket 64"),
    "tkg-over-seq-len": ("model: {hf: Qwen/Qwen3.5-2B}\n"
                         + BASE.replace("[32, 64]", "[32, 64]\n  tkg_buckets: [64, 256]"),
                         "text.tkg_buckets: [256] exceed seq_len 128"),
    "vision-bucket-beyond-context": ("model: {hf: Qwen/Qwen3.5-2B}\nvision: {buckets: [64, 65536]}\n" + BASE,
                                     "vision.buckets.1: 65536 patch tokens merge to 16384 image tokens"),
    "vision-bucket-just-beyond-context": ("model: {hf: Qwen/Qwen3.5-2B}\nvision: {buckets: [64, 252]}\n" + BASE,
                                          "vision.buckets.1: 252 patch tokens merge to 63 image tokens (65 with"),
    "verify-image-beyond-vision-buckets": ("model: {hf: Qwen/Qwen3.5-2B}\nvision: {buckets: [16]}\n" + BASE,
                                           "vision.buckets: the verify image (96x64 pixels) is 24 patch tokens"),
    "new-tokens-beyond-kv": ("model: {hf: Qwen/Qwen3.5-2B}\nverify: {new_tokens: 200}\n" + BASE,
                             "verify.new_tokens: 200 new tokens"),
    "golden-prompt-beyond-context": ("model: {hf: Qwen/Qwen3.5-2B}\n" + BASE.replace("[32, 64]", "[4]"),
                                     "text.cte_buckets: the verify prompt 'The lockfile pins every input, and the "
                                     "store keeps' is at least 9 tokens"),
    "recipe-prompt-beyond-context": ("model: {hf: Qwen/Qwen3.5-2B}\nverify: {prompts: [one two three four five]}\n"
                                     + BASE.replace("[32, 64]", "[4]"), "verify.prompts"),
    "image-prompt-beyond-context": ("model: {hf: Qwen/Qwen3.5-2B}\nvision: {buckets: [24]}\nverify: {prompts: [hi]}\n"
                                    + BASE.replace("[32, 64]", "[10]"), "'Describe this image.' with the verify image"),
    "empty-verify-prompt": ("model: {hf: Qwen/Qwen3.5-2B}\nverify: {prompts: [hi, '']}\n" + BASE,
                            "verify.prompts: prompt 1 is empty"),
}


def _write(tmp: Path, name: str, text: str) -> Path:
    f = tmp / "recipes" / f"{name}.yaml"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(text)
    return f


def _assert_rejected(proc, recipe: Path, needle: str, tmp: Path) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(recipe) in lines[0] or recipe.name in lines[0], lines[0]
    assert needle in lines[0], lines[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp / "store").exists() and not (tmp / "artifacts.lock").exists()


# One case of each kind of check, through the CLI: YAML, the schema, the model's architecture, device memory, the
# neuron port and toolchain, the buckets against each other and against the verify prompts and image.
CLI_CASES = {"yaml-syntax", "unknown-nested-key", "tp-not-dividing-heads", "over-device-memory", "path-not-a-dir",
             "neuron-without-port", "neuron-without-pins", "tkg-below-largest-cte", "vision-bucket-beyond-context",
             "golden-prompt-beyond-context"}
assert CLI_CASES <= CASES.keys()


@pytest.mark.parametrize("case", sorted(CASES))
def test_broken_recipe_is_one_error_naming_file_and_field(tmp_path, case):
    """What `qbuild recipe validate` and every command that plans run: the schema, then the checks against the
    model's architecture."""
    from qbuild.planning.plan import validate_recipe
    from qbuild.hub.source import load_arch

    text, needle = CASES[case]
    recipe = _write(tmp_path, case, text)
    with pytest.raises(UserError) as err:
        loaded = load_recipe(recipe)
        validate_recipe(loaded, load_arch(loaded), backends)
    message = str(err.value)
    assert "\n" not in message and needle in message, message
    assert str(recipe) in message or recipe.name in message, message


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_compile_of_a_broken_recipe_exits_2_in_one_line_writing_nothing(tmp_path, case):
    text, needle = CASES[case]
    recipe = _write(tmp_path, case, text)
    proc = qbuild("compile", str(recipe), "--store", str(tmp_path / "store"), "--lock",
                  str(tmp_path / "artifacts.lock"), cwd=tmp_path)
    _assert_rejected(proc, recipe, needle, tmp_path)


def test_error_points_at_line_and_column(tmp_path):
    recipe = _write(tmp_path, "pos", "model: {hf: Qwen/Qwen3.5-2B}\nparallel:\n  tp: 3\n" + BASE)
    proc = qbuild("recipe", "validate", str(recipe))
    assert proc.returncode == 2
    assert f"{recipe}:3:" in proc.stderr  # the `tp` line


def test_extends_cycle(tmp_path):
    a = _write(tmp_path, "a", "extends: b.yaml\n")
    _write(tmp_path, "b", "extends: a.yaml\n")
    proc = qbuild("plan", str(a), "--store", str(tmp_path / "store"), "--lock", str(tmp_path / "artifacts.lock"))
    _assert_rejected(proc, a, "extends cycle", tmp_path)


def test_extends_missing_file(tmp_path):
    a = _write(tmp_path, "a", "extends: nowhere.yaml\nmodel: {hf: Qwen/Qwen3.5-2B}\n")
    proc = qbuild("plan", str(a), "--store", str(tmp_path / "store"), "--lock", str(tmp_path / "artifacts.lock"))
    _assert_rejected(proc, a, "extends", tmp_path)


def test_ep_not_dividing_experts(tmp_path):
    ckpt = _checkpoint(tmp_path, "Qwen/Qwen3.5-35B-A3B", num_experts=250)
    recipe = _write(tmp_path, "ep", f"model: {{path: {ckpt}}}\nparallel: {{tp: 4, ep: 4}}\n" + BASE)
    proc = qbuild("compile", str(recipe), "--store", str(tmp_path / "store"), "--lock",
                  str(tmp_path / "artifacts.lock"))
    _assert_rejected(proc, recipe, "parallel.ep", tmp_path)
    assert "250 experts" in proc.stderr


def test_deltanet_heads_not_divisible(tmp_path):
    ckpt = _checkpoint(tmp_path, "Qwen/Qwen3.5-2B", linear_num_value_heads=12)
    recipe = _write(tmp_path, "dn", f"model: {{path: {ckpt}}}\nparallel: {{tp: 8}}\n" + BASE)
    proc = qbuild("recipe", "validate", str(recipe))
    assert proc.returncode == 2 and "DeltaNet value heads" in proc.stderr


def test_unknown_model_type(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    recipe = _write(tmp_path, "llama", f"model: {{path: {d}}}\n" + BASE)
    proc = qbuild("plan", str(recipe), "--store", str(tmp_path / "store"), "--lock", str(tmp_path / "artifacts.lock"))
    assert proc.returncode == 2 and "model_type" in proc.stderr and "config.json" in proc.stderr
    assert not (tmp_path / "store").exists()


def test_a_recipe_switches_its_bases_hub_source_to_a_local_path(tmp_path):
    """The model source is one of two types; `hf: null` drops a base's hub repo (and the revision that pinned it)."""
    _write(tmp_path, "base", "model: {hf: Qwen/Qwen3.5-2B, revision: v1}\n" + BASE)
    local = load_recipe(_write(tmp_path, "local", "extends: base.yaml\nmodel: {hf: null, path: ./ckpt}\n"))
    assert local.recipe.model == PathSource(path="./ckpt")
    assert local.source_dir == (tmp_path / "recipes" / "ckpt").resolve()
    hub = load_recipe(tmp_path / "recipes" / "base.yaml")
    assert hub.recipe.model == HFSource(hf="Qwen/Qwen3.5-2B", revision="v1") and hub.source_dir is None
    with pytest.raises(RecipeError) as info:   # a path added without dropping the repo names two sources
        load_recipe(_write(tmp_path, "both", "extends: base.yaml\nmodel: {path: ./ckpt}\n"))
    assert str(info.value).endswith(":2:8: model: give exactly one of `hf` or `path`"), info.value
    with pytest.raises(RecipeError) as info:   # an error inside one source names its field, not the union's tag
        load_recipe(_write(tmp_path, "bad-repo", "model: {hf: 'not a repo'}\n" + BASE))
    assert str(info.value).endswith(":1:13: model.hf: String should match pattern '^[\\w.-]+/[\\w.-]+$'"), info.value


def test_shipped_recipes_validate():
    recipes = sorted(Path("recipes").glob("*.yaml"))
    assert len(recipes) == 7
    proc = qbuild("recipe", "validate", *map(str, recipes))
    assert proc.returncode == 0, proc.stderr


def test_schema_is_json_schema():
    proc = qbuild("recipe", "schema", check=True)
    schema = json.loads(proc.stdout)
    assert schema["additionalProperties"] is False and "parallel" in schema["properties"]


# --- the bounds the checks rest on ------------------------------------------------------------------------------

def _validate(tmp: Path, text: str):
    from qbuild.planning.plan import validate_recipe
    from qbuild.hub.source import load_arch

    loaded = load_recipe(_write(tmp, "r", text))
    validate_recipe(loaded, load_arch(loaded), backends)


def test_new_tokens_are_refused_exactly_past_the_bound_the_message_names(tmp_path):
    """With the shipped prompts (the longest is 9 words) and a token-generation bucket of 64, the message's own
    suggestion passes and one token more does not."""
    text = "model: {hf: Qwen/Qwen3.5-2B}\nverify: {new_tokens: %d}\n" + BASE.replace("[32, 64]", "[32, 64]\n  "
                                                                                         "tkg_buckets: [64]")
    with pytest.raises(RecipeError, match=r"use new_tokens <= 56$"):
        _validate(tmp_path, text % 57)
    _validate(tmp_path, text % 56)


def test_a_vision_bucket_that_fills_the_context_exactly_is_accepted(tmp_path):
    """248 patch tokens merge to 62 image tokens, 64 with <|vision_start|> and <|vision_end|>: the largest context
    bucket of 64 holds them (and the verify prompts still fit beside the 24-patch verify image)."""
    _validate(tmp_path, "model: {hf: Qwen/Qwen3.5-2B}\nvision: {buckets: [64, 248]}\n" + BASE)


def test_the_verify_image_is_cut_into_the_patches_transformers_makes(tiny_checkpoints):
    """image_patches mirrors transformers' Qwen2-VL processor (which the reference and the runtime use) for the
    reference's synthetic image and for sizes that resize up, down and to the pixel bounds."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from PIL import Image

    from qbuild.model.arch import arch_from_config
    from qbuild.model.sizes import VERIFY_IMAGE_SIZE as IMAGE_SIZE, image_patches

    for config in (shipped_config_path("Qwen/Qwen3.5-2B"), tiny_checkpoints["qwen3_5"] / "config.json"):
        vision = arch_from_config(json.loads(config.read_text())).vision
        processor = Qwen2VLImageProcessorPil(patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
                                             temporal_patch_size=vision.temporal_patch_size)
        for height, width in (IMAGE_SIZE, (20, 30), (100, 1000), (3000, 4000), (17, 3000)):
            grid = processor(images=[Image.new("RGB", (width, height))], return_tensors="pt")["image_grid_thw"]
            assert image_patches(vision, height, width) == int(grid.prod()), (config, height, width)


def test_prompt_token_bound_never_exceeds_what_the_tokenizer_makes(tiny_checkpoints):
    """min_prompt_tokens is a lower bound: the tiny checkpoints' byte-level BPE (GPT-2's pre-tokenizer, as Qwen's
    is byte-level BPE with a regex split) makes at least that many tokens of every shipped prompt and of prompts
    written to tempt a merge across a space."""
    from tokenizers import Tokenizer

    from qbuild.recipe.checks import golden_prompts, min_prompt_tokens

    tokenizer = Tokenizer.from_file(str(tiny_checkpoints["qwen3_5"] / "tokenizer.json"))
    golden = golden_prompts()
    prompts = golden["prompts"] + [golden["image_prompt"], "the the the the", "  leading and trailing  ",
                                   "a\nb\tc  d", "x" * 200, "1, 2, 3, 4, 5, 6, 7, 8, 9, 10"]
    for prompt in prompts:
        assert len(tokenizer.encode(prompt, add_special_tokens=False).ids) >= min_prompt_tokens(prompt), prompt
