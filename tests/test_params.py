"""Typed step params: each step has one definition, the planner builds its typed objects, their JSON (the key's
"params") parses back to the same object, and a missing, unknown or mistyped field is refused naming it."""

from __future__ import annotations

import copy
import textwrap
from pathlib import Path

import pytest

from qbuild.steps.registry import STEPS
from qbuild import backends
from qbuild.model.arch import Arch, VisionArch
from qbuild.hub.source import load_arch
from qbuild.planning.environment import HostEnvironment
from qbuild.core.hashing import StatCache, canonical_json
from qbuild.backends.cpu.params import CpuCompile, CpuTextCompile, CpuVisionCompile
from qbuild.backends.neuron.params import (NeuronCompile, NeuronPackageParams, NeuronTextCompile, NeuronVisionCompile,
                                           PortFiles, PortMissing, PortParams)
from qbuild.model.ranks import RankLayout
from qbuild.recipe.params import (ConvertParams, FetchHub, FetchParams, FetchPath, PackageParams, ParamsError,
                                  ReferenceParams, ShardParams, VerifyParams, parse, to_json)
from qbuild.planning.plan import plan_recipe
from qbuild.recipe.schema import load_recipe

# The one type of each step's params (a union where a step has several forms).
TYPES = {"fetch": FetchParams, "port": PortParams, "convert": ConvertParams, "shard": ShardParams,
         "compile": CpuCompile | NeuronCompile, "package": PackageParams | NeuronPackageParams,
         "reference": ReferenceParams, "verify": VerifyParams}
PINS = """toolchain: {neuronx_cc: 2.26.6360.0, neuronx_distributed: 0.19.28492,
            neuronx_distributed_inference: 0.10.18399, torch_neuronx: 2.9.0.2}
"""


def _planned(tmp_path: Path, name: str, body: str, extra: str = "") -> dict:
    """{node kind: [params of each node of that kind]} of one recipe, as the planner builds them."""
    f = tmp_path / f"{name}.yaml"
    f.write_text(textwrap.dedent(body) + extra)
    loaded = load_recipe(f)
    nodes = {}
    plan_recipe(nodes, loaded, load_arch(loaded), HostEnvironment(StatCache(tmp_path / "stat.db")), backends=backends,
                steps=STEPS)
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


def test_the_planner_builds_typed_params_that_round_trip_through_their_json(tmp_path, tiny_checkpoints):
    """Every node's params are a frozen dataclass of its step's one definition, and parsing their canonical JSON (what
    the key is computed over) gives the same object back, byte for byte."""
    seen = set()
    for name, kinds in _recipes(tmp_path, tiny_checkpoints).items():
        assert set(kinds) == set(TYPES) - ({"port"} if name.startswith("cpu") else set()), name
        for kind, params in ((k, p) for k, ps in kinds.items() for p in ps):
            assert not isinstance(params, dict), (name, kind)
            as_json = to_json(params)
            back = parse(TYPES[kind], as_json, f"{kind} params")
            assert back == params and type(back) is type(params), (name, kind)
            assert canonical_json(to_json(back)) == canonical_json(as_json), (name, kind)
            seen.add(type(params))
    assert seen == {FetchHub, FetchPath, PortMissing, ConvertParams, ShardParams, CpuTextCompile, CpuVisionCompile,
                    NeuronTextCompile, NeuronVisionCompile, PackageParams, NeuronPackageParams, ReferenceParams,
                    VerifyParams}


def test_a_port_that_is_not_found_is_planned_and_refused_when_built(tmp_path):
    from qbuild.core.errors import UserError

    missing = parse(PortParams, {"missing": "./port"})
    assert missing == PortMissing("./port") and to_json(missing) == {"missing": "./port"}
    with pytest.raises(UserError, match="^port: ./port is not a directory here"):
        missing.planned_files()
    assert PortFiles({"a.py": "blake3:1"}).planned_files() == {"a.py": "blake3:1"}


def test_planned_fields_are_typed(tmp_path, tiny_checkpoints):
    kinds = _recipes(tmp_path, tiny_checkpoints)["neuron-vl-fp8"]
    text = next(p for p in kinds["compile"] if p.graph == "text")
    vision = next(p for p in kinds["compile"] if p.graph == "vision")
    assert isinstance(text.text, Arch) and text.text.is_moe and text.text.vision is None
    assert isinstance(vision.vision, VisionArch)
    assert text.cte_buckets == (128, 512) and text.parallel.world == 8 and text.compiler.lnc == 2
    assert text.port_env == {"QWEN36_FLAG": "1"} and text.fp8 == "mlp_only"
    package = kinds["package"][0]
    assert isinstance(package, NeuronPackageParams) and package.lineage == "main" and package.vision_buckets == (1024,)
    assert package.bundle_meta()["ranks"] == 8 and "ranks" not in PackageParams.bundle_meta(package)
    shard = kinds["shard"][0]
    assert shard.layout == "nxd-main" and shard.ranks == RankLayout.split(8) and shard.dtype == "bfloat16"
    cpu_shard = _recipes(tmp_path, tiny_checkpoints)["cpu-moe"]["shard"][0]
    assert cpu_shard == ShardParams("cpu", RankLayout(world=2, dense_tp=2, moe_tp=1, moe_ep=2), False, "bfloat16")


def _cpu_text(tmp_path, tiny_checkpoints) -> dict:
    kinds = _recipes(tmp_path, tiny_checkpoints)["cpu-moe"]
    return to_json(next(p for p in kinds["compile"] if p.graph == "cte"))


def parse_compile(params: dict):
    return parse(CpuCompile | NeuronCompile, params, "compile params")


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
    text = to_json(next(p for p in kinds["compile"] if p.graph == "text"))
    for edit, message in [
        (lambda p: p["parallel"].pop("world"), "compile params.parallel.world: missing"),
        (lambda p: p["parallel"].update(moe_ep=3),
         "compile params.parallel: 32 ranks, dense_tp 8, experts moe_tp 8 x moe_ep 3"),
        (lambda p: p["compiler"].update(target="trn3"), "compile params.compiler.target: 'trn3' is not one of"),
        (lambda p: p.update(cte_buckets=[128, "256"]), "compile params.cte_buckets[1]: expected int, got str"),
        (lambda p: p.update(tkg_buckets=1024), "compile params.tkg_buckets: expected a list, got int"),
        (lambda p: p.update(toolchain={"neuronx-cc": 2}), "compile params.toolchain.neuronx-cc: expected str"),
    ]:
        params = copy.deepcopy(text)
        edit(params)
        with pytest.raises(ParamsError, match="^" + message.replace("[", r"\[").replace("]", r"\]")):
            parse_compile(params)
    package = to_json(kinds["package"][0])
    package.pop("fp8")
    with pytest.raises(ParamsError, match="^package params.fp8: missing"):
        parse(PackageParams | NeuronPackageParams, package, "package params")
    with pytest.raises(ParamsError, match="^verify params: expected an object, got list"):
        parse(VerifyParams, [0.9, 1.0, 1e-3], "verify params")
