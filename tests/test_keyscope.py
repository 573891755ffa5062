"""Which step kinds an edit of each qbuild module re-keys (bench/keyscope.py), held to the rules the keys follow:
a key holds the code its step runs and nothing else. Each rule is a row: the modules it covers, and what an edit
of one of them may re-key (and, where the rule says so, must).

The table is computed on a copy of the package, for every (step kind, code) pair the tiny and shipped recipes plan,
as bench/keyscope.py prints it."""

from __future__ import annotations

import pytest

from bench.keyscope import default_recipes, planned_pairs, table
from qbuild.model.families import FAMILIES
from qbuild.planning.closures import MACHINERY



@pytest.fixture(scope="module")
def scope(tmp_path_factory, tiny_checkpoints):
    """The tiny recipes planned over the suite's own tiny checkpoints (a fresh clone has no .qbuild/tiny)."""
    recipes = default_recipes(tmp_path_factory.mktemp("keyscope"), tiny_checkpoints)
    pairs = planned_pairs(recipes)
    return set(pairs), table(pairs)


def kind(label: str) -> str:
    return label.split()[0]


def family(label: str) -> str | None:
    words = label.split()
    return words[-1] if words[-1] in FAMILIES else None


# The CPU bundle's readers of converted weights: the reference model (and its exported graphs) and what verifies it.
CPU_READERS = {"compile export", "package export", "verify export", "reference"}
# Modules no build step runs: serving a bundle, and the runtime's benchmark.
SERVING = ("qbuild.backends.openai_server", "qbuild.backends.cpu.serving", "qbuild.backends.neuron.serving",
           "qbuild.backends.neuron.server_process", "qbuild.backends.neuron.vl_serve",
           "qbuild.backends.neuron.vl_runtime", "qbuild.backends.neuron.vllm_serve",
           "qbuild.backends.neuron.vllm_images", "qbuild.model.runtime.bench", "qbuild.model.tinymodel")


def _under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") or module.startswith(p + "_") for p in prefixes)


def test_the_table_covers_every_module_and_every_step_kind(scope):
    labels, table = scope
    assert {kind(label) for label in labels} >= {"fetch", "convert", "shard", "compile", "package", "reference",
                                                 "verify", "port"}
    assert "qbuild.store.local" in table and "qbuild.model.convert.moe" in table
    # every label is re-keyed by something (its own step module at least)
    assert set().union(*table.values()) == labels


def test_machinery_re_keys_nothing(scope):
    """store/, execution/, the CLI, render, report and core/progress decide nothing of what a step writes."""
    _, table = scope
    for module, rekeyed in table.items():
        if _under(module, MACHINERY):
            assert rekeyed == [], f"{module} re-keys {rekeyed}"


def test_serving_re_keys_nothing(scope):
    _, table = scope
    for module, rekeyed in table.items():
        if _under(module, SERVING):
            assert rekeyed == [], f"{module} re-keys {rekeyed}"


def test_the_hub_re_keys_fetch_only(scope):
    _, table = scope
    hub = {module: rekeyed for module, rekeyed in table.items() if _under(module, ("qbuild.hub",))}
    for module, rekeyed in hub.items():
        assert set(rekeyed) <= {"fetch"}, f"{module} re-keys {rekeyed}"
    for module in ("qbuild.hub.hf", "qbuild.hub.snapshot"):      # what the fetch step runs
        assert hub[module] == ["fetch"]


def test_fetch_holds_no_conversion_rule(scope):
    _, table = scope
    for module, rekeyed in table.items():
        if _under(module, ("qbuild.model.convert",)) and module not in (
                "qbuild.model.convert", "qbuild.model.convert.checkpoint", "qbuild.model.convert.errors",
                "qbuild.model.convert.safetensors_header"):      # what checks a download's files
            assert "fetch" not in rekeyed, f"{module} re-keys fetch"


@pytest.mark.parametrize("rules", sorted({r for f in FAMILIES.values() for r in f.rules}))
def test_a_conversion_rule_re_keys_the_convert_and_shard_of_the_families_that_run_it(scope, rules):
    """A family's conversion rule module re-keys the convert and shard steps of exactly the families that list it
    (Family.rules), and otherwise at most what reads the CPU layout's weights back."""
    labels, table = scope
    module = f"qbuild.model.convert.{rules}"
    rekeyed = set(table[module])
    runs = {name for name, f in FAMILIES.items() if rules in f.rules}
    conversion = {label for label in labels if kind(label) in ("convert", "shard")}
    assert rekeyed & conversion == {label for label in conversion if family(label) in runs}
    assert rekeyed - conversion <= CPU_READERS


def test_each_step_module_re_keys_its_own_kind(scope):
    labels, table = scope
    for module, rekeyed in table.items():
        if not module.startswith("qbuild.steps.") or module == "qbuild.steps.registry":
            continue
        own = module.rpartition(".")[2]
        assert {kind(label) for label in rekeyed} == {own}, f"{module} re-keys {rekeyed}"
        assert set(rekeyed) == {label for label in labels if kind(label) == own}
    assert table["qbuild.steps.registry"] == []


def test_a_backend_re_keys_the_steps_that_run_it(scope):
    """A backend's modules re-key only the nodes of that backend (and its shard layouts); the CPU layout's rules and
    the reference model re-key no neuron node."""
    labels, table = scope
    neuron = {label for label in labels if "neuron" in label.split() or label.split()[1:2] in (["nxd-main"],
              ["nxd-main-replicated"], ["nxd-moe"])}
    cpu = {label for label in labels if set(label.split()) & {"export", "inductor"}}
    for module, rekeyed in table.items():
        if _under(module, ("qbuild.backends.neuron",)):
            assert set(rekeyed) <= neuron, f"{module} re-keys {sorted(set(rekeyed) - neuron)}"
        elif _under(module, ("qbuild.backends.cpu",)):
            assert set(rekeyed) <= cpu, f"{module} re-keys {sorted(set(rekeyed) - cpu)}"
        elif _under(module, ("qbuild.model.modeling", "qbuild.model.kernels", "qbuild.model.runtime")):
            assert set(rekeyed) <= CPU_READERS, f"{module} re-keys {sorted(set(rekeyed) - CPU_READERS)}"
    assert set(table["qbuild.backends.neuron.layout.nxd"]) == {
        label for label in labels if kind(label) == "shard" and label.split()[1].startswith("nxd-")}
    assert table["qbuild.backends.neuron.backend"] and table["qbuild.backends.cpu.backend"]


def test_a_port_is_keyed_by_its_params_not_by_the_backend(scope):
    _, table = scope
    assert "port neuron" not in table["qbuild.backends.neuron.backend"]
    assert "port neuron" in table["qbuild.backends.neuron.params"]
    assert "port neuron" in table["qbuild.steps.port"]


def test_the_neuron_sdk_worker_is_in_the_key_of_what_runs_it(scope):
    """The compile runs it in a fresh interpreter: an edit of it changes what a neuron compile writes."""
    _, table = scope
    assert {"compile neuron", "verify neuron"} <= set(table["qbuild.backends.neuron.sdk_worker"])
