"""Quantities read from the command line: sizes (20G, 512M, 0) and durations (1h, 10m, 0).

One parser for each, so every flag that takes one accepts and refuses the same spellings: a plain non-negative
number with an optional unit. Signs, exponents, `nan` and `inf` are refused (float() would accept them all).
"""

from __future__ import annotations

import re

from qbuild.core.errors import UserError

_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
_SIZE = re.compile(_NUMBER + r"\s*([KMGT]?)(?:I?B)?", re.IGNORECASE)
_DURATION = re.compile(_NUMBER + r"\s*([SMHD]?)", re.IGNORECASE)
SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
GIB = SIZE_UNITS["G"]
DURATION_UNITS = {"": 1, "S": 1, "M": 60, "H": 3600, "D": 86400}


def parse_size(value: str, flag: str, *, allow_zero: bool = True) -> int:
    """Bytes of a size like 20G, 20GiB, 512M, 1.5T or 0 (binary units)."""
    m = _SIZE.fullmatch(value.strip())
    if m is None:
        raise UserError(f"{flag}: cannot read {value!r}; use a size like 20G, 512M{' or 0' if allow_zero else ''}")
    n = int(float(m[1]) * SIZE_UNITS[m[2].upper()])
    if n == 0 and not allow_zero:
        raise UserError(f"{flag}: {value!r} leaves no room; use a positive size like 20G")
    return n


def parse_duration(value: str, flag: str) -> float:
    """Seconds of a duration like 90s, 10m, 1h, 2d or 0."""
    m = _DURATION.fullmatch(value.strip())
    if m is None:
        raise UserError(f"{flag}: cannot read {value!r}; use a duration like 1h, 10m or 0")
    return float(m[1]) * DURATION_UNITS[m[2].upper()]


def human_bytes(n: float) -> str:
    """A size as a person reads it: 512 B, 1.5 KiB, 64.0 GiB (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
