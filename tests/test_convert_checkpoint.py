"""Streaming convert of each family's tiny checkpoint: output layout, equality with the in-memory path, both MoE
storage forms, threads, size-capped output shards, files living elsewhere."""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
from contextlib import contextmanager

import pytest

from qbuild.model.convert.convert import convert_checkpoint, convert_state_dict
from tests.conftest import REPO
from tests.conftest_convert import hf_state_dict, load_dir, same_tensors, tiny


@pytest.mark.parametrize("variant", ["qwen3_5", "qwen3_5_moe", "qwen3_5_moe_fused", "qwen3_next", "qwen3_next_fused"])
def test_streaming_convert_matches_in_memory(tmp_path, variant):
    src, dst = tiny(variant), tmp_path / "out"
    report = convert_checkpoint(src, dst, fp8="mlp_only")
    config, hf = hf_state_dict(variant)
    text, vision = convert_state_dict(config, hf, fp8="mlp_only")
    assert same_tensors(load_dir(dst / "text"), text)
    index = json.loads((dst / "text" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(text) and set(index["weight_map"].values()) == {"model-00001.safetensors"}
    if vision:
        assert same_tensors(load_dir(dst / "vision"), vision)
    else:
        assert not (dst / "vision").exists()
    assert json.loads((dst / "convert.json").read_text()) == report
    assert report["family"] == config["model_type"] and report["dtype"] == "bfloat16" and report["fp8"] == "mlp_only"
    assert report["tensors"] == len(text) + len(vision)
    assert report["bytes"] == sum(t.numel() * t.element_size() for t in [*text.values(), *vision.values()])
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (dst / name).read_bytes() == (src / name).read_bytes(), name
    assert not list(dst.glob("*.safetensors")) and not list(tmp_path.glob(".out.partial-*"))


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_both_expert_storage_forms_convert_identically(tmp_path, family):
    convert_checkpoint(tiny(family), tmp_path / "a", dtype="float32")
    convert_checkpoint(tiny(family + "_fused"), tmp_path / "b", dtype="float32")
    assert same_tensors(load_dir(tmp_path / "a" / "text"), load_dir(tmp_path / "b" / "text"))


def test_threads_and_small_output_shards_give_the_same_tensors(tmp_path):
    src = tiny("qwen3_5_moe_fused")
    convert_checkpoint(src, tmp_path / "one", fp8="full")
    report = convert_checkpoint(src, tmp_path / "many", fp8="full", workers=2, max_shard_bytes=64 * 1024)
    assert len(report["text_files"]) > 3
    index = json.loads((tmp_path / "many" / "text" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == report["text_files"]
    assert index["metadata"]["total_size"] == report["text_bytes"]
    assert same_tensors(load_dir(tmp_path / "one" / "text"), load_dir(tmp_path / "many" / "text"))
    # a step's outputs stay together, and no file is over the cap unless one step alone is
    for f in report["text_files"]:
        assert (tmp_path / "many" / "text" / f).stat().st_size < 64 * 1024 + 200 * 1024


def test_files_mapping_reads_checkpoint_files_from_elsewhere(tmp_path):
    """As from an HF cache: the snapshot directory is empty, each file name maps to a blob path."""
    src = tiny("qwen3_next")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    files = {}
    for k, path in enumerate(sorted(src.iterdir())):
        files[path.name] = blobs / f"blob{k:03d}"
        shutil.copyfile(path, files[path.name])
    (tmp_path / "snapshot").mkdir()
    convert_checkpoint(tmp_path / "snapshot", tmp_path / "a", files=files)
    convert_checkpoint(src, tmp_path / "b")
    assert same_tensors(load_dir(tmp_path / "a" / "text"), load_dir(tmp_path / "b" / "text"))
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


def test_single_file_checkpoint_without_index(tmp_path):
    from safetensors.torch import save_file

    config, hf = hf_state_dict("qwen3_5")
    src = tmp_path / "src"
    src.mkdir()
    save_file(hf, src / "model.safetensors")
    shutil.copyfile(tiny("qwen3_5") / "config.json", src / "config.json")
    convert_checkpoint(src, tmp_path / "out", dtype="float16")
    text, _ = convert_state_dict(config, hf, dtype="float16")
    assert same_tensors(load_dir(tmp_path / "out" / "text"), text)


def test_existing_destination_is_left_alone(tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep").write_text("x")
    with pytest.raises(FileExistsError):
        convert_checkpoint(tiny("qwen3_5"), dst)
    assert [p.name for p in dst.iterdir()] == ["keep"]
    (dst / "keep").unlink()
    convert_checkpoint(tiny("qwen3_5"), dst)  # an empty directory is fine
    assert (dst / "convert.json").is_file()


@pytest.mark.parametrize("kwargs, match", [(dict(dtype="int8"), "dtype"), (dict(fp8="all"), "fp8")])
def test_bad_options_are_refused_before_anything_is_written(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        convert_checkpoint(tiny("qwen3_5"), tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


@contextmanager
def file_size_limit(nbytes: int):
    """Writes of this process past `nbytes` into any file fail, as on a full disk (the kernel answers EFBIG; Python
    ignores the SIGXFSZ that comes with it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@pytest.mark.parametrize("workers", [1, 2])
def test_a_failure_while_writing_leaves_nothing_behind(tmp_path, workers):
    src = tiny("qwen3_5_moe_fused")          # about 2 MB of weights: every output shard outgrows the limit
    with pytest.raises(OSError, match="File too large"), file_size_limit(64 << 10):
        convert_checkpoint(src, tmp_path / "out", workers=workers)
    assert list(tmp_path.iterdir()) == []


CHECK = """\
import sys
from pathlib import Path
from qbuild.core.errors import UserError
from qbuild.hub.snapshot import check_checkpoint
try:
    check_checkpoint(Path(sys.argv[1]))
    print("ok")
except UserError as e:
    print(e)
assert "torch" not in sys.modules, "torch imported"
"""


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_checking_a_checkpoint_imports_no_torch(family, tiny_checkpoints, tmp_path):
    """The CLI checks every header of a checkpoint before a build's first step, in its own process: without torch, so
    a bad checkpoint is refused at once and a good one costs no torch import there."""
    def check(directory) -> str:
        proc = subprocess.run([sys.executable, "-c", CHECK, str(directory)], cwd=REPO, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    assert check(tiny_checkpoints[family]) == "ok"
    bad = shutil.copytree(tiny_checkpoints[family], tmp_path / "bad")
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    shard = bad / index["weight_map"]["lm_head.weight"]
    shard.write_bytes(shard.read_bytes()[:-4])
    assert check(bad).startswith(f"{bad}/{shard.name}: ") and "truncated" in check(bad)


def test_the_header_dtype_table_names_torch_dtypes_of_the_sizes_it_gives():
    """safetensors_header sizes each dtype code without torch; safetensors_io maps the same codes to torch."""
    from qbuild.model.convert.safetensors_header import DTYPES as SIZES
    from qbuild.model.convert.safetensors_io import DTYPE_NAMES, DTYPES

    assert set(DTYPES) == set(SIZES)
    assert {code: DTYPES[code].itemsize for code in SIZES} == {code: size for code, (_, size) in SIZES.items()}
    assert all(DTYPE_NAMES[DTYPES[code]] == code for code in SIZES)
