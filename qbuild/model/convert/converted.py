"""The converted text weights a reader (the shard step) takes, in either form a convert output holds them:
described (text/description.json: each tensor made on demand from the checkpoint's bytes, description.py) or
materialized (text/*.safetensors and their index, as convert_checkpoint writes them).

Both give the same two things: `specs` (every converted tensor's dtype and shape, by name, sorted) and `producers()`,
the units that make them (a conversion step; or one stored tensor, mapped), so a reader streams either form alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Union

import torch

from qbuild.model.convert.description import FILE, Described, Producer, open_described
from qbuild.model.convert.errors import CheckpointError
from qbuild.model.convert.safetensors_header import Entry, read_header
from qbuild.model.convert.safetensors_io import DTYPES, MappedSources
from qbuild.model.convert.writer import SourceFiles

INDEX_LABEL = "text/model.safetensors.index.json"


class Materialized:
    """A materialized converted directory's text weights; holds the files open until `close`."""

    label = INDEX_LABEL

    def __init__(self, text_dir: Path):
        self.located = dict(sorted(_converted_tensors(text_dir).items()))
        self.specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
            n: (DTYPES[e.dtype], e.shape) for n, (_, e) in self.located.items()}
        self.files = SourceFiles(sorted({path for path, _ in self.located.values()}))

    def producers(self) -> list[Producer]:
        return [self._producer(name, path, entry) for name, (path, entry) in self.located.items()]

    def _producer(self, name: str, path: Path, entry: Entry) -> Producer:
        def run(mapped: MappedSources) -> dict[str, torch.Tensor]:
            return {name: mapped.map(self.files.fd(path), entry)}
        return Producer((name,), entry.nbytes, run)

    def close(self) -> None:
        self.files.close()


Converted = Union[Described, Materialized]


def open_converted(directory: Path, files: Mapping[str, Path] | None = None,
                   digests: Mapping[str, str] | None = None) -> Converted:
    """The text weights of the convert output `directory`: described ones are read from the checkpoint `files`
    locates (with the snapshot's `digests`, open_described); materialized ones from the directory itself."""
    if (Path(directory) / "text" / FILE).is_file():
        return open_described(directory, files, digests)
    return Materialized(Path(directory) / "text")


def _converted_tensors(text_dir: Path) -> dict[str, tuple[Path, Entry]]:
    """name -> (file, entry) of a materialized converted text directory."""
    index = text_dir / "model.safetensors.index.json"
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(INDEX_LABEL, f"cannot be read ({e.__class__.__name__})") from None
    headers = {f: read_header(text_dir / f, f"text/{f}") for f in sorted(set(weight_map.values()))}
    located = {}
    for name, f in weight_map.items():
        if name not in headers[f]:
            raise CheckpointError(f"text/{f}", "is listed in the index but absent from the file", name)
        located[name] = (text_dir / f, headers[f][name])
    return located
