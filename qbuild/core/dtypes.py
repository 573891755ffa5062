"""The model dtypes a recipe may name: their sizes (planning, without torch) and their torch types (the steps)."""

from __future__ import annotations

from typing import Literal, get_args

DType = Literal["bfloat16", "float16", "float32"]

DTYPE_BYTES: dict[DType, int] = {"bfloat16": 2, "float16": 2, "float32": 4}
DTYPES: tuple[DType, ...] = get_args(DType)


def torch_dtype(name: str):
    """The torch dtype of a recipe dtype name; imports torch, so only steps call it."""
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    import torch

    return getattr(torch, name)
