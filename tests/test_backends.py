"""Backends: the architecture round-trips through compile params, exported graphs hold no weights, and the
neuron backend fails with one line where the Neuron SDK is absent."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from qbuild.planning.step import Context
from qbuild.steps.compile import Compile
from qbuild.model.arch import arch_from_config
from qbuild.core.errors import BuildError
from qbuild.backends.cpu.backend import compile_params
from qbuild.backends.cpu.params import CpuCompile, CpuTextCompile
from qbuild.recipe.params import parse, to_json
from qbuild.recipe.schema import load_recipe
from qbuild.hub.source import load_arch


def _params(tmp_path: Path, checkpoint: Path, graph: str, bucket: int, backend: str = "export", tp: int = 1,
            ep: int = 1, vision: bool = False) -> CpuCompile:
    f = tmp_path / f"r-{graph}-{bucket}-{backend}.yaml"
    f.write_text(textwrap.dedent(f"""
        model: {{path: {checkpoint}}}
        backend: {backend}
        dtype: float32
        parallel: {{tp: {tp}, ep: {ep}}}
        text: {{seq_len: 64, cte_buckets: [16], tkg_buckets: [64]}}
    """) + ("vision: {buckets: [64]}\n" if vision else ""))
    loaded = load_recipe(f)
    params = compile_params(loaded, load_arch(loaded), graph, bucket)
    assert parse(CpuCompile, to_json(params)) == params   # what the planner built is what its JSON reads back as
    return params


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_architecture_round_trips_through_compile_params(tmp_path, tiny_checkpoints, family):
    """The graph is built from the allow-listed fingerprint alone: it must describe the same model as config.json."""
    original = json.loads((tiny_checkpoints[family] / "config.json").read_text())
    params = _params(tmp_path, tiny_checkpoints[family], "cte", 16)
    real = arch_from_config(original).fingerprint()
    real["vision"] = None  # a text graph's params leave the vision encoder out
    assert params.text.fingerprint() == real
    if family != "qwen3_next":
        vparams = _params(tmp_path, tiny_checkpoints[family], "vision", 64, vision=True)
        assert vparams.vision == arch_from_config(original).vision


def test_exported_graph_takes_weights_as_inputs(tmp_path, tiny_checkpoints):
    import torch

    from qbuild.backends.cpu.export import export_graph

    params = _params(tmp_path, tiny_checkpoints["qwen3_5_moe"], "tkg", 64, tp=2, ep=2)
    traced = export_graph(params)
    program = traced.program
    assert len(program.state_dict) == 0  # no parameter or buffer is stored in the program
    constant_bytes = sum(t.numel() * t.element_size() for t in program.constants.values()
                         if isinstance(t, torch.Tensor))
    weight_bytes = sum(torch.Size(s).numel() * 4 for s, _ in traced.signature["weights"].values())
    assert constant_bytes < weight_bytes / 100  # only rotary tables / expert ids, never weights
    names = [spec.arg.name for spec in program.graph_signature.input_specs]
    assert any("embed_tokens" in n for n in names) and any("expert_mlps" in n for n in names)
    # No node carries the stack trace of its source (absolute paths of this checkout), and the tracer's setting that
    # keeps them from being recorded is back as it was.
    import torch.fx.config

    assert not [n.name for n in program.graph.nodes if "stack_trace" in n.meta]
    assert torch.fx.config.do_not_emit_stack_traces is False


def test_neuron_backend_without_sdk_fails_in_one_line(tmp_path, tiny_checkpoints):
    from qbuild.backends.neuron.backend import text_compile_params
    from qbuild.store.spec import StoreSpec

    f = tmp_path / "next.yaml"
    f.write_text(f"model: {{path: {tiny_checkpoints['qwen3_next']}}}\nbackend: neuron\nport: {{path: ./port}}\n"
                 "toolchain: {sdk: \"2.30.0\"}\n"
                 "text: {seq_len: 64, cte_buckets: [16]}\n")
    loaded = load_recipe(f)
    params = text_compile_params(loaded, load_arch(loaded))
    (tmp_path / "port").mkdir()
    ctx = Context(params, {"port": tmp_path / "port"}, tmp_path / "out", tmp_path / "scratch", log=lambda s: None,
                  store=StoreSpec(local=str(tmp_path / "store")))
    ctx.out.mkdir()
    ctx.scratch.mkdir()
    with pytest.raises(BuildError) as err:
        Compile.run(ctx)
    msg = str(err.value)
    assert "\n" not in msg and "neuronx-distributed-inference" in msg
    assert not any(ctx.out.iterdir())


def test_bundle_runs_take_turns_on_the_neuron_cores_unless_ray_assigned_them(monkeypatch, tmp_path):
    """A Neuron runtime process takes every core of the host unless NEURON_RT_VISIBLE_CORES names some: a second run
    waits for the first instead of failing at start, and a run whose cores were assigned does not wait."""
    import threading

    from filelock import FileLock

    from qbuild.backends.neuron.deploy import neuron_cores
    from qbuild.core.userdir import runtime_dir

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES", raising=False)
    held = FileLock(f"{runtime_dir()}/neuron-cores.lock")
    held.acquire()
    waiting, ran = threading.Event(), threading.Event()

    def second_run():
        with neuron_cores(lambda line: waiting.set()):
            ran.set()

    thread = threading.Thread(target=second_run)
    thread.start()
    assert waiting.wait(30), "the second run neither waited nor said so"
    assert not ran.is_set()
    held.release()
    thread.join(30)
    assert ran.is_set()

    held.acquire()
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-1")
    with neuron_cores(lambda line: pytest.fail(f"waited with assigned cores: {line}")):
        pass
    held.release()


def test_the_registry_names_every_backend_and_imports_it_on_first_use():
    from qbuild import backends

    assert {backends.get(name).name for name in backends.NAMES} == set(backends.NAMES)
    with pytest.raises(ValueError, match="'tpu' is not one of neuron, inductor, export"):
        backends.get("tpu")


def test_a_backend_registered_through_using_replaces_it_only_within_the_block():
    from qbuild import backends

    real = backends.get("export")

    class Double:
        name = "export"

    with backends.using(Double()) as double:
        assert backends.get("export") is double
    assert backends.get("export") is real


# Inductor's compile (minutes of C++) is proven by tests/test_e2e_inductor.py, whose bundle loads its aoti-package.
@pytest.mark.parametrize("backend", ["export"])
def test_a_cpu_compile_given_typed_params_writes_its_graph_and_signature(tmp_path, tiny_checkpoints, backend):
    """The compile step receives the typed params the planner built and asks their backend to compile them."""
    params = _params(tmp_path, tiny_checkpoints["qwen3_5"], "tkg", 64, backend=backend)
    assert isinstance(params, CpuTextCompile)
    ctx = Context(params, {}, tmp_path / "out", tmp_path / "scratch", log=lambda s: None)
    ctx.out.mkdir()
    ctx.scratch.mkdir()
    Compile.run(ctx)
    signature = json.loads((ctx.out / "tkg-64.json").read_text())
    assert (ctx.out / "tkg-64.pt2").is_file() and signature["backend"] == backend
    assert signature["format"] == {"export": "exported-program", "inductor": "aoti-package"}[backend]
