"""Typed step params: every params dict the planner writes parses and writes back unchanged (its JSON is in the
key), and a missing, unknown or mistyped field is refused naming it."""

from __future__ import annotations

import copy
import textwrap
from pathlib import Path

import pytest

from qbuild.model.arch import Arch, VisionArch
from qbuild.recipe.source import load_arch
from qbuild.planning.environment import HostEnvironment
from qbuild.core.hashing import StatCache, canonical_json
from qbuild.recipe.params import (CpuTextCompile, CpuVisionCompile, NeuronPackageParams, NeuronTextCompile,
                           NeuronVisionCompile, PackageParams, ParamsError, VerifyParams, parse_compile,
                           parse_package, parse_verify, to_json)
from qbuild.planning.plan import plan_recipe
from qbuild.recipe.schema import load_recipe

PARSERS = {"compile": parse_compile, "package": parse_package, "verify": parse_verify}
PINS = """toolchain: {neuronx_cc: 2.26.6360.0, neuronx_distributed: 0.19.28492,
            neuronx_distributed_inference: 0.10.18399, torch_neuronx: 2.9.0.2}
"""


def _planned(tmp_path: Path, name: str, body: str, extra: str = "") -> dict:
    """{node kind: [params of each node of that kind]} of one recipe, as the planner writes them."""
    f = tmp_path / f"{name}.yaml"
    f.write_text(textwrap.dedent(body) + extra)
    loaded = load_recipe(f)
    nodes = {}
    plan_recipe(nodes, loaded, load_arch(loaded), HostEnvironment(StatCache(tmp_path / "stat.db")))
    out: dict = {}
    for node in nodes.values():
        out.setdefault(node.kind, []).append(node.params)
    return out


def _recipes(tmp_path: Path, tiny_checkpoints) -> dict[str, dict]:
    return {
        "cpu-vl": _planned(tmp_path, "cpu-vl", f"""
            model: {{path: {tiny_checkpoints["qwen3_5"]}}}
            backend: export
            parallel: {{tp: 2}}
            text: {{seq_len: 64, cte_buckets: [16], tkg_buckets: [64]}}
            vision: {{buckets: [64]}}
        """),
        "cpu-moe": _planned(tmp_path, "cpu-moe", f"""
            model: {{path: {tiny_checkpoints["qwen3_5_moe"]}}}
            backend: inductor
            parallel: {{tp: 2, ep: 2}}
            text: {{seq_len: 64, cte_buckets: [16]}}
        """),
        "neuron-vl-fp8": _planned(tmp_path, "neuron-vl", """
            model: {hf: Qwen/Qwen3.5-35B-A3B}
            backend: neuron
            port: {path: ./port, env: {QWEN36_FLAG: "1"}}
            parallel: {tp: 8}
            fp8: mlp_only
            text: {seq_len: 512, cte_buckets: [128, 512]}
            vision: {buckets: [1024]}
        """, PINS),
        "neuron-next": _planned(tmp_path, "neuron-next", """
            model: {hf: Qwen/Qwen3-Coder-Next}
            backend: neuron
            port: {path: ./port}
            parallel: {tp: 8, ep: 4}
            text: {seq_len: 1024, cte_buckets: [128]}
        """, PINS),
    }


def test_every_planned_params_round_trips_byte_for_byte(tmp_path, tiny_checkpoints):
    seen = set()
    for name, kinds in _recipes(tmp_path, tiny_checkpoints).items():
        for kind, parse in PARSERS.items():
            for params in kinds[kind]:
                typed = parse(params)
                seen.add(type(typed))
                # Byte for byte what the key is computed over (the planner's own dicts may hold tuples).
                assert canonical_json(to_json(typed)) == canonical_json(params), (name, kind)
    assert seen == {CpuTextCompile, CpuVisionCompile, NeuronTextCompile, NeuronVisionCompile, PackageParams,
                    NeuronPackageParams, VerifyParams}


def test_parsed_fields_are_typed(tmp_path, tiny_checkpoints):
    kinds = _recipes(tmp_path, tiny_checkpoints)["neuron-vl-fp8"]
    text = next(parse_compile(p) for p in kinds["compile"] if p["graph"] == "text")
    vision = next(parse_compile(p) for p in kinds["compile"] if p["graph"] == "vision")
    assert isinstance(text.text, Arch) and text.text.is_moe and text.text.vision is None
    assert isinstance(vision.vision, VisionArch)
    assert text.cte_buckets == (128, 512) and text.parallel.world_size == 8 and text.compiler.lnc == 2
    assert text.port_env == {"QWEN36_FLAG": "1"} and text.fp8 == "mlp_only"
    package = parse_package(kinds["package"][0])
    assert isinstance(package, NeuronPackageParams) and package.lineage == "main" and package.vision_buckets == (1024,)


def _cpu_text(tmp_path, tiny_checkpoints) -> dict:
    kinds = _recipes(tmp_path, tiny_checkpoints)["cpu-moe"]
    return copy.deepcopy(next(p for p in kinds["compile"] if p["graph"] == "cte"))


@pytest.mark.parametrize("edit,message", [
    (lambda p: p.pop("tp"), "compile params.tp: missing"),
    (lambda p: p.update(pp=2), "compile params.pp: unknown field"),
    (lambda p: p.update(backend="tpu"), "compile params.backend: 'tpu' is not one of 'inductor', 'export'"),
    (lambda p: p.update(graph="prefill"), "compile params.graph: 'prefill' is not one of 'cte', 'tkg'"),
    (lambda p: p.update(dtype="int8"), "compile params.dtype: 'int8' is not one of"),
    (lambda p: p.update(tp=True), "compile params.tp: expected int, got bool True"),
    (lambda p: p.update(fused_qkv=1), "compile params.fused_qkv: expected bool, got int 1"),
    (lambda p: p.update(moe_backend="fast"), "compile params.moe_backend: 'fast' is not one of"),
    (lambda p: p["text"].pop("num_experts"), "compile params.text.num_experts: missing"),
    (lambda p: p["text"].update(pad_token_id=0), "compile params.text.pad_token_id: unknown field"),
    (lambda p: p["text"].update(vision=None), "compile params.text.vision: unknown field"),
])
def test_a_field_that_does_not_fit_is_refused_by_name(tmp_path, tiny_checkpoints, edit, message):
    params = _cpu_text(tmp_path, tiny_checkpoints)
    edit(params)
    with pytest.raises(ParamsError) as err:
        parse_compile(params)
    assert str(err.value).startswith(message)


def test_nested_and_list_fields_are_checked(tmp_path, tiny_checkpoints):
    kinds = _recipes(tmp_path, tiny_checkpoints)["neuron-next"]
    text = next(p for p in kinds["compile"] if p["graph"] == "text")
    for edit, message in [
        (lambda p: p["parallel"].pop("world_size"), "compile params.parallel.world_size: missing"),
        (lambda p: p["compiler"].update(target="trn3"), "compile params.compiler.target: 'trn3' is not one of"),
        (lambda p: p.update(cte_buckets=[128, "256"]), "compile params.cte_buckets[1]: expected int, got str"),
        (lambda p: p.update(tkg_buckets=1024), "compile params.tkg_buckets: expected a list, got int"),
        (lambda p: p.update(toolchain={"neuronx-cc": 2}), "compile params.toolchain.neuronx-cc: expected str"),
    ]:
        params = copy.deepcopy(text)
        edit(params)
        with pytest.raises(ParamsError, match="^" + message.replace("[", r"\[").replace("]", r"\]")):
            parse_compile(params)
    package = copy.deepcopy(kinds["package"][0])
    package.pop("fp8")
    with pytest.raises(ParamsError, match="^package params.fp8: missing"):
        parse_package(package)
    with pytest.raises(ParamsError, match="^verify params: expected an object, got list"):
        parse_verify([0.9, 1.0, 1e-3])
