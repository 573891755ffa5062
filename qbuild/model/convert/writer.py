"""Streaming output: plan every output tensor up front, then write each one straight to its final place.

Planning runs the conversion steps on meta tensors (shapes and dtypes only, no data), so each output file's header is
known before the first byte of data is read; steps can then run in any order, in threads, each writing its outputs
at their planned offsets (safetensors_io.PlannedFile). A step's outputs never straddle two files.
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from qbuild.core import jsonio
from qbuild.model.convert.safetensors_io import MappedSources, PlannedFile

Spec = tuple[str, torch.dtype, tuple[int, ...]]
DEFAULT_SHARD_BYTES = 2 << 30


def spec_bytes(spec: Spec) -> int:
    return math.prod(spec[2]) * spec[1].itemsize


def meta_specs(outputs: dict[str, torch.Tensor]) -> list[Spec]:
    return [(name, t.dtype, tuple(t.shape)) for name, t in outputs.items()]


@dataclass
class ShardedOutput:
    """Files model-00001.safetensors, ... holding groups of specs (one group per step) up to `cap` bytes each,
    plus the HF-style model.safetensors.index.json mapping every tensor to its file."""
    directory: Path
    files: list[PlannedFile]
    home: dict[str, PlannedFile]

    @classmethod
    def open(cls, directory: Path, groups: Sequence[list[Spec]], cap: int = DEFAULT_SHARD_BYTES) -> "ShardedOutput":
        bins: list[list[Spec]] = [[]]
        size = 0
        for group in groups:
            n = sum(spec_bytes(s) for s in group)
            if bins[-1] and size + n > cap:
                bins.append([])
                size = 0
            bins[-1].extend(group)
            size += n
        files = [PlannedFile(directory / f"model-{k + 1:05d}.safetensors", specs) for k, specs in enumerate(bins)]
        home = {name: f for f in files for name in f.slots}
        return cls(directory, files, home)

    def write(self, outputs: dict[str, torch.Tensor], sources: MappedSources | None = None) -> None:
        for name, t in outputs.items():
            self.home[name].write(name, t, sources)

    def discard(self) -> None:
        for f in self.files:
            f.discard()

    def close(self) -> dict:
        """Close every file and write the index; the index document is returned."""
        for f in self.files:
            f.close()
        total = sum(s.nbytes for f in self.files for s in f.slots.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {name: f.path.name for name, f in sorted(self.home.items())}}
        write_json(self.directory / "model.safetensors.index.json", index)
        return index


def write_json(path: Path, doc: dict) -> None:
    path.write_text(jsonio.dumps(doc, indent=2, sort_keys=True) + "\n")


class SourceFiles:
    """Read-only descriptors of every input file, opened up front and shared by all threads (pread needs no
    seek position, so one descriptor serves concurrent reads)."""

    def __init__(self, paths):
        self._fds: dict[Path, int] = {}
        try:
            for path in paths:
                if path not in self._fds:
                    self._fds[path] = os.open(path, os.O_RDONLY)
        except OSError:
            self.close()
            raise

    def fd(self, path: Path) -> int:
        return self._fds[path]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@contextmanager
def torch_ops_in_caller_threads() -> Iterator[None]:
    """torch's own thread pool off for the block (one intra-op thread), restored after. Streaming runs its own
    threads, each copying one step's tensors in many small ops (an expert at a time); an intra-op pool beside them
    spins at every op's barrier, which measured 4-10x slower than one thread on a loaded 2-core host. Copies and
    casts only: no float sum depends on it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
