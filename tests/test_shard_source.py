"""The steps that read the checkpoint's bytes through the convert step's description (shard, materialize) find it
where the snapshot says, on the machine they run on, and a Hub model this machine's HF cache lacks (a Ray worker
other than the fetch's) is fetched again, at the snapshot's commit, by the fetch action itself. Against
tests/hubdouble.py, a local Hub the real huggingface_hub downloads from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from qbuild.core.errors import UserError
from qbuild.execution.source_files import locate_checkpoint
from qbuild.model.convert.convert import convert_checkpoint
from qbuild.model.convert.shard import shard_checkpoint
from qbuild.model.ranks import RankLayout
from qbuild.planning.step import Context, Source
from qbuild.recipe.params import ConvertParams, FetchHub, FetchPath, ShardParams
from qbuild.steps.convert import Convert
from qbuild.steps.fetch import Fetch
from qbuild.steps.shard import Shard
from tests.hubdouble import HubDouble
from tests.conftest_convert import same_tensors, tiny

REPO_ID = "tiny-org/moe"
SHARD = ShardParams("cpu", RankLayout.split(2, 2), True, "float32")


def _ctx(tmp: Path, name: str, params, inputs: dict, source: dict) -> Context:
    out, scratch = tmp / name / "out", tmp / name / "scratch"
    out.mkdir(parents=True)
    scratch.mkdir()
    return Context(params=params, inputs=inputs, out=out, scratch=scratch, source=Source(**source),
                   log=lambda m: None)


def _run(step, ctx: Context) -> None:
    """Run a step as a worker does: the source checkpoint located first where the step reads it
    (qbuild.execution.job)."""
    if step.reads_checkpoint and "snapshot" in ctx.inputs:
        ctx.checkpoint = locate_checkpoint(ctx.inputs["snapshot"], ctx.source, ctx.scratch, ctx.log)
    step.run(ctx)


def _online(monkeypatch, double: HubDouble) -> None:
    monkeypatch.setenv("HF_ENDPOINT", double.url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")


def test_a_shard_on_a_machine_without_the_hub_model_fetches_it_again(tmp_path, monkeypatch):
    src = tiny("qwen3_5_moe_fused")
    with HubDouble() as double:
        commit = double.add_commit(REPO_ID, src)
        _online(monkeypatch, double)
        fetch = _ctx(tmp_path, "fetch", FetchHub("hf", REPO_ID, commit), {}, {})
        _run(Fetch, fetch)
        convert = _ctx(tmp_path, "convert", ConvertParams("qwen3_5_moe", "float32", "none"),
                       {"snapshot": fetch.out}, {})
        _run(Convert, convert)
        # Another machine: the same snapshot and description, an empty HF cache.
        monkeypatch.setenv("HF_HOME", str(tmp_path / "other-hf-home"))
        shard = _ctx(tmp_path, "shard", SHARD, {"converted": convert.out, "snapshot": fetch.out}, {})
        _run(Shard, shard)
        downloads = [p for m, p in double.requests if m == "GET" and "/resolve/" in p]
    assert any(p.endswith(".safetensors") for p in downloads)
    assert (tmp_path / "other-hf-home" / "hub" / "models--tiny-org--moe" / "snapshots" / commit).is_dir()
    convert_checkpoint(src, tmp_path / "materialized", dtype="float32")
    want = shard_checkpoint(tmp_path / "materialized", tmp_path / "want", ranks=RankLayout.split(2, 2),
                            fused_qkv=True, dtype="float32")
    assert json.loads((shard.out / "shard.json").read_text()) == want
    for r in range(2):
        name = f"weights/tp{r}_sharded_checkpoint.safetensors"
        assert same_tensors(load_file(shard.out / name), load_file(tmp_path / "want" / name))


def test_a_local_checkpoint_gone_from_its_path_is_one_line(tmp_path):
    src = shutil.copytree(tiny("qwen3_5"), tmp_path / "ck")
    digests = {p.name: p for p in src.iterdir()}
    from qbuild.core.hashing import digest_file

    fetch = _ctx(tmp_path, "fetch", FetchPath("path", {n: "blake3:" + digest_file(p) for n, p in digests.items()}),
                 {}, {"path": str(src)})
    _run(Fetch, fetch)
    convert = _ctx(tmp_path, "convert", ConvertParams("qwen3_5", "float32", "none"), {"snapshot": fetch.out},
                   {"path": str(src)})
    _run(Convert, convert)
    shutil.rmtree(src)
    shard = _ctx(tmp_path, "shard", ShardParams("cpu", RankLayout.split(2), False, "float32"),
                 {"converted": convert.out, "snapshot": fetch.out}, {"path": str(src)})
    with pytest.raises(UserError, match=r"ck/.*: missing; the checkpoint changed since it was planned"):
        _run(Shard, shard)
    assert list(shard.out.iterdir()) == []
