"""Images on the CPU backends: which bucket an image runs through and when it is cut into 2x2 tiles (the VL ports' rule,
docs/vision.md), the vision encoder computed as its TP-sharded form, the checkpoint's processor settings, and a tiny VL
bundle against transformers: the prompt's tokens and the greedy tokens for an image at each vision bucket and for a
tiled one, through `qbuild run` and through `qbuild serve` (OpenAI image parts, queried with the `openai` client).

The tiny bundle is the analogue of the shipped VL recipes (vision buckets 1024 and 4096 patch tokens, a 2048x2048
image tiled): vision buckets 16 and 64, images of 64x64 (16 patches), 128x128 (64) and 256x256 pixels (256 patches:
four 8x8-patch tiles through the 64 bucket), the tiny vision encoder's patch being 16 pixels as the real one's. Its
checkpoint carries a preprocessor_config.json with pixel bounds scaled the same way (at most 256x256 pixels), which
transformers' AutoImageProcessor reads as qbuild's runtime does. The encoder is computed as over 2 ranks
(`vision: {tp: 2}`), so every comparison with transformers also checks that sharding rule.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Callable
from urllib.parse import urlsplit

import pytest
import torch

from qbuild.backends.openai_server.serve_images import IMAGE_URL_TIMEOUT_S, MAX_IMAGE_FETCHES
from qbuild.model.arch import VisionArch
from qbuild.model.modeling.vision import VisionEncoder, split_tiles, stitch_tiles
from qbuild.model.tiling import ImagePlan, ImageTooLarge, largest_patches, plan_image
from tests.conftest import REPO, qbuild, wait_until
from tests.test_serve_images import Origin

pytestmark = pytest.mark.xdist_group("vision-images")

NAME = "tiny-vl"
PROMPT = "Describe this image."
NEW_TOKENS = 6
# The analogues of 512x512, 1024x1024 and 2048x2048 (docs/vision.md section 1): (bucket, tiled) each runs through.
IMAGES = {"64px": ((64, 64), 16, False), "128px": ((128, 128), 64, False), "256px": ((256, 256), 64, True)}
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
                "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3,
                "image_std": [0.5] * 3, "size": {"shortest_edge": 64 * 64, "longest_edge": 256 * 256}}
RECIPE = """name: tiny-vl
model: {{path: {model}}}
parallel: {{tp: 1}}
text: {{seq_len: 160, cte_buckets: [32, 128], tkg_buckets: [160]}}
vision: {{buckets: [16, 64], tp: 2}}
dtype: float32
backend: export
verify: {{prompts: ["Hello"], new_tokens: 4, top1_min: 0.99, token_match_min: 1.0, max_logit_err: 0.001}}
"""
TINY_VISION = VisionArch(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                         patch_size=16, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=64)


def picture(path: Path, size: tuple[int, int], seed: int = 0) -> Path:
    """A deterministic RGB picture (gradients, a checker, a bright square placed by `seed`) as PNG."""
    import numpy as np
    from PIL import Image

    w, h = size
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), ((x // 16 + y // 16) % 2) * 180 + 40], -1)
    r, c = (seed * 37) % h, (seed * 53) % w
    rgb[r:r + h // 4, c:c + w // 4] = 255
    Image.fromarray(rgb.astype("uint8"), "RGB").save(path, format="PNG")
    return path


# --- the rule, without a bundle ----------------------------------------------------------------------------------

@pytest.mark.parametrize("grid,buckets,expected", [
    ((1, 32, 32), [1024, 4096], ImagePlan(1024, False)),     # 512x512
    ((1, 64, 64), [1024, 4096], ImagePlan(4096, False)),     # 1024x1024
    ((1, 128, 128), [1024, 4096], ImagePlan(4096, True)),    # 2048x2048: four 4096-patch tiles
    ((1, 68, 64), [1024, 4096], ImagePlan(4096, True)),      # just past the largest: a tile of 1088 takes 4096
    ((1, 64, 128), [1024, 4096, 8192], ImagePlan(8192, False)),
    ((1, 8, 8), [16, 64], ImagePlan(64, False)),
    ((1, 16, 16), [16, 64], ImagePlan(64, True)),
    ((1, 16, 8), [16, 64], ImagePlan(64, True)),             # tiles of 8x4 = 32 patches
    ((1, 8, 8), [4, 16], ImagePlan(16, True)),               # tiles of 16 take the largest
])
def test_plan_picks_the_smallest_bucket_or_tiles_through_it(grid, buckets, expected):
    assert plan_image(grid, buckets, merge=2) == expected


@pytest.mark.parametrize("grid,why", [
    ((1, 130, 128), "more than four tiles of the largest vision bucket 4096 hold (16384)"),
    ((1, 126, 126), "the port tiles a still image whose patch rows and columns are multiples of 4"),
    ((2, 64, 64), "the port tiles a still image"),
])
def test_images_the_port_cannot_take_are_refused(grid, why):
    """Past four tiles of the largest bucket the port's wrapper falls back to a CPU encoder; a grid of rows or columns
    not a multiple of 2 x merge makes its _tiled_forward assert (docs/vision.md section 2). qbuild refuses both."""
    with pytest.raises(ImageTooLarge, match=re.escape(why)):
        plan_image(grid, [1024, 4096], merge=2)
    assert largest_patches([1024, 4096]) == 16384


def _block_order(h: int, w: int, merge: int = 2) -> torch.Tensor:
    """(row, column) of each patch in the order the HF processor emits them: merge x merge blocks, block rows first."""
    return torch.tensor([(bh * merge + ih, bw * merge + iw) for bh in range(h // merge) for bw in range(w // merge)
                         for ih in range(merge) for iw in range(merge)], dtype=torch.float32)


def test_tiles_are_cut_from_the_patch_rows_read_as_a_raster():
    """The port reads the processor's patch rows, which are in merge-block order, as an (H, W) raster and cuts its
    quadrants (modeling_qwen35_vision.py:922-930 @ 4bcdc54). On an 8x8 grid of 2x2 blocks that puts block columns 0 and
    2 of the top half in the first tile, 1 and 3 in the second: the tiles are not the image's quadrants. Worked out by
    hand in docs/vision.md section 2."""
    tiles = split_tiles(_block_order(8, 8), (1, 8, 8))
    blocks = [sorted({(int(r) // 2, int(c) // 2) for r, c in t.tolist()}) for t in tiles]
    assert blocks == [[(0, 0), (0, 2), (1, 0), (1, 2)], [(0, 1), (0, 3), (1, 1), (1, 3)],
                      [(2, 0), (2, 2), (3, 0), (3, 2)], [(2, 1), (2, 3), (3, 1), (3, 3)]]
    # Within a tile the blocks keep the processor's order, four patches each: tile 0 is blocks (0,0), (0,2), ...
    first = [(int(r), int(c)) for r, c in tiles[0][:8].tolist()]
    assert first == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 4), (0, 5), (1, 4), (1, 5)]


def test_tile_features_go_to_their_quadrant_of_the_merged_grid():
    """Each tile's merged features, in its own row-major order, fill its quadrant of the image's merged grid (tile 0
    top left, 1 top right, 2 bottom left, 3 bottom right: modeling_qwen35_vision.py:943-961), read back row by row."""
    grid, merge = (1, 8, 12), 2          # merged grid 4 x 6, tiles of 2 x 3 merged tokens
    tiles = [torch.tensor([[t * 100 + i] for i in range(6)], dtype=torch.float32) for t in range(4)]
    out = stitch_tiles(tiles, grid, merge).reshape(4, 6).tolist()
    assert out == [[0, 1, 2, 100, 101, 102], [3, 4, 5, 103, 104, 105],
                   [200, 201, 202, 300, 301, 302], [203, 204, 205, 303, 304, 305]]


def test_sharded_encoder_computes_the_whole_encoder():
    """The port's TP encoder splits qkv and fc1 by output (gathered) and proj and fc2 by input (partial sums added):
    the same function as the whole encoder, to float32 rounding; a tp that does not divide is refused."""
    gen = torch.Generator().manual_seed(0)
    whole = VisionEncoder(TINY_VISION)
    weights = {k: torch.randn(v.shape, generator=gen) * 0.2 for k, v in whole.state_dict().items()}
    whole.load_state_dict(weights)
    inputs = (torch.randn(16, 32, generator=gen), torch.zeros(1, 1, 16, 16), torch.ones(16, 16), torch.zeros(16, 16))
    for tp in (2, 4):
        sharded = VisionEncoder(TINY_VISION, tp=tp)
        sharded.load_state_dict(weights)
        with torch.no_grad():
            assert (sharded(*inputs) - whole(*inputs)).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="tp=3 does not divide the vision encoder's hidden size 32"):
        VisionEncoder(TINY_VISION, tp=3)


def test_the_processor_takes_the_checkpoints_pixel_bounds(tmp_path, small_checkpoints):
    """A 2048x2048 image is 16384 patches under the published Qwen3.5 bounds (preprocessor_config.json `size`), as the
    ports' table says (2B README: 4,096 vision tokens), and would be 3844 under Qwen2-VL's defaults: the runtime reads
    the checkpoint's settings as transformers' AutoImageProcessor does."""
    from transformers import AutoImageProcessor

    from qbuild.model.runtime.images import image_processor, pixels

    ckpt = tmp_path / "ckpt"
    shutil.copytree(small_checkpoints["qwen3_5"], ckpt)
    config = json.loads((ckpt / "config.json").read_text())["vision_config"]
    image = picture(tmp_path / "big.png", (2048, 2048))
    _, default = pixels(image_processor(ckpt, config), image)
    (ckpt / "preprocessor_config.json").write_text(json.dumps(
        {**PREPROCESSOR, "size": {"shortest_edge": 65536, "longest_edge": 16777216}}))
    _, grid = pixels(image_processor(ckpt, config), image)
    expected = AutoImageProcessor.from_pretrained(ckpt)(images=[_rgb(image)], return_tensors="pt")["image_grid_thw"]
    assert grid.tolist() == expected.tolist() == [[1, 128, 128]] and default.tolist() == [[1, 62, 62]]


def _rgb(path: Path):
    from PIL import Image

    with Image.open(path) as img:
        return img.convert("RGB")


def test_image_limits_hold_for_bytes_as_for_files(tmp_path):
    """An image given as bytes (a request's) passes the limits a file does: its encoded size, then its pixels."""
    from qbuild.core.errors import UserError
    from qbuild.model.runtime import images

    small = picture(tmp_path / "small.png", (32, 32)).read_bytes()
    images.check_image(small, "part")
    with pytest.raises(UserError, match=f"part: the image is {images.MAX_IMAGE_BYTES + 1} bytes, more than"):
        images.check_image(b"\0" * (images.MAX_IMAGE_BYTES + 1), "part")
    with pytest.raises(UserError, match="part: cannot read the image"):
        images.check_image(b"not an image", "part")


# Images the Qwen VL processor refuses after decoding (transformers' smart_resize: sides in a ratio over 200), the
# issue's sizes among them, and one of text sent as an image.
LOPSIDED = [(1, 300), (300, 1), (4000, 16), (2, 1000), (1, 201), (16, 3201)]


def _png(size: tuple[int, int]) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, (90, 30, 200)).save(out, "PNG")
    return out.getvalue()


def test_the_aspect_bound_is_the_processors_checked_from_the_header(small_checkpoints):
    """An image is refused from its header exactly where transformers' Qwen VL processor would raise after decoding
    it: sides in a ratio over 200 to 1. The message names the image and the bound; on the bound it is taken."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    from qbuild.core.errors import UserError
    from qbuild.model.runtime import images

    processor = images.image_processor(small_checkpoints["qwen3_5"],
                                       json.loads((small_checkpoints["qwen3_5"] / "config.json").read_text())[
                                           "vision_config"])
    for w, h in LOPSIDED + [(1, 200), (200, 1), (16, 3200), (3, 600), (401, 2)]:
        try:
            smart_resize(h, w, factor=32)
            refused_by_processor = False
        except ValueError:
            refused_by_processor = True
        if refused_by_processor:
            with pytest.raises(UserError) as caught:
                images.check_image(_png((w, h)), "part")
            assert str(caught.value).startswith(f"part: the image is {w}x{h} pixels, its sides in a ratio of ")
            assert "more than the 200 to 1 the Qwen VL image processor takes" in str(caught.value)
        else:
            images.check_image(_png((w, h)), "part")
            _, grid = images.pixels(processor, _png((w, h)), "part")
            assert grid.shape == (1, 3), (w, h)


@pytest.mark.parametrize("data", [b"just some text, sent as image/png", b"", b"\x89PNG\r\n\x1a\n" + b"\0" * 40,
                                  b"GIF89a" + b"\xff" * 20, b"\xff\xd8\xff\xe0" + b"\0" * 64],
                         ids=["text", "empty", "png-header", "gif-header", "jpeg-header"])
def test_bytes_that_are_no_image_are_named_without_a_python_repr(data):
    """Pillow's own message for bytes it cannot identify holds the repr of the stream it read (`<_io.BytesIO object
    at 0x...>`); the refusal names the part and says what was wrong, in words."""
    from qbuild.core.errors import UserError
    from qbuild.model.runtime import images

    with pytest.raises(UserError) as caught:
        images.check_image(data, "messages.0.content.0.image_url")
    message = str(caught.value)
    assert message.startswith("messages.0.content.0.image_url: cannot read the image: ")
    assert not re.search(r"<[^>]* at 0x[0-9a-f]+>", message), message


def test_qbuild_run_refuses_a_lopsided_image_before_loading_a_bundle(tmp_path):
    """`qbuild run --image` of an image the processor cannot take: exit 2, one line naming the file and the bound,
    before any bundle is looked for (the target here does not exist)."""
    image = tmp_path / "1x300.png"
    image.write_bytes(_png((1, 300)))
    proc = qbuild("run", str(tmp_path / "no-bundle"), "--prompt", "hi", "--image", str(image), cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: {image}: the image is 1x300 pixels, its sides in a ratio of 300 to 1, more than the 200 to 1 the "
        "Qwen VL image processor takes; crop or pad it first"]


# --- a tiny VL bundle against transformers -----------------------------------------------------------------------

@dataclass
class Project:
    root: Path
    checkpoint: Path
    bundle: Path
    images: dict[str, Path]

    def env(self) -> dict:
        return {"QBUILD_STORE": str(self.root / "store"), "XDG_CACHE_HOME": str(self.root / "xdg"),
                "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def project(tmp_path_factory, small_checkpoints) -> Project:
    """The tiny Qwen3.5 with a preprocessor_config.json, built with `qbuild compile` (export backend; its verify
    checks the image prompt against transformers), and its bundle pulled."""
    root = tmp_path_factory.mktemp("vision-images")
    checkpoint = root / "checkpoint"
    shutil.copytree(small_checkpoints["qwen3_5"], checkpoint)
    (checkpoint / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    (root / "recipes").mkdir()
    (root / "recipes" / f"{NAME}.yaml").write_text(RECIPE.format(model=checkpoint))
    project = Project(root, checkpoint, root / "bundle",
                      {name: picture(root / f"{name}.png", size, seed=i)
                       for i, (name, (size, _, _)) in enumerate(IMAGES.items())})
    proc = qbuild("compile", "--all", "-j", "2", "--store", "store", cwd=root, env=project.env(), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    pulled = qbuild("pull", NAME, "--to", str(project.bundle), "--store", "store", cwd=root, env=project.env())
    assert pulled.returncode == 0, pulled.stderr
    return project


@pytest.fixture(scope="module")
def runtime(project):
    from qbuild.model.runtime import Runtime

    return Runtime.load(project.bundle)


@pytest.fixture(scope="module")
def hf(project):
    """transformers' own model and image processor of the checkpoint, float32."""
    import transformers

    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(project.checkpoint, dtype=torch.float32)
    model.generation_config.eos_token_id = None   # always all the steps
    return model.eval(), transformers.AutoImageProcessor.from_pretrained(project.checkpoint)


class PortTiles(torch.nn.Module):
    """transformers' vision tower, run per 2x2 tile where the port tiles (an image of more than 64 patches, the tiny
    bundle's largest bucket), the tiles cut and their features placed back as the port's _tiled_forward does
    (modeling_qwen35_vision.py:902-961 @ 4bcdc54), written here from that source, not from qbuild's code."""

    def __init__(self, visual, largest: int):
        super().__init__()
        self.visual, self.largest = visual, largest
        self.spatial_merge_size = visual.spatial_merge_size
        self.tiled = 0

    @property
    def dtype(self):
        return self.visual.dtype

    def forward(self, pixel_values, grid_thw=None, **kwargs):
        out = self.visual(pixel_values, grid_thw=grid_thw, **kwargs)
        (t, h, w), = grid_thw.tolist()
        if t * h * w <= self.largest:
            return out
        self.tiled += 1
        hw = pixel_values.reshape(h, w, -1)
        ht, wt = h // 2, w // 2
        feats = [self.visual(hw[r:r + ht, c:c + wt].reshape(ht * wt, -1), grid_thw=grid_thw.new_tensor([[1, ht, wt]]),
                             **kwargs).pooler_output for r in (0, ht) for c in (0, wt)]
        m = self.spatial_merge_size
        full = torch.zeros(h // m, w // m, feats[0].shape[-1], dtype=feats[0].dtype)
        for f, (r, c) in zip(feats, ((0, 0), (0, wt // m), (ht // m, 0), (ht // m, wt // m))):
            full[r:r + ht // m, c:c + wt // m] = f.reshape(ht // m, wt // m, -1)
        out.pooler_output = full.reshape(h * w // m // m, -1)
        return out


def _transformers_greedy(hf, project, name: str) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy tokens) of transformers for PROMPT after the image: the processor's pixels and grid, the
    image token expanded by the Qwen3-VL processor's own replace_image_token (its class cannot be built without
    torchvision, which is not installed here), its generate."""
    from transformers import AutoTokenizer
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    model, processor = hf
    tokenizer = AutoTokenizer.from_pretrained(project.checkpoint)
    inputs = processor(images=[_rgb(project.images[name])], return_tensors="pt")
    expander = SimpleNamespace(image_processor=processor, image_token="<|image_pad|>")
    text = "<|vision_start|>" + Qwen3VLProcessor.replace_image_token(expander, inputs, 0) + "<|vision_end|>" + PROMPT
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    out = model.generate(input_ids=ids, pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                         mm_token_type_ids=(ids == model.config.image_token_id).int(), max_new_tokens=NEW_TOKENS,
                         do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return ids[0].tolist(), out[0, ids.shape[1]:].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(IMAGES))
def test_runtime_matches_transformers_at_each_bucket_and_tiled(project, runtime, hf, name):
    """The runtime's prompt (image tokens first, then the text) and greedy tokens equal transformers' for the image at
    each vision bucket and for the tiled one, whose transformers reference runs its vision tower tile by tile as the
    port does; the tiled image's features are not the whole image's (tiling changes the answer's inputs)."""
    _, bucket, tiled = IMAGES[name]
    prepared = runtime.prepare_image(project.images[name])
    assert (prepared.plan.bucket, prepared.plan.tiled) == (bucket, tiled)
    gen = runtime.generate(runtime.encode(PROMPT), NEW_TOKENS, image=project.images[name], stop_at_eos=False)
    model, _ = hf
    original = model.model.visual
    model.model.visual = PortTiles(original, largest=64)
    try:
        ids, tokens = _transformers_greedy(hf, project, name)
        assert model.model.visual.tiled == (1 if tiled else 0)
    finally:
        model.model.visual = original
    assert gen.prompt_ids == ids
    assert gen.token_ids == tokens
    if tiled:   # the tiles' features are not the whole image's: tiling changes what the text model sees
        _, processor = hf
        inputs = processor(images=[_rgb(project.images[name])], return_tensors="pt")
        with torch.no_grad():
            whole = original(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
            tiles = PortTiles(original, largest=64)(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
        assert whole.shape == tiles.shape and not torch.allclose(whole, tiles, atol=1e-3)


@pytest.mark.slow
def test_an_image_goes_where_the_prompt_marks_it(runtime, project):
    """A prompt holding the image marker (<|vision_start|><|image_pad|><|vision_end|>, as a chat template writes an
    image part) gets the image there; without one, in front. A typed image token without an image is refused."""
    from qbuild.core.errors import UserError

    image = project.images["128px"]
    marked = runtime.encode("user: <|vision_start|><|image_pad|><|vision_end|>" + PROMPT)
    gen = runtime.generate(marked, 2, image=image, stop_at_eos=False)
    pad = runtime.arch.image_token_id
    start = gen.prompt_ids.index(pad)
    assert gen.prompt_ids[:start] == marked[:marked.index(pad)] and gen.prompt_ids.count(pad) == 16
    assert gen.prompt_ids[start + 16:] == marked[marked.index(pad) + 1:]
    with pytest.raises(UserError, match="the prompt holds 1 image tokens"):
        runtime.generate(marked, 2)


# --- `qbuild run` and `qbuild serve` on the bundle ---------------------------------------------------------------

CHAT_PROMPT = "user: <|vision_start|><|image_pad|><|vision_end|>" + PROMPT + "\nassistant:"   # no chat template


def qbuild_run(project: Project, image: Path, prompt: str = CHAT_PROMPT) -> dict:
    proc = qbuild("run", NAME, "--prompt", prompt, "--image", str(image), "--max-new-tokens", str(NEW_TOKENS),
                  "--json", "--store", "store", cwd=project.root, env=project.env())
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    err: Path

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=60)
        return self.err.read_text()


def serve(project: Project, *args: str, tag: str = "a") -> Server:
    ready, err = project.root / f"url-{tag}", project.root / f"serve-{tag}.err"
    ready.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), **project.env()}
    with open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, "-m", "qbuild.cli", "serve", NAME, "--port", "0", "--ready-file",
                                 str(ready), "--store", "store", *args], cwd=project.root, env=env,
                                stdout=subprocess.DEVNULL, stderr=e)

    def up():
        if proc.poll() is not None:
            raise AssertionError(f"qbuild serve exited {proc.returncode}:\n{err.read_text()}")
        return ready.exists() and ready.read_text().strip()

    return Server(proc, wait_until(up, 300, "qbuild serve to answer"), err)


@pytest.fixture(scope="module")
def server(project):
    srv = serve(project)
    yield srv
    srv.stop()


def data_url(path: Path, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(path.read_bytes()).decode()}"


def image_chat(url: str, text: str = PROMPT) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def client(server: Server):
    import openai

    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(IMAGES))
def test_image_chat_over_http_answers_what_qbuild_run_does(project, server, name):
    """An image chat through the `openai` client (a data: URL image part, then text) answers `qbuild run --image` of the
    same image with the same rendered chat: the same text and token counts, at each bucket and tiled; streamed alike."""
    ran = qbuild_run(project, project.images[name])
    api = client(server)
    reply = api.chat.completions.create(model=NAME, messages=image_chat(data_url(project.images[name])),
                                        max_tokens=NEW_TOKENS)
    assert reply.choices[0].message.content == ran["text"]
    assert reply.usage.prompt_tokens == ran["prompt_tokens"]
    assert reply.usage.completion_tokens == len(ran["token_ids"])
    if IMAGES[name][2]:
        stream = api.chat.completions.create(model=NAME, messages=image_chat(data_url(project.images[name])),
                                             max_tokens=NEW_TOKENS, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ran["text"]


def _refusal(server: Server, messages, status: int = 400) -> str:
    import openai

    with pytest.raises(openai.APIStatusError) as caught:
        client(server).chat.completions.create(model=NAME, messages=messages, max_tokens=2)
    assert caught.value.status_code == status, caught.value
    return caught.value.body["message"]


@pytest.mark.slow
def test_image_parts_that_cannot_be_taken_are_a_400_naming_the_part(project, server, tmp_path):
    """Every image part the server cannot take is a 400 naming it: a URL it does not fetch, data that is not base64
    or not an image, an image declaring more pixels than `run --image` decodes, a grid the port cannot tile, a second
    image, an image in a system message, a part of an unknown type; typed image tokens without an image too; text sent
    as image/png, and images whose sides the processor cannot take (a 500 with transformers' message before). None
    leaves a traceback on the server's stderr."""
    from PIL import Image

    bomb = tmp_path / "bomb.png"
    Image.new("1", (20000, 20000)).save(bomb)
    odd = picture(tmp_path / "odd.png", (256, 224))   # 14 x 16 patches: too many for 64, rows not a multiple of 4
    image = data_url(project.images["64px"])
    part = "messages.0.content.0"
    cases = [
        (image_chat("http://127.0.0.1:9/x.png"), f"{part}.image_url.url: this server does not fetch image URLs"),
        (image_chat("data:image/png;base64,!!!"), f"{part}.image_url.url: the data: URL's data is not valid base64"),
        (image_chat("data:text/plain;base64,aGk="), f"{part}.image_url.url: the data: URL holds 'text/plain'"),
        (image_chat("data:image/png;base64," + base64.b64encode(b"not a png").decode()),
         f"{part}.image_url: cannot read the image"),
        (image_chat(data_url(bomb)), f"{part}.image_url: the image declares 400000000 pixels"),
        (image_chat(data_url(odd)), f"{part}.image_url: 224 patch tokens (14x16 patches)"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                       {"type": "image_url", "image_url": {"url": image}}]}],
         "messages.0.content.1: one image per request (messages.0.content.0 is the first)"),
        ([{"role": "system", "content": [{"type": "image_url", "image_url": {"url": image}}]}],
         f"{part}: an image goes in a user message, not a system message"),
        ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}],
         f"{part}: a content part of this type is not supported"),
        ([{"role": "user", "content": "<|image_pad|> hi"}], "messages: the prompt holds 1 image tokens"),
        (image_chat("data:image/png;base64," + base64.b64encode(b"plain text").decode()),
         f"{part}.image_url: cannot read the image: its bytes are not an image format Pillow reads"),
    ] + [(image_chat("data:image/png;base64," + base64.b64encode(_png(size)).decode()),
          f"{part}.image_url: the image is {size[0]}x{size[1]} pixels, its sides in a ratio of") for size in LOPSIDED]
    for messages, expected in cases:
        message = _refusal(server, messages)
        assert message.startswith(expected), (expected, message)
        assert not re.search(r"<[^>]* at 0x[0-9a-f]+>", message), message
    assert "Traceback" not in server.err.read_text()


class _Images(BaseHTTPRequestHandler):
    """Serves the project's images on loopback; /moved redirects to one of them."""

    def __init__(self, root: Path, *args):
        self.root = root
        super().__init__(*args)

    def do_GET(self):
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/128px.png")
            self.end_headers()
            return
        body = (self.root / self.path.lstrip("/")).read_bytes()
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_image_urls_are_fetched_only_when_allowed(project):
    """With --allow-image-urls an http URL's image answers as its data: URL does (fetched over loopback here); a
    redirect is not followed. The dry run says what images the server takes."""
    images = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Images, project.root))
    threading.Thread(target=images.serve_forever, daemon=True).start()
    srv = serve(project, "--allow-image-urls", tag="urls")
    try:
        base = f"http://127.0.0.1:{images.server_address[1]}"
        api = client(srv)
        by_url = api.chat.completions.create(model=NAME, messages=image_chat(f"{base}/256px.png"),
                                             max_tokens=NEW_TOKENS)
        by_data = api.chat.completions.create(model=NAME, messages=image_chat(data_url(project.images["256px"])),
                                              max_tokens=NEW_TOKENS)
        assert by_url.choices[0].message.content == by_data.choices[0].message.content
        assert by_url.usage.prompt_tokens == by_data.usage.prompt_tokens
        assert _refusal(srv, image_chat(f"{base}/moved")).startswith(
            "messages.0.content.0.image_url.url: the URL answered HTTP 302 (a redirect, which the server does not "
            "follow)")
    finally:
        srv.stop()
        images.shutdown()
    dry = qbuild("serve", NAME, "--dry-run", "--json", "--allow-image-urls", "--store", "store", cwd=project.root,
                 env=project.env())
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["images"] == {
        "per_request": 1, "sources": ["data:", "http:", "https:"], "max_bytes": 16 << 20, "max_pixels": 8192 * 8192,
        "max_aspect_ratio": 200, "buckets": [16, 64], "tiled_above": 64, "max_patches": 256}


@pytest.fixture(scope="module")
def url_server(project):
    srv = serve(project, "--allow-image-urls", tag="slow-urls")
    yield srv
    srv.stop()


def _answer(server: Server, ask: Callable) -> object:
    """What `ask(api)` returns, or (status, message) of the error the server answered; each request within 60 s."""
    import openai

    try:
        return ask(client(server).with_options(timeout=60))
    except openai.APIStatusError as e:
        return e.status_code, e.body["message"]


def _chat(text: str, max_tokens: int = 4) -> Callable:
    return lambda api: api.chat.completions.create(model=NAME, messages=[{"role": "user", "content": text}],
                                                   max_tokens=max_tokens).choices[0].message.content


def _image_chat(url: str) -> Callable:
    return lambda api: api.chat.completions.create(model=NAME, messages=image_chat(url),
                                                   max_tokens=NEW_TOKENS).choices[0].message.content


def _completion(prompt: str, max_tokens: int, stream: bool = False) -> Callable:
    def ask(api):
        reply = api.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, stream=stream)
        return "".join(c.choices[0].text for c in reply if c.choices) if stream else reply.choices[0].text
    return ask


DEADLINE_REFUSAL = (400, f"messages.0.content.0.image_url.url: fetching the URL took more than "
                         f"{IMAGE_URL_TIMEOUT_S:g} s")


@pytest.mark.slow
def test_slow_image_urls_hold_up_no_other_request(url_server):
    """A URL that sends one byte every 0.2 s: a text chat sent meanwhile is answered within 2 s (the tiny bundle
    answers it in tens of milliseconds; the bound is for a loaded machine). With as many such URLs as the server
    fetches at once, one more is a 503 at once, and each slow one is a 400 naming the deadline, 10 s in all. Before,
    the fetch held the one thread that prepares requests, so the chat waited for it, and its limit held per read: a
    URL that kept sending held it for as long as it sent (60 s here)."""
    chat = _chat("What is two and two?")
    expected = _answer(url_server, chat)
    with Origin() as origin, ThreadPoolExecutor(MAX_IMAGE_FETCHES) as pool:
        started = time.monotonic()
        slow = [pool.submit(_answer, url_server, _image_chat(f"{origin.url}/slow"))]
        wait_until(lambda: origin.trickling == 1, 60, "the server to fetch the slow URL")
        asked = time.monotonic()
        assert _answer(url_server, chat) == expected
        assert time.monotonic() - asked < 2.0
        slow += [pool.submit(_answer, url_server, _image_chat(f"{origin.url}/slow"))
                 for _ in range(MAX_IMAGE_FETCHES - 1)]
        wait_until(lambda: origin.trickling == MAX_IMAGE_FETCHES, 60, "the server to fetch every slow URL")
        assert _answer(url_server, _image_chat(f"{origin.url}/slow")) == (
            503, f"messages.0.content.0.image_url.url: the server is fetching {MAX_IMAGE_FETCHES} image URLs, as many "
                 "as it fetches at once; send the request again shortly, or the image as a data: URL")
        assert [f.result(timeout=60) for f in slow] == [DEADLINE_REFUSAL] * MAX_IMAGE_FETCHES
        assert time.monotonic() - started < 3 * IMAGE_URL_TIMEOUT_S   # the deadline with room for a loaded machine
    assert "Traceback" not in url_server.err.read_text()


@pytest.mark.slow
def test_a_client_that_goes_away_ends_its_image_fetch(url_server):
    """A chat whose image URL trickles (kept), then one whose client closes its connection while its URL trickles
    (gone): the server drops the second fetch as its client goes, so that trickle ends first, while the first is cut at
    its deadline with a 400. Before, a fetch nobody waited for ran to its deadline, holding its place among the
    MAX_IMAGE_FETCHES the server makes at once."""
    with Origin() as origin, ThreadPoolExecutor(1) as pool:
        kept = pool.submit(_answer, url_server, _image_chat(f"{origin.url}/slow?kept"))
        wait_until(lambda: origin.trickling == 1, 60, "the server to fetch the first slow URL")
        where = urlsplit(url_server.url)
        conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
        body = json.dumps({"model": NAME, "messages": image_chat(f"{origin.url}/slow?gone"), "max_tokens": 4})
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        wait_until(lambda: origin.trickling == 2, 60, "the server to fetch the second slow URL")
        conn.close()
        wait_until(lambda: origin.ended, 60, "a trickle to end")
        assert origin.ended[0] == "/slow?gone"
        assert kept.result(timeout=60) == DEADLINE_REFUSAL
    assert "Traceback" not in url_server.err.read_text()


@pytest.mark.slow
def test_fifty_concurrent_mixed_requests_with_a_slow_url_among_them(project, url_server):
    """One chat whose image URL trickles, then 49 requests at once: completions, streamed ones, chats, image chats
    (data: URLs, one of them tiled), refusals. Each answers what it answers alone, and every one of them is answered
    while the slow URL is still being fetched: nothing waits for it."""
    def refused(api):
        return api.completions.create(model=NAME, prompt="Hello", max_tokens=2, temperature=0.7)

    kinds = [_completion("The quick brown fox", 8), _completion("Hello", 4), _completion("1, 2, 3,", 6, stream=True),
             _chat("Hello there"), _chat("Name a colour.", 6), _image_chat(data_url(project.images["64px"])),
             _image_chat(data_url(project.images["256px"])), refused]
    expected = [_answer(url_server, ask) for ask in kinds]
    assert isinstance(expected[-1], tuple) and expected[-1][0] == 400
    with Origin() as origin, ThreadPoolExecutor(50) as pool:
        slow = pool.submit(_answer, url_server, _image_chat(f"{origin.url}/slow"))
        wait_until(lambda: origin.trickling == 1, 60, "the server to fetch the slow URL")

        def timed(i: int):
            answer = _answer(url_server, kinds[i % len(kinds)])
            return answer, time.monotonic()

        others = [pool.submit(timed, i) for i in range(49)]
        answers = [f.result(timeout=120) for f in others]
        assert slow.result(timeout=60) == DEADLINE_REFUSAL
    assert [a for a, _ in answers] == [expected[i % len(kinds)] for i in range(49)]
    assert max(t for _, t in answers) < origin.trickles_ended[0]
    assert "Traceback" not in url_server.err.read_text()


@pytest.mark.slow
def test_the_body_limit_holds_one_image_and_the_text_limit_stays(project, server):
    """A VL bundle's server takes a body of the text limit plus one image (base64); the messages' text alone keeps the
    text limit (a 413 naming it), so an image's allowance cannot carry a longer prompt."""
    import urllib.request

    from qbuild.backends.openai_server.serve import max_body_bytes

    with urllib.request.urlopen(server.url + "/models") as r:
        card = json.loads(r.read())["data"][0]
    assert card["max_request_bytes"] == max_body_bytes(160, vision=True) > max_body_bytes(160) + (16 << 20)
    text = "a " * (max_body_bytes(160) // 2 + 1)
    message = _refusal(server, image_chat(data_url(project.images["64px"]), text), status=413)
    assert message.startswith("the messages' text is") and f"at most {max_body_bytes(160)} bytes" in message
