"""Reading an HF checkpoint directory and checking its files against its config, before anything is written.

A checkpoint is: config.json, safetensors weights (one file, or shards named by model.safetensors.index.json), and
tokenizer / generation / processor files. Its files may live elsewhere (an HF cache's blobs): `files` maps each file
name to its real path, and names it lacks are looked up in the directory.

Validation (every failure is a CheckpointError naming the file, and the tensor where there is one):
- config.json present, valid JSON, a known model_type, the dimensions the rules need;
- every safetensors header sane: parsable, entries well-formed, data inside the file (so a truncated file or a lying
  header is caught here and no read can ever go out of bounds), no overlaps;
- the index and the files agree (every named file exists, every listed tensor is in its file, nothing unlisted);
- config.json's vocab_size equals the rows of the embedding and of lm_head.

Whether the tensors are the ones the conversion program needs (each present, with its shape and a floating-point
dtype, nothing unexpected but known-dropped tensors such as mtp.*) is `validate`, which layout.open_checkpoint runs:
this module holds no conversion rule, so the fetch step that checks a download with it is keyed by none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from qbuild.model.arch import Arch, ConfigError, arch_from_config
from qbuild.model.convert.errors import CheckpointError
from qbuild.model.convert.safetensors_header import FLOAT_DTYPES, Entry, read_header
from qbuild.model.families import MODEL_TYPES, ModelType

INDEX = "model.safetensors.index.json"
# Other weight formats are never loaded (they are pickles); their presence alone is not an error.
_FOREIGN_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".gguf")
# Non-weight files carried over to the converted directory (tokenizer, generation, processor configs, templates).
_CARRIED_SUFFIXES = (".json", ".txt", ".jinja", ".model", ".tiktoken")


@dataclass(frozen=True)
class TensorInfo:
    """What validation knows of one source tensor: the file it is in, its safetensors dtype name and shape."""
    file: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Located:
    """A tensor of a checkpoint file on disk."""
    file: str
    path: Path
    entry: Entry


@dataclass(frozen=True)
class CheckpointFiles:
    """A checkpoint's files, read and checked (headers only)."""
    config: dict
    model_type: ModelType
    arch: Arch
    tensors: dict[str, Located]
    carried: dict[str, Path]  # non-weight files to copy, by name
    missing_label: str        # what a missing tensor is blamed on: the index, or the one weight file

    def infos(self) -> dict[str, TensorInfo]:
        return {n: TensorInfo(t.file, t.entry.dtype, t.entry.shape) for n, t in self.tensors.items()}


class _Locator:
    def __init__(self, src: Path, files: Mapping[str, Path] | None):
        self.src, self.files = Path(src), {k: Path(v) for k, v in (files or {}).items()}

    def __call__(self, name: str) -> Path:
        return self.files.get(name, self.src / name)

    def names(self) -> list[str]:
        listed = set(self.files)
        if self.src.is_dir():
            listed |= {p.name for p in self.src.iterdir() if p.is_file()}
        return sorted(listed)


def load_config(path: Path, label: str = "config.json") -> dict:
    if not path.is_file():
        raise CheckpointError(label, f"not found (looked at {path})")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(label, f"cannot be read as JSON ({e.__class__.__name__})") from None
    if not isinstance(config, dict):
        raise CheckpointError(label, "is not a JSON object")
    return config


def model_type_of(config: dict, label: str = "config.json") -> ModelType:
    """The model type of an HF config dict (it alone decides the family); CheckpointError naming `label` for an
    unknown one."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(label, f"unknown model_type {model_type!r}; supported: {', '.join(MODEL_TYPES)}")
    return MODEL_TYPES[model_type]


def _weight_files(locate: _Locator) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors file names of the checkpoint, and the index's tensor -> file map (None without an index)."""
    index = locate(INDEX)
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(INDEX, f"has no readable weight_map ({e.__class__.__name__})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(INDEX, "weight_map must map tensor names to file names")
        for name in sorted(set(weight_map.values())):
            if "/" in name or name.startswith(".") or not locate(name).is_file():
                raise CheckpointError(name, f"listed in {INDEX} but not found")
        return sorted(set(weight_map.values())), weight_map
    names = [n for n in locate.names() if n.endswith(".safetensors")]
    if not names:
        foreign = [n for n in locate.names() if n.endswith(_FOREIGN_WEIGHTS)]
        hint = f" (found {', '.join(foreign)}: only safetensors are supported)" if foreign else ""
        raise CheckpointError("model.safetensors", f"no safetensors weights in {locate.src}{hint}")
    return names, None


def _read_tensors(locate: _Locator, files: list[str], weight_map: dict[str, str] | None) -> dict[str, Located]:
    found: dict[str, Located] = {}
    for file in files:
        path = locate(file)
        for name, entry in read_header(path, file).items():
            if name in found:
                raise CheckpointError(file, f"is also stored in {found[name].file}", name)
            if weight_map is not None and weight_map.get(name) != file:
                raise CheckpointError(file, f"is not listed for this file in {INDEX}", name)
            found[name] = Located(file, path, entry)
    for name, file in sorted((weight_map or {}).items()):
        if name not in found:
            raise CheckpointError(file, f"is listed in {INDEX} but absent from the file", name)
    return found


def check_vocab(tensors: Mapping[str, Located], model_type: ModelType, arch: Arch) -> None:
    """config.json's vocab_size against the rows of the embedding and lm_head. Checked before the tensor shapes, so
    that a config that lies about its vocabulary is blamed rather than the tensor."""
    for name in (f"{model_type.text_prefix}embed_tokens.weight", "lm_head.weight"):
        found = tensors.get(name)
        if found is not None and found.entry.shape and found.entry.shape[0] != arch.vocab_size:
            raise CheckpointError("config.json", f"vocab_size {arch.vocab_size} does not match the "
                                                 f"{found.entry.shape[0]} rows of tensor {name!r} in {found.file}")


def validate(found: Mapping[str, TensorInfo], expected: Mapping[str, tuple[int, ...]], model_type: ModelType,
             missing_label: str) -> None:
    """Raise CheckpointError for the first missing, misshapen, non-float or unexpected tensor, against `expected`
    (name -> shape: what the conversion program reads, layout.Program.sources)."""
    for name, shape in expected.items():
        info = found.get(name)
        if info is None:
            raise CheckpointError(missing_label, f"is missing (expected shape {shape})", name)
        if info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(info.file, f"has dtype {info.dtype}, expected a floating-point dtype", name)
        if tuple(info.shape) != tuple(shape):
            raise CheckpointError(info.file, f"has shape {tuple(info.shape)}, expected {tuple(shape)}", name)
    for name, info in sorted(found.items()):
        if name not in expected and not name.startswith(model_type.dropped_prefixes):
            raise CheckpointError(info.file, f"is not part of a {model_type.family.name} checkpoint of this config",
                                  name)


def arch_of(config: dict, label: str = "config.json") -> tuple[ModelType, Arch]:
    """The model type and architecture of a config; a CheckpointError naming `label` and the field it cannot read."""
    model_type = model_type_of(config, label)
    try:
        arch = arch_from_config(config, label)
    except ConfigError as e:
        raise CheckpointError(label, e.message) from None
    if model_type.vision_prefix and arch.vision is None:
        raise CheckpointError(label, "vision_config is missing or not an object")
    return model_type, arch


def read_checkpoint(src: Path, files: Mapping[str, Path] | None = None) -> CheckpointFiles:
    """Read and check the files of the checkpoint at `src` (headers only: no tensor data is read)."""
    locate = _Locator(src, files)
    config = load_config(locate("config.json"))
    model_type, arch = arch_of(config)
    names, weight_map = _weight_files(locate)
    tensors = _read_tensors(locate, names, weight_map)
    check_vocab(tensors, model_type, arch)
    carried = {n: locate(n) for n in locate.names()
               if n.endswith(_CARRIED_SUFFIXES) and n != INDEX and locate(n).is_file()}
    return CheckpointFiles(config, model_type, arch, tensors, carried, INDEX if weight_map is not None else names[0])
