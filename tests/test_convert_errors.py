"""A corpus of bad checkpoints: each raises one CheckpointError whose single-line message names the file (and the
tensor where there is one), and nothing is left at the destination."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from qbuild.model.convert import CheckpointError
from qbuild.model.convert.convert import convert_checkpoint
from tests.conftest_convert import tiny

P = "model.language_model."
INDEX = "model.safetensors.index.json"


def _home(src: Path, tensor: str) -> Path:
    return src / json.loads((src / INDEX).read_text())["weight_map"][tensor]


def _rewrite(src: Path, tensor: str, change: Callable[[dict], None]) -> str:
    """Apply `change` to the tensors of the file holding `tensor`, rewrite the file and the index; the file name."""
    path = _home(src, tensor)
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    index = json.loads((src / INDEX).read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != path.name or k in tensors}
    index["weight_map"].update({k: path.name for k in tensors})
    (src / INDEX).write_text(json.dumps(index))
    return path.name


def _raw_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_raw(path: Path, header: dict | bytes, data: bytes) -> None:
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def missing_tensor(src):
    _rewrite(src, f"{P}layers.1.mlp.up_proj.weight", lambda t: t.pop(f"{P}layers.1.mlp.up_proj.weight"))
    return INDEX, f"{P}layers.1.mlp.up_proj.weight", "missing"


def wrong_shape(src):
    name = f"{P}layers.3.self_attn.k_proj.weight"
    return _rewrite(src, name, lambda t: t.update({name: torch.zeros(63, 64)})), name, "shape"


def integer_dtype(src):
    name = f"{P}norm.weight"
    return _rewrite(src, name, lambda t: t.update({name: torch.zeros(64, dtype=torch.int32)})), name, "dtype"


def unexpected_tensor(src):
    name = f"{P}layers.0.linear_attn.in_proj_qkv.bias"
    other = f"{P}layers.0.linear_attn.in_proj_qkv.weight"
    return _rewrite(src, other, lambda t: t.update({name: torch.zeros(128)})), name, "not part of"


def truncated_file(src):
    path = _home(src, f"{P}embed_tokens.weight")
    header, _ = _raw_header(path)
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    path.write_bytes(path.read_bytes()[:-100])
    return path.name, last, "truncated"


def lying_offsets(src):
    name = f"{P}embed_tokens.weight"
    path = _home(src, name)
    header, data = _raw_header(path)
    header[name] = {"dtype": "F32", "shape": [1 << 28], "data_offsets": [0, 1 << 30]}
    _write_raw(path, header, data)
    return path.name, name, "ends at byte"


def corrupt_header(src):
    path = _home(src, f"{P}norm.weight")
    _, data = _raw_header(path)
    _write_raw(path, b'{"model.language_model.norm.weight": {"dtype": "F32", "sha', data)
    return path.name, None, "JSON"


def header_length_beyond_file(src):
    path = _home(src, f"{P}norm.weight")
    path.write_bytes(struct.pack("<Q", 1 << 40) + path.read_bytes()[8:])
    return path.name, None, "header length"


def empty_file(src):
    path = _home(src, f"{P}norm.weight")
    path.write_bytes(b"")
    return path.name, None, "not a safetensors file"


def overlapping_tensors(src):
    path = _home(src, f"{P}layers.0.linear_attn.in_proj_qkv.weight")
    header, data = _raw_header(path)
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    second = header[names[1]]
    size = second["data_offsets"][1] - second["data_offsets"][0]
    begin = header[names[0]]["data_offsets"][1] - 4
    second["data_offsets"] = [begin, begin + size]
    _write_raw(path, header, data)
    return path.name, names[1], "overlaps"


def unknown_model_type(src):
    config = json.loads((src / "config.json").read_text())
    config["model_type"] = "llama"
    (src / "config.json").write_text(json.dumps(config))
    return "config.json", None, "unknown model_type 'llama'"


def missing_config(src):
    (src / "config.json").unlink()
    return "config.json", None, "not found"


def config_missing_a_dimension(src):
    config = json.loads((src / "config.json").read_text())
    del config["text_config"]["linear_num_value_heads"]
    (src / "config.json").write_text(json.dumps(config))
    return "config.json", None, "linear_num_value_heads"


def index_names_a_missing_file(src):
    path = _home(src, f"{P}norm.weight")
    path.unlink()
    return path.name, None, f"listed in {INDEX} but not found"


def index_lists_a_tensor_its_file_lacks(src):
    index = json.loads((src / INDEX).read_text())
    index["weight_map"][f"{P}layers.9.mlp.up_proj.weight"] = index["weight_map"][f"{P}norm.weight"]
    (src / INDEX).write_text(json.dumps(index))
    return index["weight_map"][f"{P}norm.weight"], f"{P}layers.9.mlp.up_proj.weight", "absent from the file"


def corrupt_index(src):
    (src / INDEX).write_text("{not json")
    return INDEX, None, "weight_map"


def only_pickle_weights(src):
    for f in src.glob("*.safetensors"):
        f.unlink()
    (src / INDEX).unlink()
    (src / "pytorch_model.bin").write_bytes(b"\x80\x02not really")
    return "model.safetensors", None, "only safetensors are supported"


CASES = [missing_tensor, wrong_shape, integer_dtype, unexpected_tensor, truncated_file, lying_offsets, corrupt_header,
         header_length_beyond_file, empty_file, overlapping_tensors, unknown_model_type, missing_config,
         config_missing_a_dimension, index_names_a_missing_file, index_lists_a_tensor_its_file_lacks, corrupt_index,
         only_pickle_weights]


@pytest.mark.parametrize("corrupt", CASES, ids=[c.__name__ for c in CASES])
def test_bad_checkpoint_raises_one_line_naming_file_and_tensor(tmp_path, corrupt):
    src = tmp_path / "src"
    shutil.copytree(tiny("qwen3_5"), src)
    file, tensor, what = corrupt(src)
    dst = tmp_path / "out" / "converted"
    with pytest.raises(CheckpointError) as info:
        convert_checkpoint(src, dst, workers=2)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{file}: "), message
    assert what in message, message
    if tensor is not None:
        assert f"tensor '{tensor}'" in message, message
    assert info.value.file == file and info.value.tensor == tensor
    assert not dst.exists()
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # no staging left behind
