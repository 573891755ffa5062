"""A neuron recipe names a Neuron SDK release, or four versions of one release: what a standard host can have. The
release table is docs/neuron-sdk.md's (the SDK's package manifest); these tests check the recipes and the refusals
against it."""

from __future__ import annotations

import pytest
import yaml

from qbuild.backends.neuron.releases import RELEASES, ToolchainError, resolve
from tests.conftest import REPO, qbuild
from tests.nxdi_double import MAIN_PORT

SHIPPED = sorted((REPO / "recipes").glob("*.yaml"))


def _plan_toolchain(recipe) -> dict:
    import json

    proc = qbuild("plan", str(recipe), "--json", check=True)
    compiles = [n for n in json.loads(proc.stdout)["nodes"] if n["kind"] == "compile"]
    assert compiles
    pins = {json.dumps(n["params"]["toolchain"], sort_keys=True) for n in compiles}
    assert len(pins) == 1, "every compile of a recipe runs one toolchain"
    return json.loads(pins.pop())


def test_coder_next_builds_with_the_sdk_its_port_was_validated_on():
    # Its README names neuronx-cc 2.25.3371 and NxDI 0.10.17970: SDK 2.30.0, with that release's NxD and torch-neuronx.
    assert _plan_toolchain(REPO / "recipes" / "coder-next-tp8.yaml") == {
        "neuronx-cc": "2.25.3371.0", "neuronx-distributed": "0.19.28093",
        "neuronx-distributed-inference": "0.10.17970", "torch-neuronx": "2.9.0.2.14.27725"}


@pytest.mark.parametrize("recipe", [r for r in SHIPPED if "36-27b" not in r.name], ids=lambda p: p.name)
def test_every_shipped_recipe_pins_one_release_exactly(recipe):
    toolchain = _plan_toolchain(recipe)
    assert toolchain in RELEASES.values()


def test_a_component_from_a_source_tree_is_pinned_as_the_tree_reports_it():
    # The 128K recipe: SDK 2.29.0, the release its port was validated on, with NxDI from PR 173's tree (0.9.0).
    toolchain = _plan_toolchain(REPO / "recipes" / "36-27b-fp8-128k.yaml")
    assert toolchain == {**RELEASES["2.29.0"], "neuronx-distributed-inference": "0.9.0"}


def test_a_mixed_set_is_refused_naming_the_release_of_each_version():
    pins = {"neuronx-cc": "2.25.3371.0", "neuronx-distributed": "0.19.28492",
            "neuronx-distributed-inference": "0.10.18399", "torch-neuronx": "2.9.0.2.15.32035"}
    with pytest.raises(ToolchainError) as e:
        resolve(None, pins)
    assert "neuronx_cc 2.25.3371.0 (SDK 2.30.0)" in str(e.value)
    assert "neuronx_distributed 0.19.28492 (SDK 2.31.0, 2.31.1)" in str(e.value)
    assert resolve(None, {**pins, "neuronx-cc": "2.26.6360.0"}) == {**pins, "neuronx-cc": "2.26.6360.0"}
    # Versions written short resolve to the release's exact ones: one key for one toolchain.
    short = {**pins, "neuronx-cc": "2.26.6360", "torch-neuronx": "2.9.0.2.15"}
    assert resolve(None, short) == RELEASES["2.31.0"]


def test_a_pin_beside_a_release_must_be_that_release_s():
    with pytest.raises(ToolchainError, match=r"2.25.3371 is not SDK 2.31.0's \(2.26.6360.0\); it ships with SDK "
                                             r"2.30.0") as e:
        resolve("2.31.0", {"neuronx-cc": "2.25.3371"})
    assert e.value.field == "neuronx_cc"
    assert resolve("2.31.0", {"neuronx-cc": "2.26.6360"})["neuronx-cc"] == "2.26.6360.0"
    with pytest.raises(ToolchainError, match="no SDK release ships it"):
        resolve("2.31.0", {"neuronx-distributed-inference": "0.9.0"})
    with pytest.raises(ToolchainError, match="'2.99.0' is not a Neuron SDK release"):
        resolve("2.99.0", {})


def _recipe(tmp_path, toolchain: dict):
    base = yaml.safe_load((REPO / "recipes" / "2b-tp8.yaml").read_text())
    base["extends"] = str(REPO / "recipes" / "bases" / "trn2.yaml")
    base["port"] = {"lineage": "main", "path": str(MAIN_PORT)}
    base["toolchain"] = toolchain
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(base, sort_keys=False))
    return path


def test_validate_refuses_a_mixed_toolchain_in_one_line_naming_the_field(tmp_path):
    recipe = _recipe(tmp_path, {"sdk": "2.31.0", "neuronx_cc": "2.25.3371.0"})
    proc = qbuild("recipe", "validate", str(recipe))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "toolchain.neuronx_cc" in lines[0] and "SDK 2.30.0" in lines[0], proc.stderr
    assert str(recipe) in lines[0]


@pytest.mark.parametrize("flags,needle", [(["--auto-cast", "matmult", "--auto-cast=none"], "--auto-cast given more "
                                                                                          "than once"),
                                          (["--target=trn1"], "--target is set by compiler.target")])
def test_validate_refuses_compiler_flags_that_would_give_an_option_twice(tmp_path, flags, needle):
    recipe = _recipe(tmp_path, {"sdk": "2.31.0"})
    doc = yaml.safe_load(recipe.read_text())
    doc["compiler"] = {"flags": flags}
    recipe.write_text(yaml.safe_dump(doc, sort_keys=False))
    proc = qbuild("recipe", "validate", str(recipe))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "compiler.flags" in lines[0] and needle in lines[0], \
        proc.stderr


# n2-manifest.json @ a3247f5b8c30: the torch-neuronx builds 2.27.x and 2.28.x list (for torch 2.7, 2.8 and 2.9).
TORCH_NEURONX_BUILDS = {"2.27.0": ("2.7.0.2.11.19912", "2.8.0.2.11.19912", "2.9.0.2.11.19912"),
                        "2.28.0": ("2.7.0.2.12.22436", "2.8.0.2.12.22436", "2.9.0.2.12.22436")}


@pytest.mark.parametrize("sdk", sorted(TORCH_NEURONX_BUILDS))
def test_every_torch_neuronx_build_of_a_release_can_be_pinned(sdk):
    from qbuild.backends.neuron.releases import builds

    assert sorted(builds(sdk, "torch-neuronx")) == sorted(TORCH_NEURONX_BUILDS[sdk])
    assert resolve(sdk, {})["torch-neuronx"] == RELEASES[sdk]["torch-neuronx"]       # a release alone: its default
    for build in TORCH_NEURONX_BUILDS[sdk]:
        assert resolve(sdk, {"torch-neuronx": build})["torch-neuronx"] == build
        four = {**RELEASES[sdk], "torch-neuronx": build}
        assert resolve(None, four) == four
    # Each build still belongs to its release only: with the other release's NxD the set is refused.
    other = "2.28.0" if sdk == "2.27.0" else "2.27.0"
    with pytest.raises(ToolchainError, match=r"torch_neuronx 2\.9\.0\.\S+ \(SDK " + sdk.replace(".", r"\.")):
        resolve(None, {**RELEASES[other], "torch-neuronx": TORCH_NEURONX_BUILDS[sdk][2]})


def test_each_release_names_the_vllm_stack_that_serves_nxdi_on_it():
    from qbuild.backends.neuron.releases import GLUE_STACK, SERVING, serving_stack, stack_matches

    assert list(SERVING) == list(RELEASES)
    # Each release's own docs: 2.27 plugin 0.2.2 / vLLM 0.11.0, 2.28 plugin 0.4.x / vLLM 0.13.0, 2.29.0-2.31.0 plugin
    # 0.5.0 / vLLM 0.16.0, 2.31.1 plugin 0.5.3 (docs/vllm.md section 1).
    assert {sdk: (s.vllm, s.vllm_neuron) for sdk, s in SERVING.items()} == {
        "2.27.0": ("0.11.0", "0.2.2"), "2.27.1": ("0.11.0", "0.2.2"), "2.28.0": ("0.13.0", "0.4"),
        "2.28.1": ("0.13.0", "0.4"), **{sdk: ("0.16.0", "0.5.0") for sdk in ("2.29.0", "2.29.1", "2.30.0", "2.31.0")},
        "2.31.1": ("0.16.0", "0.5.3")}
    assert (GLUE_STACK.vllm, GLUE_STACK.vllm_neuron) == ("0.16.0", "0.5.0")
    assert serving_stack(_plan_toolchain(REPO / "recipes" / "coder-next-tp8.yaml")) == (["2.30.0"], SERVING["2.30.0"])
    # NxDI from PR 173's tree (0.9.0) names no release; the other three are 2.29.0's alone.
    assert serving_stack(_plan_toolchain(REPO / "recipes" / "36-27b-fp8-128k.yaml")) == (["2.29.0"],
                                                                                        SERVING["2.29.0"])
    # 2.31.0 and 2.31.1 ship the same four versions and serve with different plugins: the release the recipe names,
    # else the oldest (as resolve spells the versions).
    assert serving_stack(RELEASES["2.31.0"], "2.31.1") == (["2.31.1"], SERVING["2.31.1"])
    assert serving_stack(RELEASES["2.31.0"]) == (["2.31.0"], SERVING["2.31.0"])
    assert stack_matches("0.5.3", "0.5") and stack_matches("0.16.0+neuron", "0.16.0")
    assert not stack_matches("0.21.0.1.0.0", "0.5") and not stack_matches("0.16.1", "0.16.0")
    assert not stack_matches("0.50.0", "0.5")


def test_a_release_without_nxdi_is_refused_naming_why():
    """2.32.0's manifest lists neuronx-cc and the NxDI-free vllm-neuron 0.24.0.1.1.0 only (n2-manifest.json L107-133
    @ a3247f5): there is no NxDI to build with."""
    with pytest.raises(ToolchainError, match="2.32.0.*NxDI-free vllm-neuron 0.24.0.1.1.0 only") as e:
        resolve("2.32.0", {})
    assert e.value.field == "sdk"
