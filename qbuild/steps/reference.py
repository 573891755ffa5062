"""reference: HF transformers' outputs for the golden prompts, in float32, once per weights version.

Output: reference.json {model_type, transformers, new_tokens, prompts: [{text, ids, greedy, image}]},
logits.safetensors {"prompt{i}": prefill logits (n, V) float32}, and image.png when the recipe checks an image
prompt (a synthetic, deterministic picture; its tokens are <|vision_start|> <|image_pad|>... <|vision_end|> text).
The greedy tokens are argmax of transformers' own logits at every step (its cached decode, as generate runs it,
never stopping at EOS).
"""

from __future__ import annotations

import json
from pathlib import Path

from qbuild.core import jsonio
from qbuild.core.errors import BuildError
from qbuild.core.numerics import fix_threads
from qbuild.core.units import GIB
from qbuild.model.families import MODEL_TYPES
from qbuild.model.sizes import VERIFY_IMAGE_SIZE, weight_bytes
from qbuild.planning.step import Context, PlannedNode, Step
from qbuild.recipe.params import ReferenceParams

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "prompts.json"
# The shipped prompts are data, not source: pinning their digest here puts them in this step's code hash, so
# editing prompts.json (and this line with it) rebuilds every reference that uses them.
GOLDEN_BLAKE3 = "057d2ea072aa66d0d7b28d02d03d97c6cf1065b6c9ab12ee3cff40ad35d98783"


def golden() -> dict:
    from qbuild.core.hashing import digest_bytes

    data = GOLDEN.read_bytes()
    if digest_bytes(data) != GOLDEN_BLAKE3:
        raise BuildError(f"{GOLDEN}: changed without updating GOLDEN_BLAKE3 in qbuild/steps/reference.py to "
                         f"{digest_bytes(data)} (the references built from it would not rebuild otherwise)")
    return json.loads(data)


def synthetic_image(path: Path) -> None:
    """A deterministic RGB picture: smooth gradients plus a checker pattern, written as PNG."""
    import numpy as np
    from PIL import Image

    h, w = VERIFY_IMAGE_SIZE
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([(x * 255 // (w - 1)), (y * 255 // (h - 1)), ((x // 8 + y // 8) % 2) * 200 + 28], axis=-1)
    Image.fromarray(rgb.astype("uint8"), "RGB").save(path, format="PNG")


def _model(src: Path, config: dict):
    import torch
    import transformers

    cls = getattr(transformers, MODEL_TYPES[config["model_type"]].transformers_model)
    return cls.from_pretrained(str(src), dtype=torch.float32).eval()


def _greedy(model, ids: list[int], new_tokens: int, extra: dict, image_token_id: int | None):
    """(prefill logits (n, V), greedy tokens) of one prompt: transformers' own prefill, then its cached decode."""
    import torch

    prompt = torch.tensor([ids])
    if extra:  # multimodal: tell transformers which tokens are image tokens (1), for its mRoPE positions
        extra = dict(extra, mm_token_type_ids=(prompt == image_token_id).int())
    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True, **extra)
        prefill = out.logits[0].float()
        tokens = [int(prefill[-1].argmax())]
        # `cache` is the name since transformers 5.24; `past_key_values`, the old one, is deprecated and goes in 5.40.
        cache = out.cache
        for _ in range(new_tokens - 1):
            out = model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
            cache = out.cache
            tokens.append(int(out.logits[0, -1].argmax()))
    return prefill, tokens


class Reference(Step):
    kind = "reference"
    params = ReferenceParams
    inputs = ("snapshot",)
    reads_checkpoint = True
    # Logits computed with torch's vectorised CPU kernels, whose last bits depend on the capability they run with.
    portable = False
    data = ("golden/prompts.json",)

    @classmethod
    def plan(cls, recipe) -> None:
        r, arch = recipe.loaded.recipe, recipe.arch
        v = r.verify
        prompts = None if v.prompts is None else tuple(v.prompts)
        recipe.add(PlannedNode("reference", cls.kind, f"reference {recipe.model_label}",
                               ReferenceParams(prompts, v.new_tokens, bool(r.vision and v.image_prompt)),
                               {"snapshot": "fetch"}, 4 << 20,
                               weight_bytes(arch, "float32", "none") + recipe.sizes.vision * 2 + GIB,
                               recipe.source))

    @classmethod
    def run(cls, ctx: Context) -> None:
        _run(ctx)


def _run(ctx: Context) -> None:
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    fix_threads()
    p: ReferenceParams = ctx.params
    files = ctx.checkpoint.files
    src = next(iter(files.values())).parent
    config = json.loads(files["config.json"].read_text())
    model, tokenizer = _model(src, config), AutoTokenizer.from_pretrained(str(src))
    shipped = golden()
    prompts = [(text, None) for text in (p.prompts or shipped["prompts"])]
    if p.image:
        prompts.append((shipped["image_prompt"], ctx.out / "image.png"))
    records, logits = [], {}
    for i, (text, image) in enumerate(prompts):
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        extra = {}
        if image is not None:
            synthetic_image(image)
            ids, extra = _image_prompt(src, config, tokenizer, image, ids)
        prefill, tokens = _greedy(model, ids, p.new_tokens, extra, config.get("image_token_id"))
        logits[f"prompt{i}"] = prefill.contiguous()
        records.append({"text": text, "ids": ids, "greedy": tokens, "image": image is not None})
        ctx.log(f"reference prompt {i}: {len(ids)} tokens -> {tokens[:8]}...")
    save_file(logits, ctx.out / "logits.safetensors")
    doc = {"model_type": config["model_type"], "transformers": transformers.__version__,
           "new_tokens": p.new_tokens, "prompts": records}
    (ctx.out / "reference.json").write_text(jsonio.dumps(doc, indent=1, sort_keys=True))


def _image_prompt(src: Path, config: dict, tokenizer, image: Path, text_ids: list[int]):
    from PIL import Image

    # The processor the bundle's runtime uses: the checkpoint's preprocessor settings, as transformers reads them.
    from qbuild.model.runtime.images import image_processor

    vision = config["vision_config"]
    with Image.open(image) as img:
        out = image_processor(src, vision)(images=[img.convert("RGB")], return_tensors="pt")
    merged = int(out["image_grid_thw"].prod()) // vision["spatial_merge_size"] ** 2
    ids = [config["vision_start_token_id"]] + [config["image_token_id"]] * merged + \
        [config.get("vision_end_token_id", tokenizer.convert_tokens_to_ids("<|vision_end|>"))] + text_ids
    return ids, {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
