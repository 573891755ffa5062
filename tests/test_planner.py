"""The planner, in-process over a fake environment: what it reads of the machine comes only from the environment."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import qbuild
from qbuild.planning.step import Source
from qbuild.steps.registry import STEPS
from qbuild import backends
from qbuild.model.arch import Arch, arch_from_config
from qbuild.core.errors import InfraError, RecipeError, UserError
from qbuild.planning.keys import walk
from qbuild.planning.plan import build_plan, evaluate, require_resolved
from qbuild.recipe.schema import LoadedRecipe, load_recipe
from qbuild.recipe.params import FetchHub, FetchPath, to_json
from qbuild.planning.plan import HubPin

CONFIG = Path(qbuild.__file__).parent / "configs" / "Qwen--Qwen3.5-2B.json"
COMMIT = "a" * 40
OTHER = "b" * 40
CPU = """\
model: {model}
parallel: {{tp: {tp}}}
text: {{seq_len: 128, cte_buckets: [32, 64]}}
dtype: float32
backend: export
"""
NEURON = """\
model: {hf: Qwen/Qwen3.5-2B}
backend: neuron
dtype: bfloat16
port: {lineage: main, path: port}
parallel: {tp: 2}
text: {seq_len: 128, cte_buckets: [128]}
toolchain: {neuronx_cc: 2.26.6360.0, neuronx_distributed: 0.19.28492, neuronx_distributed_inference: 0.10.18399,
             torch_neuronx: 2.9.0.2}
"""


@dataclass
class FakeEnvironment:
    """A machine described by data: every model has the 2B architecture."""

    checkpoints: dict[Path, dict[str, str]] = field(default_factory=dict)
    hub: dict[tuple[str, str], str | Exception] = field(default_factory=dict)   # what the Hub resolves
    ports: dict[Path, dict[str, str]] = field(default_factory=dict)
    arch_of: Arch = field(default_factory=lambda: arch_from_config(json.loads(CONFIG.read_text()), str(CONFIG)))
    asked: list[tuple[str, str]] = field(default_factory=list)                  # every question to the Hub

    def arch(self, loaded: LoadedRecipe, commit: str | None = None) -> Arch:
        return self.arch_of

    def checkpoint_digests(self, directory: Path) -> dict[str, str]:
        return dict(self.checkpoints[directory])

    def hf_commit(self, repo: str, revision: str) -> str:
        self.asked.append((repo, revision))
        found = self.hub.get((repo, revision), InfraError("offline"))
        if isinstance(found, Exception):
            raise found
        return found

    def port_digests(self, port_dir: Path) -> dict[str, str] | None:
        return self.ports.get(port_dir)


def _recipe(root: Path, name: str, body: str) -> LoadedRecipe:
    path = root / f"{name}.yaml"
    path.write_text(body)
    return load_recipe(path)


def _cpu(root: Path, name: str, tp: int = 1, model: str = "{path: ck}") -> LoadedRecipe:
    return _recipe(root, name, CPU.format(model=model, tp=tp))


def _roles(plan, recipe: str) -> dict[str, str]:
    return plan.recipes[recipe].nodes


def test_tp_variants_share_fetch_convert_and_reference(tmp_path):
    env = FakeEnvironment(checkpoints={tmp_path / "ck": {"config.json": "blake3:1"}})
    plan = build_plan([_cpu(tmp_path, "one"), _cpu(tmp_path, "two", tp=2)], env, backends=backends, steps=STEPS)
    one, two = _roles(plan, "one"), _roles(plan, "two")
    for role in ("fetch", "convert", "reference"):
        assert one[role] == two[role], role
        assert plan.nodes[one[role]].recipes == ["one", "two"]
    for role in ("shard", "compile cte-32", "package", "verify"):
        assert one[role] != two[role], role
    assert set(one) == {"fetch", "convert", "shard", "compile cte-32", "compile cte-64", "compile tkg-128",
                        "package", "reference", "verify"}


def test_a_local_checkpoint_is_its_files_digests(tmp_path):
    """The checkpoint directory need not exist: its files are what the environment says they are."""
    ck = tmp_path / "ck"
    env = FakeEnvironment(checkpoints={ck: {"config.json": "blake3:1", "model.safetensors": "blake3:2"}})
    first = build_plan([_cpu(tmp_path, "w")], env, backends=backends, steps=STEPS)
    fetch = first.nodes[_roles(first, "w")["fetch"]]
    assert fetch.params == FetchPath("path", {"config.json": "blake3:1", "model.safetensors": "blake3:2"})
    assert to_json(fetch.params) == {"source": "path",
                                     "files": {"config.json": "blake3:1", "model.safetensors": "blake3:2"}}
    assert fetch.source == Source(path=str(ck))
    env.checkpoints[ck]["model.safetensors"] = "blake3:3"      # new weights
    second = build_plan([_cpu(tmp_path, "w")], env, backends=backends, steps=STEPS)
    a, b = _roles(first, "w"), _roles(second, "w")
    assert a["fetch"] != b["fetch"] and a["convert"] != b["convert"]
    # A compile depends on the architecture, never on weight values.
    for role in ("compile cte-32", "compile cte-64", "compile tkg-128"):
        assert a[role] == b[role], role


def test_a_hub_model_is_keyed_on_the_commit_the_hub_resolves(tmp_path):
    loaded = _cpu(tmp_path, "hub", model="{hf: Qwen/Qwen3.5-2B}")
    env = FakeEnvironment(hub={("Qwen/Qwen3.5-2B", "main"): COMMIT})
    plan = build_plan([loaded], env, backends=backends, steps=STEPS)
    fetch = plan.nodes[_roles(plan, "hub")["fetch"]]
    assert to_json(fetch.params) == {"source": "hf", "repo": "Qwen/Qwen3.5-2B", "revision": COMMIT}
    assert fetch.params == FetchHub("hf", "Qwen/Qwen3.5-2B", COMMIT) and fetch.unresolved is None
    assert fetch.source == Source(requested_revision="main")
    assert env.asked == [("Qwen/Qwen3.5-2B", "main")]


def test_a_pin_or_a_commit_in_the_recipe_is_used_without_asking_the_hub(tmp_path):
    loaded = _cpu(tmp_path, "hub", model="{hf: Qwen/Qwen3.5-2B}")
    env = FakeEnvironment(hub={("Qwen/Qwen3.5-2B", "main"): COMMIT})
    pinned = build_plan([loaded], env, {"hub": HubPin("Qwen/Qwen3.5-2B", "main", OTHER)}, backends=backends, steps=STEPS)
    assert pinned.nodes[_roles(pinned, "hub")["fetch"]].params.revision == OTHER and env.asked == []
    by_commit = build_plan([_cpu(tmp_path, "sha", model="{hf: Qwen/Qwen3.5-2B, revision: %s}" % OTHER)], env,
                           backends=backends, steps=STEPS)
    assert by_commit.nodes[_roles(by_commit, "sha")["fetch"]].params.revision == OTHER and env.asked == []
    # A build on another backend is its recipe's build of the same model: it shares the recipe's pin.
    cpu_proof = load_recipe(loaded.path).with_backend("inductor")
    assert cpu_proof.name == "hub@inductor"
    proof = build_plan([cpu_proof], env, {"hub": HubPin("Qwen/Qwen3.5-2B", "main", OTHER)}, backends=backends, steps=STEPS)
    assert proof.nodes[_roles(proof, "hub@inductor")["fetch"]].params.revision == OTHER and env.asked == []
    # A pin of another revision, another repo or another recipe does not answer for this one: the Hub does.
    for pins in ({"hub": HubPin("Qwen/Qwen3.5-2B", "v1", OTHER)}, {"hub": HubPin("Qwen/Other", "main", OTHER)},
                 {"other": HubPin("Qwen/Qwen3.5-2B", "main", OTHER)}):
        plan = build_plan([loaded], env, pins, backends=backends, steps=STEPS)
        assert plan.nodes[_roles(plan, "hub")["fetch"]].params.revision == COMMIT


def test_the_hub_is_asked_once_per_repo_and_revision(tmp_path):
    """Planning asks the environment for each recipe; the host environment answers each repo and revision once per
    command (tests/test_hf_pinning.py counts the Hub's requests), so two recipes of one model plan one fetch."""
    env = FakeEnvironment(hub={("Qwen/Qwen3.5-2B", "main"): COMMIT})
    plan = build_plan([_cpu(tmp_path, "one", model="{hf: Qwen/Qwen3.5-2B}"),
                       _cpu(tmp_path, "two", tp=2, model="{hf: Qwen/Qwen3.5-2B}")], env, backends=backends, steps=STEPS)
    assert _roles(plan, "one")["fetch"] == _roles(plan, "two")["fetch"]


def test_an_unresolved_hub_model_has_no_key_and_a_build_refuses_it(tmp_path):
    loaded = _cpu(tmp_path, "hub", model="{hf: Qwen/Qwen3.5-2B}")
    plan = build_plan([loaded], FakeEnvironment(), backends=backends, steps=STEPS)      # the Hub cannot be asked
    roles = _roles(plan, "hub")
    looked_up: list[str] = []
    status = evaluate(plan, lambda key: looked_up.append(key), {})
    # Keyed on the branch name only for an id: no store entry may answer for it (an old one keyed so would).
    assert walk(plan, lambda nid, key: None)[roles["fetch"]].key not in looked_up
    fetch = status[roles["fetch"]]
    line = (f"{loaded.path}:1:13: model.hf: Qwen/Qwen3.5-2B@main is not resolved (offline); pin a commit in the "
            "recipe or run 'qbuild lock update' online")
    assert (fetch.status, fetch.key, fetch.why) == ("unresolved", None, line)
    assert status[roles["convert"]].status == "waiting" and status[roles["convert"]].why == "waits on snapshot"
    # Steps that do not read the weights are keyed as ever: a compile depends on the architecture only.
    assert status[roles["compile cte-32"]].key is not None
    with pytest.raises(InfraError) as err:
        require_resolved(plan)
    assert str(err.value) == line
    # A revision the Hub does not have is the recipe's to fix: exit 2, not 3.
    env = FakeEnvironment(hub={("Qwen/Qwen3.5-2B", "main"): UserError("the Hub has no revision main")})
    with pytest.raises(UserError, match=r"is not resolved \(the Hub has no revision main\)$"):
        require_resolved(build_plan([loaded], env, backends=backends, steps=STEPS))


def test_a_port_is_its_source_files_digests_and_planned_when_missing(tmp_path):
    loaded = _recipe(tmp_path, "nrn", NEURON)
    env = FakeEnvironment(ports={tmp_path / "port": {"modeling_qwen35.py": "blake3:9"}})
    plan = build_plan([loaded], env, backends=backends, steps=STEPS)
    port = plan.nodes[_roles(plan, "nrn")["port"]]
    assert to_json(port.params) == {"files": {"modeling_qwen35.py": "blake3:9"}} and port.name == "port port"
    compile_text = plan.nodes[_roles(plan, "nrn")["compile text"]]
    assert compile_text.deps == {"port": port.id} and compile_text.params.toolchain["neuronx-cc"] == "2.26.6360.0"
    missing = build_plan([loaded], FakeEnvironment(), backends=backends, steps=STEPS)
    port = missing.nodes[_roles(missing, "nrn")["port"]]
    assert to_json(port.params) == {"missing": "port"} and port.name == "port port (not found)"


def test_the_same_environment_plans_the_same_keys(tmp_path):
    env = FakeEnvironment(checkpoints={tmp_path / "ck": {"config.json": "blake3:1"}})
    a = build_plan([_cpu(tmp_path, "k")], env, backends=backends, steps=STEPS)
    other = tmp_path / "elsewhere"
    other.mkdir()
    env.checkpoints[other / "ck"] = {"config.json": "blake3:1"}
    b = build_plan([_cpu(other, "k")], env, backends=backends, steps=STEPS)
    ka = {role: walk(a, lambda nid, key: None)[nid].key for role, nid in _roles(a, "k").items()}
    kb = {role: walk(b, lambda nid, key: None)[nid].key for role, nid in _roles(b, "k").items()}
    assert ka == kb and ka["fetch"] and ka["compile cte-32"]


def test_planning_reads_no_file(tmp_path):
    """Planning and evaluating open no file and list no directory: the recipes are loaded already, and all else is
    the environment's."""
    env = FakeEnvironment(checkpoints={tmp_path / "ck": {"config.json": "blake3:1"}},
                          ports={tmp_path / "port": {"m.py": "blake3:9"}},
                          hub={("Qwen/Qwen3.5-2B", "main"): COMMIT})
    recipes = [_cpu(tmp_path, "cpu"), _recipe(tmp_path, "nrn", NEURON)]
    # imports and source hashes happen once
    evaluate(build_plan(recipes, env, backends=backends, steps=STEPS), lambda key: None, {})
    opened: list[str] = []
    recording = [True]

    def hook(event: str, args: tuple) -> None:
        if recording[0] and event in ("open", "os.listdir", "os.scandir"):
            opened.append(str(args[0]))

    sys.addaudithook(hook)      # audit hooks cannot be removed: this one goes quiet after the test
    try:
        evaluate(build_plan(recipes, env, backends=backends, steps=STEPS), lambda key: None, {})
    finally:
        recording[0] = False
    assert opened == []


def test_a_recipe_the_architecture_cannot_support_is_refused(tmp_path):
    env = FakeEnvironment(checkpoints={tmp_path / "ck": {}})
    with pytest.raises(RecipeError, match="parallel.tp: tp=3 does not divide"):
        build_plan([_cpu(tmp_path, "bad", tp=3)], env, backends=backends, steps=STEPS)


def test_a_backend_no_implementation_has_is_refused_at_its_field(tmp_path):
    """The recipe's backend is a name, resolved where the plan asks for the backend: an unknown one is the recipe's
    error at its file:line:column, listing the names there are."""
    loaded = _recipe(tmp_path, "tpu", CPU.format(model="{path: ck}", tp=1).replace("backend: export", "backend: tpu"))
    env = FakeEnvironment(checkpoints={tmp_path / "ck": {"config.json": "blake3:1"}})
    with pytest.raises(RecipeError) as err:
        build_plan([loaded], env, backends=backends, steps=STEPS)
    assert str(err.value) == f"{loaded.path}:5:10: backend: 'tpu' is not one of neuron, inductor, export"
