"""The converted text weights as a description: what convert stores, and what shard streams the checkpoint through.

The described path must give exactly what the materialized one gives (convert_checkpoint's files, then shard), byte
for byte, for every layout; the description holds no weight bytes; it is refused against any other checkpoint, or
where this qbuild's conversion program would make something else of it; and every step that runs a rule from it has
the rule's code in its key.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from qbuild import backends
from qbuild.model.convert import CheckpointError
from qbuild.model.convert.convert import convert_checkpoint, describe_checkpoint, materialize
from qbuild.model.convert.safetensors_header import read_header
from qbuild.model.convert.shard import shard_checkpoint
from qbuild.model.ranks import RankLayout
from tests.conftest_convert import load_dir, same_tensors, tiny


def _files(src: Path) -> dict[str, Path]:
    return {p.name: p for p in src.iterdir() if p.is_file()}


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("variant, fp8, shard", [
    ("qwen3_5_moe_fused", "mlp_only", dict(ranks=RankLayout.split(2, 2), fused_qkv=True)),
    ("qwen3_5_moe_tp4", "mlp_only", dict(ranks=RankLayout.split(4, 2), fused_qkv=True)),
    ("qwen3_next", "full", dict(ranks=RankLayout.split(2))),
    ("qwen3_5_moe_tp4", "mlp_only", dict(ranks=RankLayout.split(4, 2), fused_qkv=True, layout="nxd-main",
                                         dtype="bfloat16")),
    ("qwen3_5_moe", "none", dict(ranks=RankLayout.split(2, 2), fused_qkv=True, layout="nxd-moe", dtype="bfloat16")),
    ("qwen3_next", "none", dict(ranks=RankLayout(world=4, dense_tp=2, moe_tp=2, moe_ep=2), layout="nxd-moe",
                                dtype="bfloat16")),
    ("qwen3_5", "none", dict(ranks=RankLayout.split(2), fused_qkv=True, layout="nxd-main-replicated",
                             dtype="bfloat16")),
])
def test_shards_through_the_description_are_the_shards_of_the_materialized_weights(tmp_path, variant, fp8, shard):
    shard = {**shard, "layout": backends.shard_layout(shard.get("layout", "cpu"))}
    src = tiny(variant)
    convert_checkpoint(src, tmp_path / "materialized", fp8=fp8)
    describe_checkpoint(src, tmp_path / "described", fp8=fp8)
    a = shard_checkpoint(tmp_path / "materialized", tmp_path / "a", workers=2, **shard)
    b = shard_checkpoint(tmp_path / "described", tmp_path / "b", workers=2, files=_files(src), **shard)
    assert a == b
    assert _tree_bytes(tmp_path / "a") == _tree_bytes(tmp_path / "b")


def test_the_description_holds_every_converted_tensor_and_no_weight_bytes(tmp_path):
    src = tiny("qwen3_5_moe")
    full = convert_checkpoint(src, tmp_path / "materialized", fp8="mlp_only")
    report = describe_checkpoint(src, tmp_path / "described", fp8="mlp_only")
    described = tmp_path / "described"
    assert sorted(p.name for p in (described / "text").iterdir()) == ["description.json"]
    doc = json.loads((described / "text" / "description.json").read_text())
    stored = {}
    for f in full["text_files"]:
        stored.update(read_header(tmp_path / "materialized" / "text" / f))
    outputs = {n: (d, tuple(s)) for step in doc["steps"] for n, d, s in step["outputs"]}
    assert outputs == {n: (e.dtype, e.shape) for n, e in stored.items()}
    assert doc["bytes"] == full["text_bytes"] == report["text_bytes"] and doc["tensors"] == full["text_tensors"]
    # The vision weights ship in the bundle as they are: written here once, as the materialized form writes them.
    assert (described / "vision" / "model.safetensors").read_bytes() == \
        (tmp_path / "materialized" / "vision" / "model.safetensors").read_bytes()
    weights = sum(p.stat().st_size for p in (tmp_path / "materialized" / "text").glob("*.safetensors"))
    assert (described / "text" / "description.json").stat().st_size < weights / 4
    assert report["text"] == "described" and report["text_files"] == []


def test_a_step_names_its_rule_its_sources_byte_ranges_and_their_files_digests(tmp_path):
    src = tiny("qwen3_5_moe_fused")
    digests = {name: f"sha256:{i:064x}" for i, name in enumerate(sorted(_files(src)))}
    describe_checkpoint(src, tmp_path / "d", digests=digests)
    doc = json.loads((tmp_path / "d" / "text" / "description.json").read_text())
    by_output = {step["outputs"][0][0]: step for step in doc["steps"]}
    q = by_output["layers.3.self_attn.q_proj.weight"]
    assert q["rule"] == "attention.split_query_gate" and q["args"] == {}
    assert [o[0] for o in q["outputs"]] == ["layers.3.self_attn.q_proj.weight",
                                            "layers.3.self_attn.output_gate_proj.weight"]
    (file, tensor, dtype, shape, (begin, end)), = q["sources"]
    entry = read_header(src / file)[tensor]
    assert (tensor, dtype, tuple(shape), begin, end) == (
        "model.language_model.layers.3.self_attn.q_proj.weight", entry.dtype, entry.shape, entry.begin, entry.end)
    assert doc["files"][file] == {"digest": digests[file], "size": (src / file).stat().st_size}
    assert by_output["layers.0.input_layernorm.weight"]["rule"] == "norms.plus_one"
    assert by_output["layers.0.mlp.moe.expert_mlps.mlp_op.gate_up_proj.weight"]["rule"] == "moe.gate_up_from_fused"
    assert by_output["embed_tokens.weight"]["args"] == {"zero_row": None, "tied_copy": False}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_the_description_is_refused_against_another_checkpoint(tmp_path):
    src = _copy(tiny("qwen3_5"), tmp_path / "src")
    describe_checkpoint(src, tmp_path / "d")
    # Same headers, other bytes (a fine-tune): the files' digests differ.
    name = sorted(json.loads((tmp_path / "d" / "text" / "description.json").read_text())["files"])[0]
    data = bytearray((src / name).read_bytes())
    data[-1] ^= 0xFF
    (src / name).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"^text/description\.json: files differs from the checkpoint's"):
        shard_checkpoint(tmp_path / "d", tmp_path / "out", ranks=RankLayout.split(2), files=_files(src))
    assert not (tmp_path / "out").exists()


def test_a_description_this_program_would_not_write_is_refused(tmp_path):
    src = tiny("qwen3_5")
    describe_checkpoint(src, tmp_path / "d")
    path = tmp_path / "d" / "text" / "description.json"
    doc = json.loads(path.read_text())
    step = next(i for i, s in enumerate(doc["steps"]) if s["rule"] == "norms.plus_one")
    doc["steps"][step]["rule"] = "steps.same"      # as a convert before a rule's rename would have named it
    path.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=rf"^text/description\.json: step {step} \(.*norm.weight\) differs"):
        shard_checkpoint(tmp_path / "d", tmp_path / "out", ranks=RankLayout.split(2), files=_files(src))
    with pytest.raises(CheckpointError, match=r"^text/description\.json: describes weights .* its files are needed"):
        shard_checkpoint(tmp_path / "d", tmp_path / "out", ranks=RankLayout.split(2))
    assert not (tmp_path / "out").exists()


def test_materializing_a_description_writes_the_converted_checkpoint(tmp_path):
    src = tiny("qwen3_next")
    describe_checkpoint(src, tmp_path / "d", dtype="float32", fp8="full")
    report = materialize(tmp_path / "d", tmp_path / "m", files=_files(src), workers=2)
    full = convert_checkpoint(src, tmp_path / "full", dtype="float32", fp8="full")
    assert report == full
    assert same_tensors(load_dir(tmp_path / "m" / "text"), load_dir(tmp_path / "full" / "text"))
    assert _tree_bytes(tmp_path / "m") == _tree_bytes(tmp_path / "full")


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("kind", ["convert", "shard", "materialize"])
def test_every_step_that_runs_a_rule_has_its_code_in_its_key(kind, family):
    """The description names a rule; each step that runs it holds its family's rule modules (Family.rules, the code a
    node of that family carries), so an edit of a rule re-keys that step, and of another family's rule does not."""
    from qbuild.model.families import FAMILIES
    from qbuild.planning.keys import closure
    from qbuild.steps.registry import STEPS

    step = next(s for s in STEPS if s.kind == kind)
    modules = {name for name, _ in closure(step, FAMILIES[family].rule_modules()).modules}
    rules = {f"qbuild.model.convert.{m}" for m in (*FAMILIES[family].rules, "fp8", "rule", "layout")}
    assert rules <= modules, sorted(rules - modules)
    others = {f"qbuild.model.convert.{m}" for f in FAMILIES.values() for m in f.rules} - rules
    assert not others & modules, sorted(others & modules)


def _edited(rule, body):
    """`body` under `rule`'s name: an edit of the rule's code that keeps its name."""
    def edited(arch, w):
        return body(arch, w)
    edited.__module__, edited.__qualname__ = rule.__module__, rule.__qualname__
    return edited


def test_the_description_does_not_change_with_a_rules_code(tmp_path, monkeypatch):
    """A rule's code is in the key of the steps that run it, not in the description's bytes: an edit of it re-keys
    convert and shard (their closures hold it), and nothing that reads only the description's digest."""
    from dataclasses import replace

    from safetensors.torch import load_file

    from qbuild.model.convert import norms

    src = tiny("qwen3_5")
    describe_checkpoint(src, tmp_path / "a")
    plus_two = _edited(norms.plus_one, lambda arch, w: (w.float() + 2.0,))
    monkeypatch.setattr(norms, "LAYER_NORMS", tuple(replace(r, transform=plus_two) for r in norms.LAYER_NORMS))
    describe_checkpoint(src, tmp_path / "b")
    assert _tree_bytes(tmp_path / "a") == _tree_bytes(tmp_path / "b")
    shard_checkpoint(tmp_path / "b", tmp_path / "s", ranks=RankLayout.split(2), files=_files(src))
    rank = load_file(tmp_path / "s" / "weights" / "tp0_sharded_checkpoint.safetensors")
    hf = load_dir(src)["model.language_model.layers.0.input_layernorm.weight"]
    assert torch.equal(rank["layers.0.input_layernorm.weight"], hf.float() + 2.0)   # the rule as it is now


def test_rank_tensors_laid_out_a_row_at_a_time_are_the_same_bytes(tmp_path, monkeypatch):
    """The writer lays out a rank tensor that is not a byte range of the checkpoint (a transposed expert slice, a
    Deferred gate_up, a hidden-dim column) 8 MiB at a time, which a tiny model's tensors never exceed: laid out one
    row at a time instead, every piece after the first starts mid-tensor, and the files must not change."""
    from qbuild.model.convert import safetensors_io

    src = tiny("qwen3_5_moe_tp4")   # fused experts, split over moe_tp 2: rank gate_up slices are Deferred
    describe_checkpoint(src, tmp_path / "described")
    shard = dict(ranks=RankLayout.split(4, 2), fused_qkv=True, layout=backends.shard_layout("nxd-main"),
                 dtype="bfloat16", files=_files(src))
    shard_checkpoint(tmp_path / "described", tmp_path / "whole", workers=2, **shard)
    monkeypatch.setattr(safetensors_io, "_PIECE_BYTES", 1)
    shard_checkpoint(tmp_path / "described", tmp_path / "rows", workers=2, **shard)
    assert _tree_bytes(tmp_path / "whole") == _tree_bytes(tmp_path / "rows")
