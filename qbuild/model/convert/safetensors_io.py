"""Reading and writing the safetensors format directly, one tensor at a time.

The entries come from safetensors_header, which validates every header against the file size before any data is
touched. Only safetensors are ever read: never pickle.

Reading maps just one tensor's bytes (`map_tensor`): nothing is copied until a rule needs to, pages come straight
from the page cache, and the mapping is unmapped as soon as the tensor and its views are dropped, so RSS stays
bounded by the step in flight. (`safetensors.safe_open` maps whole files and keeps every touched page counted in RSS
until the file is closed.) Writing goes to precomputed offsets (`PlannedFile`), and an output that is a contiguous
byte range of a mapped source is copied by the kernel (`copy_file_range`) without passing through user space.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from qbuild.core import jsonio
from qbuild.model.convert.safetensors_header import DTYPES as HEADER_DTYPES
from qbuild.model.convert.safetensors_header import Entry

# safetensors dtype code <-> torch dtype, from safetensors_header's one table of codes
DTYPES: dict[str, torch.dtype] = {code: getattr(torch, name) for code, (name, _) in HEADER_DTYPES.items()}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
# Linux transfers at most 0x7ffff000 bytes per read/write call; larger tensors are moved in pieces.
_IO_CHUNK = 1 << 30


def map_tensor(fd: int, entry: Entry) -> torch.Tensor:
    """The tensor `entry` of the open file `fd`, memory-mapped copy-on-write (writes never reach the file).

    The mapping lives exactly as long as the returned tensor and its views. The file must not shrink meanwhile
    (checkpoint files are immutable snapshots; a file truncated under us would fault like any mapped file)."""
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=DTYPES[entry.dtype])
    start = entry.begin - entry.begin % mmap.ALLOCATIONGRANULARITY
    mapped = mmap.mmap(fd, entry.end - start, access=mmap.ACCESS_COPY, offset=start)
    flat = torch.frombuffer(mapped, dtype=torch.uint8, count=entry.nbytes, offset=entry.begin - start)
    return flat.view(DTYPES[entry.dtype]).reshape(entry.shape)


def copy_range(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, nbytes: int) -> bool:
    """Copy bytes file-to-file inside the kernel; False (nothing copied) where the filesystem cannot."""
    done = 0
    while done < nbytes:
        try:
            got = os.copy_file_range(src_fd, dst_fd, min(nbytes - done, _IO_CHUNK), src_offset + done,
                                     dst_offset + done)
        except OSError as e:
            if done == 0 and e.errno in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                return False
            raise
        if got <= 0:
            raise OSError(f"copy_file_range stopped at byte {src_offset + done}")
        done += got
    return True


def write_at(fd: int, offset: int, tensor: torch.Tensor) -> None:
    """Write the bytes of `tensor` in row-major order at absolute `offset` of the open file `fd`.

    A contiguous tensor is written from its own memory. Any other (e.g. a transposed view of a mapped input) is
    laid out piece by piece, along dim 0, in one small reused buffer that stays in cache and is written after each
    piece: no full-size copy is ever allocated, so memory stays bounded by the piece, not by the tensor."""
    if isinstance(tensor, Deferred):
        _write_deferred(fd, offset, tensor)
        return
    t = tensor.detach()
    if t.numel() == 0:
        return
    if t.is_contiguous():
        _pwrite_all(fd, offset, t)
    elif t.dim() == 1:
        _pwrite_all(fd, offset, t.contiguous())
    else:
        _write_deferred(fd, offset, Deferred(t.shape, t.dtype, lambda out, r0: copy_into(out, t[r0:r0 + len(out)])))


class Deferred:
    """A tensor made piece by piece as it is written, for a layout no strided view of its source expresses (a rank's
    expert gate_up, each row its slice of gate^T then of up^T: experts.gate_up_shard). `fill(out, start)` writes rows
    [start, start + len(out)) of dim 0 into the contiguous `out`. The writer fills one small buffer at a time, so the
    tensor is never allocated whole; `materialize` makes it whole, for the in-memory shard."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, fill):
        self.shape, self.dtype, self.fill = torch.Size(shape), dtype, fill

    def materialize(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype)
        if out.numel():
            self.fill(out, 0)
        return out


def _write_deferred(fd: int, offset: int, t: Deferred) -> None:
    """Lay `t` out a few rows at a time in one small reused buffer, writing each piece as it is filled."""
    if not t.shape.numel():
        return
    row = t.shape[1:].numel() * t.dtype.itemsize
    rows = max(1, min(t.shape[0], _PIECE_BYTES // max(row, 1)))
    buf = torch.empty((rows, *t.shape[1:]), dtype=t.dtype)
    for r0 in range(0, t.shape[0], rows):
        out = buf[:min(rows, t.shape[0] - r0)]
        t.fill(out, r0)
        _pwrite_all(fd, offset + r0 * row, out)


# Bytes laid out per write of a non-contiguous tensor: a few experts, small enough to stay in cache.
_PIECE_BYTES = 8 << 20


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for a contiguous dst. A 3D+ src whose last two dims are swapped relative to row-major (an
    expert transpose, or a slice of one) is copied one 2D matrix at a time: torch's 2D transposed copy has a
    cache-blocked kernel, several times faster than the generic strided copy it would otherwise take, and a slice
    (a rank's columns of each expert) is first gathered into a small contiguous buffer that kernel accepts."""
    if src.dim() >= 3 and src.stride(-2) == 1 and src.shape[-2] > 1:
        whole = src.stride(-1) == src.shape[-2]
        tmp = None if whole else torch.empty(src.shape[-1], src.shape[-2], dtype=src.dtype)
        for d, s in zip(dst.view(-1, *dst.shape[-2:]), src.reshape(-1, *src.shape[-2:])):
            if tmp is not None:
                tmp.copy_(s.T)
                s = tmp.T
            d.copy_(s)
    else:
        dst.copy_(src)


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """`t` itself if contiguous, else a contiguous copy made by copy_into."""
    if t.is_contiguous():
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    copy_into(out, t)
    return out


def _pwrite_all(fd: int, offset: int, t: torch.Tensor) -> None:
    view = memoryview(t.view(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:done + _IO_CHUNK], offset + done)


@dataclass(frozen=True)
class Slot:
    """Where one planned tensor goes: the header entry and the absolute byte offset of its data."""
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class PlannedFile:
    """A safetensors file whose tensors are all known up front (name, dtype, shape), written in any order.

    The header is written at open, so tensors can be written one at a time, by several threads, each straight
    to its final offset: nothing is buffered and no second pass copies the data.
    """

    def __init__(self, path: Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
        rel = 0
        for name, dtype, shape in specs:
            n = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [rel, rel + n]}
            rel += n
        raw = jsonio.dumps(header, compact=True).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the reference writer does
        start = 8 + len(raw)
        self.path = path
        self.slots: dict[str, Slot] = {}
        for name, dtype, shape in specs:
            begin = header[name]["data_offsets"][0]  # type: ignore[index]
            self.slots[name] = Slot(name, dtype, tuple(shape), start + begin)
        self.size = start + rel
        self._written: set[str] = set()
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self.fd, struct.pack("<Q", len(raw)) + raw, 0)
        os.ftruncate(self.fd, self.size)

    def write(self, name: str, tensor: torch.Tensor | Deferred, sources: "MappedSources | None" = None) -> None:
        """Write `tensor` as `name`; when it is a contiguous byte range of one of `sources`, the kernel copies it."""
        slot = self.slots[name]
        assert tensor.dtype == slot.dtype and tuple(tensor.shape) == slot.shape, (name, tensor.dtype, tensor.shape, slot)
        origin = sources.origin(tensor) if sources is not None and not isinstance(tensor, Deferred) else None
        if origin is None or not copy_range(*origin[:2], self.fd, slot.offset, slot.nbytes):
            write_at(self.fd, slot.offset, tensor)
        self._written.add(name)

    def close(self) -> None:
        missing = set(self.slots) - self._written
        self.discard()
        assert not missing, f"{self.path.name}: planned tensors never written: {sorted(missing)[:5]}"

    def discard(self) -> None:
        """Close without checking completeness (the failure path: the staging directory is removed anyway)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class MappedSources:
    """The mapped input tensors of one step, to recognise outputs that are plain byte ranges of them."""

    def __init__(self):
        self._spans: list[tuple[int, int, int, int]] = []  # (fd, file offset, address, nbytes)

    def map(self, fd: int, entry: Entry) -> torch.Tensor:
        t = map_tensor(fd, entry)
        if entry.nbytes:
            self._spans.append((fd, entry.begin, t.data_ptr(), entry.nbytes))
        return t

    def origin(self, t: torch.Tensor) -> tuple[int, int] | None:
        """(fd, file offset) of `t`'s bytes if `t` is a contiguous view into a mapped source, else None."""
        if not t.is_contiguous() or t.numel() == 0:
            return None
        begin, n = t.data_ptr(), t.numel() * t.element_size()
        for fd, offset, address, size in self._spans:
            if address <= begin and begin + n <= address + size:
                return fd, offset + (begin - address)
        return None
