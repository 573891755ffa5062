"""Tiny random checkpoints of each supported family, written with HF transformers.

The tests and the demo build on these instead of downloading anything. transformers builds the model (its parameter
names, shapes, and the constants its init gives norms and biases) and writes the checkpoint; every value comes from
numpy's PCG64 stream, drawn in a fixed order and rounded in a fixed way, so a seed gives the same bytes on every CPU
(torch's own random draws are vectorised, and differ between CPU capabilities). Every parameter is moved away from
its initial value: HF initialises the zero-centred norms to 0 and DeltaNet's dt_bias to 1, so a converter that
forgot the +1 or a reorder would otherwise pass by luck.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from qbuild.core import jsonio
from qbuild.model.families import FAMILIES, MODEL_TYPES, FamilyName

VOCAB_SIZE = 512
# Special tokens sit at the top of the vocabulary so the BPE merges fill the ids below them.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>"]

# One layer of each kind: a Gated DeltaNet layer, then a gated-attention layer. Every stage (conversion, sharding,
# compile, verify, serve) meets both kinds, and a build takes about half the time four layers take.
_TEXT = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, intermediate_size=96, max_position_embeddings=4096,
)
# The published models' pattern of three DeltaNet layers, then one gated-attention layer: for checks of a rule per
# layer (which layers an FP8 policy leaves whole, a layer index in tensor names, several DeltaNet layers in a row).
FOUR_LAYERS = dict(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"])
# Head counts that split over 4 tensor-parallel ranks (kv heads then replicate: tp 4 > 2 kv heads).
TP4_TEXT = dict(num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=4, linear_num_value_heads=8)
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
_VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
               num_position_embeddings=64)

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A compiled model is a build artifact like any other. "
    "Trainium serves large models; the lockfile pins every input, and the store keeps every output. "
    "def main():\n    return sum(range(10))\n" "Hello world! 0123456789 Qwen DeltaNet attention expert router."
)


def _special_id(name: str) -> int:
    return VOCAB_SIZE - len(SPECIAL_TOKENS) + SPECIAL_TOKENS.index(name)


def make_config(family: FamilyName, vision: bool, text_overrides: Mapping[str, Any] | None = None):
    """The transformers config of a tiny model of `family` (vision only for the VL families).

    `text_overrides` replaces text-model fields, e.g. TP4_TEXT so that every head count divides by 4."""
    import transformers

    text = dict(_TEXT, eos_token_id=_special_id("<|endoftext|>"), pad_token_id=_special_id("<|endoftext|>"))
    text.update(text_overrides or {})
    fam = FAMILIES[family]
    cls = getattr(transformers, fam.transformers_config)
    if fam.vl_model_type is None:
        if vision:
            raise ValueError(f"{family} has no vision encoder")
        # No pad token: the Coder-Next converter zeroes the pad row, and the tiny model's pad would be its EOS,
        # which it generates, so it would differ from transformers on purpose. The zeroing has its own unit test.
        text["pad_token_id"] = None
        return cls(**text, **_MOE, norm_topk_prob=True)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                               "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    if fam.moe:
        text.update(_MOE)
    ids = dict(image_token_id=_special_id("<|image_pad|>"), video_token_id=_special_id("<|video_pad|>"),
               vision_start_token_id=_special_id("<|vision_start|>"),
               vision_end_token_id=_special_id("<|vision_end|>"))
    return cls(text_config=text, vision_config=dict(_VISION), tie_word_embeddings=False, **ids)


def _make_model(config):
    import transformers

    return getattr(transformers, MODEL_TYPES[config.model_type].transformers_model)(config)


# The scheme transformers' init and the perturbation on top of it give each parameter: matrices (and every tensor
# of two or more dimensions) N(0, initializer_range) moved by 0.05 noise; norms, biases and dt_bias their init
# constant moved by 0.2 noise; DeltaNet's A_log log(A) of a decay rate A uniform in (0.01, 16), moved by 0.2 noise.
INIT_STD = 0.02              # initializer_range of every tiny config (text and vision)
MATRIX_NOISE = 0.05
VECTOR_NOISE = 0.2
A_RANGE = (0.01, 16.0)
# Only operations whose result IEEE 754 defines to the bit are used, so any CPU computes the same values. Draws are
# uniform with the standard deviation the scheme names: numpy's normal sampler calls the C library's exp and log1p
# in its tails, while a uniform double is integer arithmetic on the PCG64 output. The logarithm is a fixed series
# (_log) rather than numpy's or the C library's, which have CPU-specific implementations (numpy dispatches SIMD
# kernels for it; glibc picks an FMA variant by CPU).
_SQRT3 = 1.7320508075688772
_LN2 = 0.6931471805599453
_SQRT_HALF = 0.7071067811865476


def _unit(gen, shape: tuple[int, ...]):
    """Uniform noise of mean 0 and standard deviation 1, as float64."""
    return (gen.random(shape) * 2.0 - 1.0) * _SQRT3


def _log(x):
    """The natural logarithm of positive float64 values by +, -, *, / only: x = m 2^e with m in [sqrt(1/2), sqrt(2)),
    log m = 2 atanh(t) for t = (m - 1) / (m + 1), |t| < 0.172, summed to t^25 (the rest is below 1e-20)."""
    import numpy as np

    m, e = np.frexp(x)                   # exact: m in [0.5, 1)
    low = m < _SQRT_HALF
    m, e = np.where(low, m * 2.0, m), np.where(low, e - 1, e)
    t = (m - 1.0) / (m + 1.0)
    t2 = t * t
    series = np.zeros_like(t)
    for k in range(12, -1, -1):          # Horner: 1 + t^2/3 + t^4/5 + ... + t^24/25
        series = series * t2 + 1.0 / (2 * k + 1)
    return 2.0 * t * series + e * _LN2


def _values(model, seed: int) -> dict:
    """Parameter name -> its value as a float64 array: one PCG64 stream seeded with `seed`, drawn parameter by
    parameter in name order (a matrix draws its base, then its noise)."""
    import numpy as np

    gen = np.random.Generator(np.random.PCG64(seed))
    out = {}
    for name, p in sorted(model.named_parameters()):
        shape = tuple(p.shape)
        if name.endswith("A_log"):
            low, high = A_RANGE
            out[name] = _log(low + gen.random(shape) * (high - low)) + VECTOR_NOISE * _unit(gen, shape)
        elif p.ndim >= 2:
            out[name] = INIT_STD * _unit(gen, shape) + MATRIX_NOISE * _unit(gen, shape)
        else:
            # Norm weights, biases and dt_bias start at one constant (0 or 1): kept as the centre of the noise.
            first, last = float(p.detach().min()), float(p.detach().max())
            if first != last:
                raise ValueError(f"{name}: transformers initialises it randomly; give it a rule in _values")
            out[name] = first + VECTOR_NOISE * _unit(gen, shape)
    return out


def _rounded(value, dtype: str):
    """`value` (float64) as a torch tensor of `dtype`, rounded to nearest, ties to even: numpy's conversions for
    float32 and float16; bfloat16 from the float32 value's bits (its top 16, rounded on the 16 below)."""
    import numpy as np
    import torch

    if dtype == "bfloat16":
        bits = value.astype(np.float32).view(np.uint32)
        top = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        return torch.from_numpy(top.astype(np.uint16).view(np.int16)).view(torch.bfloat16)
    if dtype in ("float32", "float16"):
        return torch.from_numpy(value.astype(getattr(np, dtype)))
    raise ValueError(f"tiny checkpoints are float32, float16 or bfloat16, not {dtype}")


def _fill(model, seed: int, dtype: str):
    """`model` in `dtype` with every parameter set from _values."""
    import torch

    values = _values(model, seed)
    model = model.to(getattr(torch, dtype))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_rounded(values[name], dtype).reshape(p.shape))
    return model


def _save_quietly(model, out: Path) -> None:
    """save_pretrained without the progress bars transformers and huggingface_hub draw, restoring their settings."""
    import huggingface_hub.utils as hub_utils
    from transformers.utils import logging as hf_logging

    transformers_bars, hub_bars = hf_logging.is_progress_bar_enabled(), not hub_utils.are_progress_bars_disabled()
    hf_logging.disable_progress_bar()    # turns off huggingface_hub's too
    try:
        model.save_pretrained(out, max_shard_size="200KB")
    finally:
        if transformers_bars:
            hf_logging.enable_progress_bar()
        if hub_bars:
            hub_utils.enable_progress_bars()
        else:
            hub_utils.disable_progress_bars()


def _normal_modes(out: Path) -> None:
    """Give every file the mode a newly created file gets (0666 less the umask), as the JSON files have: safetensors
    writes its files 0600."""
    mask = _umask()
    for f in out.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~mask)


def _umask() -> int:
    """This process's umask, read without changing it where Linux shows it (/proc/self/status, since 4.7)."""
    import os

    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    # Pad the learned vocabulary so the special tokens land exactly at the ids the config names.
    filler = [f"<|reserved_{i}|>" for i in range(VOCAB_SIZE - len(SPECIAL_TOKENS) - tok.get_vocab_size())]
    tok.add_special_tokens(filler + SPECIAL_TOKENS)
    assert tok.token_to_id("<|image_pad|>") == _special_id("<|image_pad|>")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(out)


def _fuse_experts(out: Path) -> None:
    """Rewrite per-expert MoE tensors into the fused 3D form the published Qwen3.5-MoE checkpoints use."""
    import re

    import torch
    from safetensors.torch import load_file, save_file

    files = {f.name: load_file(f) for f in sorted(out.glob("*.safetensors"))}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    home: dict[str, str] = {}
    for fname, tensors in files.items():
        for name in list(tensors):
            m = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", name)
            if m:
                experts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = tensors.pop(name)
                home.setdefault(m[1], fname)
    for prefix, per_expert in experts.items():
        order = [per_expert[e] for e in sorted(per_expert)]
        target = files[home[prefix]]
        target[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([x["gate_proj"], x["up_proj"]]) for x in order])
        target[f"{prefix}.down_proj"] = torch.stack([x["down_proj"] for x in order])
    weight_map = {}
    for fname, tensors in files.items():
        save_file(tensors, out / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
    index = out / "model.safetensors.index.json"
    if index.exists():
        doc = json.loads(index.read_text())
        doc["weight_map"] = dict(sorted(weight_map.items()))
        index.write_text(jsonio.dumps(doc, indent=2))


def write_tiny_checkpoint(out: Path, family: FamilyName, *, seed: int = 0, fused_experts: bool = False,
                          dtype: str = "float32", text_overrides: Mapping[str, Any] | None = None) -> Path:
    """Write a seeded tiny checkpoint of `family` (config, safetensors shards + index, tokenizer) into `out`.

    The VL families (qwen3_5, qwen3_5_moe) carry a vision encoder, as the published checkpoints do. MoE
    experts are written per expert (as transformers' save_pretrained does) unless `fused_experts`, which
    writes the fused 3D form of the published Qwen3.5-MoE checkpoints. `text_overrides` changes text-model
    fields (see make_config). The same arguments write the same bytes on any CPU.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    if fused_experts and not FAMILIES[family].moe:
        raise ValueError("fused_experts applies to the MoE families only")
    config = make_config(family, vision=FAMILIES[family].vl_model_type is not None, text_overrides=text_overrides)
    model = _fill(_make_model(config), seed, dtype)
    out.mkdir(parents=True, exist_ok=True)
    _save_quietly(model, out)
    if fused_experts:
        _fuse_experts(out)
    _write_tokenizer(out)
    _normal_modes(out)
    return out


def install_tiny_checkpoint(out: Path, family: FamilyName, *, replace: bool = False, seed: int = 0,
                            fused_experts: bool = False) -> Path:
    """write_tiny_checkpoint into a staging directory beside `out`, then move it into place, so a failed or
    interrupted run leaves `out` as it was. A non-empty `out` is an error unless `replace`, which removes it."""
    import shutil
    import uuid

    from qbuild.core.errors import UserError

    out = out.absolute()
    if out.is_dir() and any(out.iterdir()) and not replace:
        raise UserError(f"{out}: not empty; pass --force to replace what it holds")
    stage = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
    old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
    try:
        write_tiny_checkpoint(stage, family, seed=seed, fused_experts=fused_experts)
        if out.exists():
            out.rename(old)
        stage.rename(out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)   # only once the new checkpoint is in place
    return out
