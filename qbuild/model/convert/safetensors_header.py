"""The safetensors header, read and validated without torch.

Layout of a file: 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the data,
offsets relative to the first data byte.

Every header is validated against the file size before any data is touched, so a truncated file or a lying header
is a CheckpointError naming the file and tensor, never an out-of-bounds read. The CLI checks every header of a
checkpoint before the first step of a build starts (qbuild.hub.snapshot.check_checkpoint), in a process that has no other
use for torch, so nothing here imports it; safetensors_io maps the same entries to tensors.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from qbuild.model.convert.errors import CheckpointError

# safetensors dtype code -> (torch dtype name, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})

# A header larger than this is not a plausible checkpoint (the 160 GB Coder-Next index is ~2 MB of JSON).
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: where its bytes are (absolute file offsets) and what they hold."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(path: Path, label: str | None = None) -> dict[str, Entry]:
    """The validated tensor entries of the safetensors file at `path`; CheckpointError naming `label` if bad."""
    label = label or path.name
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(label, f"not a safetensors file ({size} bytes, shorter than the 8-byte header length)")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(label, f"header length {n} exceeds the file size {size} (truncated or corrupt)")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(label, f"cannot read: {e.strerror or e}") from None
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(label, f"header is not valid JSON ({e.__class__.__name__})") from None
    if not isinstance(doc, dict):
        raise CheckpointError(label, "header is not a JSON object")
    doc.pop("__metadata__", None)
    entries = {name: _entry(label, name, spec, 8 + n) for name, spec in doc.items()}
    _check_extent(label, entries, 8 + n, size)
    return entries


def _entry(label: str, name: str, spec: object, data_start: int) -> Entry:
    if not isinstance(spec, dict) or not {"dtype", "shape", "data_offsets"} <= spec.keys():
        raise CheckpointError(label, "has a header entry without dtype, shape or data_offsets", name)
    dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if dtype not in DTYPES:
        raise CheckpointError(label, f"has an unsupported dtype {dtype!r}", name)
    ints = lambda xs: isinstance(xs, list) and all(isinstance(x, int) and x >= 0 for x in xs)  # noqa: E731
    if not ints(shape) or not ints(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise CheckpointError(label, f"has a malformed shape {shape!r} or data_offsets {offsets!r}", name)
    expected = math.prod(shape) * DTYPES[dtype][1]
    if offsets[1] - offsets[0] != expected:
        raise CheckpointError(label, f"has data_offsets {offsets} holding {offsets[1] - offsets[0]} bytes, "
                                     f"but {dtype} {tuple(shape)} needs {expected}", name)
    return Entry(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def _check_extent(label: str, entries: dict[str, Entry], data_start: int, size: int) -> None:
    """Every tensor lies inside the file, and no two tensors share bytes."""
    last_end, last_name = data_start, None
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if e.end > size:
            raise CheckpointError(label, f"ends at byte {e.end} but the file has {size} bytes "
                                         "(truncated or lying header)", e.name)
        if e.begin < last_end and e.nbytes:
            raise CheckpointError(label, f"overlaps tensor {last_name!r}", e.name)
        if e.nbytes:
            last_end, last_name = e.end, e.name
