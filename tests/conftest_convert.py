"""Shared helpers of the convert / shard tests: tiny checkpoints built once per process, loaders, comparisons.

Checkpoints are cached per process (not per test module) because several test files need the same ones and each
costs about a second to write with transformers.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from functools import cache
from pathlib import Path

import torch
from safetensors import safe_open

from qbuild.model.tinymodel import FOUR_LAYERS, TP4_TEXT, write_tiny_checkpoint

_ROOT = Path(tempfile.mkdtemp(prefix="qbuild-convert-tests-"))
atexit.register(shutil.rmtree, _ROOT, True)

# (family, fused experts, tp4-friendly heads) of every tiny checkpoint the tests use.
VARIANTS = {
    "qwen3_5": ("qwen3_5", False, False),
    "qwen3_5_moe": ("qwen3_5_moe", False, False),
    "qwen3_5_moe_fused": ("qwen3_5_moe", True, False),
    "qwen3_next": ("qwen3_next", False, False),
    "qwen3_next_fused": ("qwen3_next", True, False),
    "qwen3_5_tp4": ("qwen3_5", False, True),
    "qwen3_5_moe_tp4": ("qwen3_5_moe", True, True),
    "qwen3_next_tp4": ("qwen3_next", False, True),
}


@cache
def tiny(variant: str) -> Path:
    """The directory of the tiny checkpoint `variant` (read-only: copy it before corrupting it)."""
    family, fused, tp4 = VARIANTS[variant]
    return write_tiny_checkpoint(_ROOT / "src" / variant, family, fused_experts=fused,
                                 text_overrides=dict(FOUR_LAYERS, **TP4_TEXT) if tp4 else FOUR_LAYERS)


def load_dir(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file directly under `directory`, read with the reference library."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            for k in h.keys():
                assert k not in out, k
                out[k] = h.get_tensor(k)
    return out


def load_config(directory: Path) -> dict:
    return json.loads((Path(directory) / "config.json").read_text())


def hf_state_dict(variant: str) -> tuple[dict, dict[str, torch.Tensor]]:
    src = tiny(variant)
    return load_config(src), load_dir(src)


def bits(t: torch.Tensor) -> torch.Tensor:
    """A view comparable with torch.equal whatever the dtype (float8 has no equality kernel)."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                        and torch.equal(bits(a[k]), bits(b[k])) for k in a)
