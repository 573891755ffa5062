"""The contract double's load checks VALUES: a packaged bundle whose shards have the right names, shapes and dtypes
but the wrong contents fails to load, naming the shard file and the tensor in one line.

One tiny bundle per port lineage (main, main-replicated, moe), each at tp 4 with 8 attention heads over 2 kv heads,
so that NxD replicates each kv head to two ranks (docs/nxdi.md section 4). Each bundle loads untouched; each damage of
the kind a converter bug produces makes it fail: two ranks' slices swapped, kv heads replicated in the wrong order,
a norm's +1 dropped, a head's query and gate halves exchanged. NxD's zero q heads exist only where tp does not divide
the attention heads, which recipes refuse (qbuild.recipe.checks), so the padding case is built beside a bundle: the
same compile with 6 heads, and shards written by qbuild's converter, which must load, and not with the zero head
moved to the front.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.nxdi_double import MAIN_PORT, MOE_PORT, SITE, replicated_deltanet_port
from tests.test_neuron_double import Build, load_bundles, require_bundle, write_recipe

pytestmark = pytest.mark.xdist_group("nxdi-double-values")

TP = 4
HEAD_DIM = 32          # qbuild.model.tinymodel's head_dim
ATTN_LAYER = 1         # the full-attention layer of `qbuild tiny`'s model (a DeltaNet layer, then attention)


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict[str, tuple[Build, Path]]:
    """{lineage: (its build, its packaged bundle)}, each built once through the CLI with the double."""
    from qbuild.model.tinymodel import TP4_TEXT, write_tiny_checkpoint

    root = tmp_path_factory.mktemp("nxdi-values")
    dense = write_tiny_checkpoint(root / "ckpt-qwen3_5", "qwen3_5", text_overrides=TP4_TEXT)
    moe = write_tiny_checkpoint(root / "ckpt-qwen3_next", "qwen3_next", text_overrides=TP4_TEXT)
    specs = {"main": (dense, MAIN_PORT, {}),
             "main-replicated": (dense, replicated_deltanet_port(root / "Qwen3.5-27B"),
                                 {"port": {"lineage": "main-replicated"}}),
             "moe": (moe, MOE_PORT, {"port": {"lineage": "moe"}, "fused_qkv": True, "moe_backend": "shard_on_block"})}
    out = {}
    for lineage, (checkpoint, port, changes) in specs.items():
        build = Build(root / lineage)
        build.recipe = write_recipe(build.root / "recipes" / f"{lineage}.yaml", checkpoint, port,
                                    parallel={"tp": TP}, **changes)
        build.result, build.stderr = build.compile(build.recipe)
        require_bundle(build.result, build.stderr)
        out[lineage] = (build, build.node_outputs(lineage, "package", root / f"{lineage}-bundle"))
    return out


def _damaged(bundle: Path, dest: Path, rank_edits: dict[int, dict]) -> Path:
    """A real copy of `bundle` (never the store's hardlinked blobs) with some ranks' tensors replaced."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(bundle, dest)
    for rank, edits in rank_edits.items():
        shard = dest / "weights" / f"tp{rank}_sharded_checkpoint.safetensors"
        tensors = load_file(shard)
        # Edits read other tensors from the untouched bundle, so the order of ranks does not matter.
        tensors.update({name: edit(tensors[name], rank, bundle) for name, edit in edits.items()})
        shard.unlink()
        save_file(tensors, shard)
    return dest


def _other_rank(name: str, rank: int):
    def edit(t, r, source):
        from safetensors import safe_open

        with safe_open(source / "weights" / f"tp{rank}_sharded_checkpoint.safetensors", "pt") as f:
            return f.get_tensor(name).clone()
    return edit


def _swap_rows(a: slice, b: slice):
    def edit(t, r, dest):
        t = t.clone()
        first = t[a].clone()
        t[a] = t[b]
        t[b] = first
        return t
    return edit


def _minus_one(t, r, dest):
    return (t.float() - 1.0).to(t.dtype)


def _k_name(lineage: str) -> str:
    attn = f"layers.{ATTN_LAYER}.self_attn.qkv_proj"
    return f"{attn}.Wqkv.weight" if lineage == "moe" else f"{attn}.k_proj.weight"


def _k_rows(lineage: str, head: int) -> slice:
    """The k rows of a rank's tensor: after its 2 q heads in a fused Wqkv."""
    return slice(2 * head, 3 * head) if lineage == "moe" else slice(0, head)


def _rows_from(name: str, rank: int, rows: slice):
    """These rows of this tensor taken from another rank's untouched shard."""
    def edit(t, r, source):
        from safetensors import safe_open

        with safe_open(source / "weights" / f"tp{rank}_sharded_checkpoint.safetensors", "pt") as f:
            other = f.get_tensor(name)
        t = t.clone()
        t[rows] = other[rows]
        return t
    return edit


def _q_name(lineage: str) -> str:
    attn = f"layers.{ATTN_LAYER}.self_attn.qkv_proj"
    return f"{attn}.Wqkv.weight" if lineage == "moe" else f"{attn}.q_proj.weight"


@pytest.mark.slow
@pytest.mark.parametrize("lineage", ["main", "main-replicated", "moe"])
def test_load_fails_on_wrong_values_naming_file_and_tensor(bundles, lineage, tmp_path):
    build, bundle = bundles[lineage]
    head = HEAD_DIM
    gate = f"layers.{ATTN_LAYER}.self_attn.output_gate_proj.weight"
    norm = "layers.0.input_layernorm.weight"
    # Per rank, q holds 2 of the 8 padded heads [h0 h1 h2 0 h3 h4 h5 0]: rank 1 holds [h2, 0].
    damages = {
        "swap": ({0: {"lm_head.weight": _other_rank("lm_head.weight", 1)},
                  1: {"lm_head.weight": _other_rank("lm_head.weight", 0)}}, "tp0", "lm_head.weight"),
        # Rank r holds kv head r * 2 // 4: rank 1 head 0, rank 2 head 1. Replicated blockwise instead, rank 1 would
        # hold head 1.
        "kv order": ({1: {_k_name(lineage): _rows_from(_k_name(lineage), 2, _k_rows(lineage, head))}}, "tp1",
                     _k_name(lineage)),
        "no +1": ({r: {norm: _minus_one} for r in range(TP)}, "tp0", norm),
        # rank 0's first q head and first gate rows are both head 0's: its query and gate halves exchanged.
        "q/gate": ({0: {_q_name(lineage): lambda t, r, d: _exchange(t, d, gate, head),
                        gate: lambda t, r, d: _exchange(t, d, _q_name(lineage), head)}}, "tp0", gate),
    }
    dirs = {name: _damaged(bundle, tmp_path / name.replace("/", "-").replace(" ", "").replace("+", "p"), edits)
            for name, (edits, _, _) in damages.items()}
    results = load_bundles(build, bundle, *dirs.values(), log=tmp_path / "load.jsonl")
    assert results[0] == "ok", results[0]
    for (name, (_, rank, tensor)), message in zip(damages.items(), results[1:]):
        assert "\n" not in message, message
        assert message.startswith(f"RuntimeError: {rank}_sharded_checkpoint.safetensors: {tensor}: "), (name, message)
        assert "values differ" in message, (name, message)


def _exchange(t, source: Path, other: str, head: int):
    """Rows 0:head of this rank-0 tensor replaced by rows 0:head of `other` in the untouched shard."""
    from safetensors import safe_open

    with safe_open(source / "weights" / "tp0_sharded_checkpoint.safetensors", "pt") as f:
        source = f.get_tensor(other)
    t = t.clone()
    t[:head] = source[:head]
    return t


@pytest.mark.slow
@pytest.mark.parametrize("lineage", ["main", "main-replicated", "moe"])
def test_padded_q_heads_from_the_converter_load_and_mis_padding_fails(bundles, lineage, tmp_path, monkeypatch):
    """6 heads over 2 kv heads at tp 4: NxD pads q to 8 heads, a zero head after each group of 3 (docs/nxdi.md
    section 4: maybe_pad_interleaved), so rank 1 holds [h2, 0]. The compile is the bundle's own (its planned params
    with the 6-head architecture, through qbuild's driver and the double), the shards qbuild's converter and NxD
    shard step writes; they load, and with rank 1's zero head moved to the front they do not."""
    import dataclasses

    from qbuild.backends.neuron import driver
    from qbuild.backends.neuron.params import NeuronTextCompile
    from qbuild.backends.neuron.ports import LINEAGES
    from qbuild.model.arch import arch_from_config
    from qbuild.model.convert.convert import convert_checkpoint
    from qbuild import backends
    from qbuild.model.convert.shard import shard_checkpoint
    from qbuild.model.ranks import RankLayout
    from qbuild.model.tinymodel import TP4_TEXT, write_tiny_checkpoint
    from qbuild.recipe.params import parse
    from qbuild.store.spec import StoreSpec

    build, bundle = bundles[lineage]
    record = json.loads((bundle / "qbuild-neuron.json").read_text())
    params = parse(NeuronTextCompile, record["params"])
    assert params.text == arch_from_config(json.loads((build.checkpoint / "config.json").read_text())).text_model()
    family = "qwen3_next" if lineage == "moe" else "qwen3_5"
    hf = write_tiny_checkpoint(tmp_path / "hf", family, text_overrides=dict(TP4_TEXT, num_attention_heads=6))
    padded = arch_from_config(json.loads((hf / "config.json").read_text())).text_model()
    params = dataclasses.replace(params, text=padded)
    for key, value in build.env(checkpoint=hf).items():
        monkeypatch.setenv(key, value)
    # The driver looks for the SDK here (find_spec, distribution versions) and runs it in a fresh interpreter.
    monkeypatch.syspath_prepend(str(SITE))
    compiled = tmp_path / "padded"
    compiled.mkdir()
    driver.compile_text(params, bundle / "port", compiled, tmp_path / "scratch", StoreSpec(str(build.store)),
                        log=lambda line: None)
    convert_checkpoint(hf, tmp_path / "converted", dtype=params.dtype)
    shard_checkpoint(tmp_path / "converted", tmp_path / "shards", ranks=RankLayout.split(TP),
                     fused_qkv=params.fused_qkv, layout=backends.shard_layout(LINEAGES[lineage].shard_layout),
                     dtype=params.dtype)
    shutil.copytree(tmp_path / "shards" / "weights", compiled / "weights")
    shutil.copytree(bundle / "port", compiled / "port")
    head = HEAD_DIM
    q = _q_name(lineage)
    damaged = _damaged(compiled, tmp_path / "mis-padded", {1: {q: _swap_rows(slice(0, head), slice(head, 2 * head))}})
    from safetensors import safe_open

    with safe_open(compiled / "weights" / "tp1_sharded_checkpoint.safetensors", "pt") as f:
        rank1 = f.get_tensor(q)
    assert not rank1[head:2 * head].any() and rank1[:head].any(), "rank 1 should hold [h2, zero head]"
    ok, bad = load_bundles(build, compiled, damaged, checkpoint=hf, log=tmp_path / "load.jsonl")
    assert ok == "ok", ok
    assert bad.startswith(f"RuntimeError: tp1_sharded_checkpoint.safetensors: {q}: ") and "values differ" in bad, bad
