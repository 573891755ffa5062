"""The VL side of the reference model against HF transformers: the vision encoder (host preparation + traced
encoder), the 3-D mRoPE positions, and a prompt with an image through the whole VL model (prefill and decode)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from qbuild.model.arch import arch_from_config
from qbuild.model.convert.convert import convert_state_dict
from qbuild.model.convert.shard import shard_state_dict
from qbuild.model.modeling import TextModel
from qbuild.model.ranks import RankLayout
from qbuild.model.modeling.vision import (
    MASK_VALUE,
    VisionHost,
    decode_position_ids,
    embed_with_images,
    encode_images,
    load_vision,
    mrope_position_ids,
    vision_example_inputs,
)
from qbuild.model.tinymodel import SPECIAL_TOKENS, VOCAB_SIZE

# One worker takes the whole file, so the module-scoped HF models of `vl` are loaded once.
pytestmark = pytest.mark.xdist_group("modeling-vision")

# float32: our attention (additive block mask over the whole bucket) sums in a different order than HF's
# per-image attention, and our decoder's partials differ from HF's summation order.
FEATURES_ATOL = 1e-5
LOGITS_ATOL = 1e-4
DECODE_STEPS = 8
IMAGE_GRID = (1, 16, 16)  # a 256x256 image: 16x16 patches of 16 pixels, merged 2x2 into 64 tokens
TEXT_TOKENS = VOCAB_SIZE - len(SPECIAL_TOKENS)
PAD_ID = VOCAB_SIZE - len(SPECIAL_TOKENS)
PROMPT_BUCKET = 96


@pytest.fixture(scope="module")
def vl(tiny_checkpoints):
    """Per VL family: (HF config dict, converted text tensors, converted vision tensors, HF model). Lazy."""
    import transformers

    cache = {}

    def get(family: str):
        if family not in cache:
            path = tiny_checkpoints[family]
            config = json.loads((path / "config.json").read_text())
            tensors = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}
            text, vision = convert_state_dict(config, tensors, dtype="float32")
            hf = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
            hf.generation_config.eos_token_id = None  # always run all the steps
            cache[family] = (config, text, vision, hf)
        return cache[family]

    return get


def _pixels(grid: tuple[int, int, int], seed: int = 0) -> torch.Tensor:
    """Flattened patches (t*h*w, 3*2*16*16), the layout HF's image processor produces."""
    t, h, w = grid
    return torch.randn(t * h * w, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(seed))


def _image_prompt(config: dict, grid: tuple[int, int, int]) -> torch.Tensor:
    """text, <|vision_start|>, one <|image_pad|> per merged token, <|vision_end|>, text."""
    gen = torch.Generator().manual_seed(3)
    num_image = grid[0] * grid[1] * grid[2] // config["vision_config"]["spatial_merge_size"] ** 2
    return torch.cat([torch.randint(0, TEXT_TOKENS, (5,), generator=gen),
                      torch.tensor([config["vision_start_token_id"]]),
                      torch.full((num_image,), config["image_token_id"]),
                      torch.tensor([config["vision_end_token_id"]]),
                      torch.randint(0, TEXT_TOKENS, (6,), generator=gen)])


@pytest.mark.parametrize("grids,bucket", [([IMAGE_GRID], 256), ([(1, 4, 6), (1, 6, 4), (2, 4, 4)], 96)])
def test_encoder_matches_transformers_visual(vl, grids, bucket):
    config, _, vision, hf = vl("qwen3_5")
    host, encoder = load_vision(arch_from_config(config), vision)
    grid_thw = torch.tensor(grids)
    pixels = torch.cat([_pixels(g, seed=i) for i, g in enumerate(grids)])
    with torch.no_grad():
        expected = hf.model.visual(pixels, grid_thw=grid_thw).pooler_output
    ours = encode_images(host, encoder, pixels, grid_thw, bucket)
    assert ours.shape == expected.shape
    assert (ours - expected).abs().max().item() < FEATURES_ATOL


def test_attention_mask_is_block_diagonal_with_a_padding_block():
    mask = VisionHost.attention_mask(torch.tensor([[2, 2, 2], [1, 2, 4]]), bucket=20)[0, 0]
    segments = [0] * 4 + [1] * 4 + [2] * 8 + [3] * 4  # two frames of 4, one image of 8, padding
    for i, si in enumerate(segments):
        for j, sj in enumerate(segments):
            assert mask[i, j].item() == (0.0 if si == sj else MASK_VALUE)


def test_mrope_positions_match_get_rope_index(vl):
    config, _, _, hf = vl("qwen3_5")
    arch = arch_from_config(config)
    grid = (1, 4, 6)
    prompt = _image_prompt(config, grid)
    ids = torch.full((2, len(prompt) + 4), PAD_ID)
    ids[0, : len(prompt)] = prompt
    ids[1, :7] = prompt[-7:]  # a text-only row
    seq_lens = torch.tensor([len(prompt), 7])
    ours, deltas = mrope_position_ids(ids, torch.tensor([grid]), arch, seq_lens)
    attention = (torch.arange(ids.shape[1])[None] < seq_lens[:, None]).long()
    expected, expected_deltas = hf.model.get_rope_index(ids, (ids == arch.image_token_id).int(),
                                                        image_grid_thw=torch.tensor([grid]), attention_mask=attention)
    real = attention.bool()
    assert torch.equal(ours[:, real], expected[:, real])
    assert deltas.tolist() == expected_deltas[:, 0].tolist()


@pytest.mark.parametrize("family,tp,ep", [("qwen3_5", 2, 1), ("qwen3_5_moe", 2, 2)])
def test_image_prompt_matches_transformers_vl_model(vl, family, tp, ep):
    """Prefill logits of a prompt with an image, then greedy decode steps with mRoPE deltas, against HF."""
    config, text, vision, hf = vl(family)
    arch = arch_from_config(config)
    host, encoder = load_vision(arch, vision)
    model = TextModel(arch, tp=tp, ep=ep, max_seq_len=PROMPT_BUCKET + DECODE_STEPS).eval()
    model.load_shards(shard_state_dict(config, text, ranks=RankLayout.split(tp, ep)))
    grid = torch.tensor([(1, 8, 8)])
    pixels = _pixels(tuple(grid[0].tolist()))
    prompt = _image_prompt(config, tuple(grid[0].tolist()))
    ids = torch.full((1, PROMPT_BUCKET), PAD_ID)
    ids[0, : len(prompt)] = prompt
    seq_lens = torch.tensor([len(prompt)])

    features = encode_images(host, encoder, pixels, grid, bucket=64)
    embeds = embed_with_images(model.embed_tokens.weight, ids, features, arch.image_token_id)
    position_ids, deltas = mrope_position_ids(ids, grid, arch, seq_lens)
    with torch.no_grad():
        logits, state = model.prefill(embeds, position_ids, seq_lens)
        hf_inputs = dict(input_ids=prompt[None], pixel_values=pixels, image_grid_thw=grid,
                         mm_token_type_ids=(prompt[None] == arch.image_token_id).int())
        expected = hf(**hf_inputs).logits[0]
    assert (logits[0, : len(prompt)] - expected).abs().max().item() < LOGITS_ATOL

    token, generated = logits[0, len(prompt) - 1].argmax()[None], []
    for step in range(DECODE_STEPS):
        generated.append(token.item())
        slots = seq_lens + step
        with torch.no_grad():
            logits, state = model.decode(token[:, None], decode_position_ids(slots, deltas), slots, state)
        token = logits[:, 0].argmax(-1)
    with torch.no_grad():
        reference = hf.generate(**hf_inputs, max_new_tokens=DECODE_STEPS, do_sample=False, pad_token_id=PAD_ID)
    assert generated == reference[0, len(prompt):].tolist()


def test_vision_encoder_exports(vl):
    config, _, vision, _ = vl("qwen3_5")
    arch = arch_from_config(config)
    host, encoder = load_vision(arch, vision)
    grid = torch.tensor([(1, 8, 8)])
    inputs = host.prepare(_pixels((1, 8, 8)), grid, bucket=96)[:4]
    with torch.no_grad():
        program = torch.export.export(encoder, vision_example_inputs(arch.vision, 96), strict=False)
        assert torch.equal(program.module()(*inputs), encoder(*inputs))
    assert {n for n, _ in program.named_parameters()} == set(dict(encoder.named_parameters()))
