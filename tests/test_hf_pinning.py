"""Hub models are pinned in artifacts.lock: a fetch is keyed on a commit (the recipe's, the lock's pin, or what the
Hub resolves), never on what this machine's HF cache holds; it downloads exactly that commit; `qbuild lock update`
moves a pin and explain names it. Against tests/hubdouble.py, a local Hub the real huggingface_hub talks to, through
the CLI as a user runs it."""

from __future__ import annotations

import json
import os
import shutil
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from qbuild.planning import lock as lockmod
from tests.conftest import REPO, qbuild
from tests.hubdouble import HubDouble
from tests.test_fetch import populate_hf_cache

REPO_ID = "tiny-org/dense"
RECIPE = """name: {name}
model: {{hf: {repo}, revision: {revision}}}
text: {{seq_len: 48, cte_buckets: [{bucket}], tkg_buckets: [48]}}
dtype: float32
backend: export
verify: {{prompts: ["Hello"], new_tokens: 2, top1_min: 0.99, token_match_min: 1.0, max_logit_err: 0.001}}
"""
FETCH = f"fetch {REPO_ID}"


def _read_lock(path: Path) -> dict:
    """The lockfile as its JSON document, once lockmod.read has checked it."""
    return lockmod.read(path).to_json()


@dataclass
class Hub:
    double: HubDouble
    a: str          # the tiny Qwen3.5 of seed 0, on main
    b: str          # the same model with seed 1's weights, on no branch until a test moves main to it

    @property
    def online(self) -> dict[str, str]:
        return {"HF_ENDPOINT": self.double.url, "HF_HUB_OFFLINE": "0", "NO_PROXY": "127.0.0.1,localhost",
                "no_proxy": "127.0.0.1,localhost"}


OFFLINE = {"HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def seed_one(tmp_path_factory) -> Path:
    from qbuild.model.tinymodel import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("seed1") / "qwen3_5", "qwen3_5", seed=1)


@contextmanager
def serving(small_checkpoints, seed_one):
    """The Hub double with the model's two commits. Commit ids follow from the content, so every double made here
    serves the same ones."""
    with HubDouble() as double:
        a = double.add_commit(REPO_ID, small_checkpoints["qwen3_5"])
        b = double.add_commit(REPO_ID, seed_one, branch=None)
        yield Hub(double, a, b)


@pytest.fixture
def hub(small_checkpoints, seed_one):
    with serving(small_checkpoints, seed_one) as h:
        yield h


def _recipe(root: Path, name: str = "hubby", revision: str = "main", bucket: int = 32) -> Path:
    path = root / "recipes" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(RECIPE.format(name=name, repo=REPO_ID, revision=revision, bucket=bucket))
    return path


def _plan(root: Path, env: dict, *recipes: Path) -> dict:
    doc = json.loads(qbuild("plan", "--json", *map(str, recipes), cwd=root, env=env, check=True).stdout)
    nodes = {n["id"]: n for n in doc["nodes"]}
    return {name: {role: nodes[nid] for role, nid in entry["nodes"].items()}
            for name, entry in doc["recipes"].items()}


def _manifests(store: Path) -> list[Path]:
    return sorted((store / "ac").rglob("*.json")) if (store / "ac").is_dir() else []


def _one_line(proc, code: int) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and len(lines) == 1, (proc.returncode, proc.stderr)
    return lines[0]


def _unresolved(reason: str) -> str:
    """The line the recipe's unresolved hub model gives, after its file:line:column."""
    return f"model.hf: {REPO_ID}@main is not resolved ({reason})"


# --- keys: the Hub (or the lock) decides, never the HF cache -----------------------------------------------------

def test_the_hf_cache_never_decides_a_key(tmp_path, hub, seed_one):
    recipe = _recipe(tmp_path)
    empty = _plan(tmp_path, hub.online, recipe)["hubby"]
    assert empty["fetch"]["params"] == {"source": "hf", "repo": REPO_ID, "revision": hub.a}
    # Planning read the commit's config.json into qbuild's own cache, leaving no partial snapshot in the HF cache.
    assert not (tmp_path / "hf-home" / "hub" / "models--tiny-org--dense").exists()
    # Another machine's cache: another commit on the branch the recipe names, as a download of it there leaves it.
    populate_hf_cache(tmp_path / "hf-home" / "hub", REPO_ID, seed_one, commit=hub.b)
    cached = _plan(tmp_path, hub.online, recipe)["hubby"]
    assert {r: n["key"] for r, n in cached.items()} == {r: n["key"] for r, n in empty.items()}
    assert empty["fetch"]["key"] and empty["compile cte-32"]["key"]
    assert hub.double.resolution_requests(REPO_ID) == 2     # once per command


def test_the_hub_is_asked_once_per_command_and_never_for_a_pinned_recipe(tmp_path, hub):
    one, two = _recipe(tmp_path, "one"), _recipe(tmp_path, "two", bucket=16)
    plan = _plan(tmp_path, hub.online, one, two)
    assert plan["one"]["fetch"]["id"] == plan["two"]["fetch"]["id"]
    assert hub.double.resolution_requests(REPO_ID) == 1
    proc = qbuild("lock", "update", str(one), "recipes/two.yaml", cwd=tmp_path, env=hub.online, check=True)
    assert proc.stderr.splitlines() == [f"one: model {REPO_ID}@main: pinned to {hub.a[:8]}",
                                        f"two: model {REPO_ID}@main: pinned to {hub.a[:8]}"]
    assert hub.double.resolution_requests(REPO_ID) == 2
    doc = _read_lock(tmp_path / "artifacts.lock")
    assert doc["recipes"]["one"] == {"recipe": "recipes/one.yaml", "nodes": {}, "bundle": None, "verified": False,
                                     "model": {"source": "hf", "repo": REPO_ID, "requested": "main",
                                               "revision": hub.a, "files": {}}}
    hub.double.move(REPO_ID, "main", hub.b)
    again = _plan(tmp_path, hub.online, one, two)
    assert again["one"]["fetch"]["key"] == plan["one"]["fetch"]["key"]       # the pin, though main moved
    assert hub.double.resolution_requests(REPO_ID) == 2
    # A recipe that names a commit is not asked about either, and plans that commit.
    by_commit = _plan(tmp_path, hub.online, _recipe(tmp_path, "sha", revision=hub.b))["sha"]
    assert by_commit["fetch"]["params"]["revision"] == hub.b and hub.double.resolution_requests(REPO_ID) == 2


# --- fetch: exactly the key's commit ------------------------------------------------------------------------------

def test_fetch_downloads_the_keys_commit_and_refuses_another(tmp_path, hub, monkeypatch, small_checkpoints):
    """In-process, with huggingface_hub imported while HF_HUB_OFFLINE was set: the step reads the endpoint and the
    offline switch when it runs."""
    import hashlib

    import huggingface_hub  # noqa: F401  (imported offline, as the isolated test environment has it)
    from qbuild.core.errors import InfraError
    from tests.test_fetch import _ctx
    from tests.test_fetch import fetch_run

    for key, value in hub.online.items():
        monkeypatch.setenv(key, value)
    hub.double.move(REPO_ID, "main", hub.b)
    ctx = _ctx(tmp_path, {"source": "hf", "repo": REPO_ID, "revision": hub.a}, {})
    fetch_run(ctx)
    snap = json.loads((ctx.out / "snapshot.json").read_text())
    index = json.loads((small_checkpoints["qwen3_5"] / "model.safetensors.index.json").read_text())
    shard = min(index["weight_map"].values())
    expected = hashlib.sha256((small_checkpoints["qwen3_5"] / shard).read_bytes()).hexdigest()
    assert snap["revision"] == hub.a and snap["files"][shard]["digest"] == f"sha256:{expected}"
    # A mirror that serves only the branch head answers b for a: the step refuses it, naming both.
    shutil.rmtree(tmp_path / "hf-home")
    hub.double.stale_mirror = True
    (tmp_path / "again").mkdir()
    ctx = _ctx(tmp_path / "again", {"source": "hf", "repo": REPO_ID, "revision": hub.a}, {})
    with pytest.raises(InfraError) as err:
        fetch_run(ctx)
    assert f"asked for commit {hub.a[:12]}, the Hub served {hub.b[:12]}" in str(err.value)
    assert "\n" not in str(err.value) and not (ctx.out / "snapshot.json").exists()


def test_compile_refuses_a_snapshot_of_another_commit(tmp_path, hub):
    recipe = _recipe(tmp_path)
    qbuild("lock", "update", str(recipe), cwd=tmp_path, env=hub.online, check=True)
    qbuild("plan", str(recipe), cwd=tmp_path, env=hub.online, check=True)    # reads the pinned commit's config
    hub.double.move(REPO_ID, "main", hub.b)
    hub.double.stale_mirror = True
    proc = qbuild("compile", str(recipe), cwd=tmp_path, env=hub.online)
    assert proc.returncode == 3, proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith(f"error: {FETCH}: model.hf: {REPO_ID}: asked for commit {hub.a[:12]}, the Hub served "
                            f"{hub.b[:12]}; refusing"), proc.stderr
    assert _manifests(tmp_path / "store") == []
    # Planning's own download of the commit's config.json is refused the same way.
    shutil.rmtree(Path(os.environ["XDG_CACHE_HOME"]) / "qbuild" / "hf-configs")
    line = _one_line(qbuild("plan", str(recipe), cwd=tmp_path, env=hub.online), 3)
    assert line.endswith(f"model.hf: {REPO_ID}: asked for config.json at {hub.a[:12]}, the Hub served commit "
                         f"{hub.b[:12]}"), line


def test_a_download_the_conversion_program_refuses_is_one_line_exit_2_from_its_convert_step(tmp_path, hub,
                                                                                           small_checkpoints):
    """The fetch step checks a download's files (config, tokenizer, index, headers) and holds no conversion rule in
    its key; whether the tensors are the ones the program reads is the convert step's check: one line naming the
    file and the tensor, exit 2, nothing locked."""
    from tests.test_hostile_inputs import _edit_header, _shard_of

    bad = tmp_path / "bad"
    shutil.copytree(small_checkpoints["qwen3_5"], bad)
    norm = "model.language_model.norm.weight"
    _edit_header(_shard_of(bad, norm), lambda h: h[norm].update(shape=[8, 8]))
    commit = hub.double.add_commit(REPO_ID, bad)
    recipe = _recipe(tmp_path, revision=commit)
    proc = qbuild("compile", str(recipe), cwd=tmp_path, env=hub.online)
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2, proc.stderr
    assert line.startswith("error: convert ") and f"tensor {norm!r} has shape (8, 8), expected" in line, line
    assert not (tmp_path / "artifacts.lock").exists()


# --- offline, unreachable, unknown: one line, nothing written ----------------------------------------------------

def test_offline_without_a_pin_is_one_line_and_writes_nothing(tmp_path, hub):
    recipe = _recipe(tmp_path)
    for command in (["compile", str(recipe)], ["plan", str(recipe)], ["explain", str(recipe)]):
        line = _one_line(qbuild(*command, cwd=tmp_path, env={**hub.online, **OFFLINE}), 3)
        assert line.startswith(f"error: {recipe}:2:") and line.endswith(
            f": {_unresolved('offline')}; pin a commit in the recipe or run 'qbuild lock update' online"), line
    assert not (tmp_path / "artifacts.lock").exists() and _manifests(tmp_path / "store") == []
    assert hub.double.requests == []


def test_an_unreachable_hub_is_infrastructure_and_an_unknown_revision_the_recipes(tmp_path, hub):
    with socket.socket() as s:       # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    recipe = _recipe(tmp_path)
    line = _one_line(qbuild("compile", str(recipe), cwd=tmp_path, env={**hub.online, "HF_ENDPOINT": dead}), 3)
    assert f"{_unresolved(f'Hub unreachable at {dead}: ConnectError')}; pin a commit" in line, line
    unknown = _recipe(tmp_path, "nope", revision="nope")
    line = _one_line(qbuild("compile", str(unknown), cwd=tmp_path, env=hub.online), 2)
    assert line.endswith(f"model.hf: {REPO_ID}@nope is not resolved (the Hub has no revision nope)"), line
    line = _one_line(qbuild("lock", "update", str(recipe), cwd=tmp_path, env={**hub.online, **OFFLINE}), 3)
    assert line.endswith(f"{_unresolved('offline')}; pin a commit in the recipe or run 'qbuild lock update' "
                         "online"), line
    assert not (tmp_path / "artifacts.lock").exists() and _manifests(tmp_path / "store") == []


def test_shipped_recipes_plan_offline_with_a_not_resolved_status(tmp_path):
    """recipes/2b-tp8.yaml asks for main: offline and unpinned, `plan` and `explain` show its fetch as not resolved
    (its architecture comes from the shipped config), and `compile` refuses with that line before building."""
    recipe = str(REPO / "recipes" / "2b-tp8.yaml")
    where = ["--lock", str(tmp_path / "artifacts.lock"), "--store", str(tmp_path / "store")]
    expected = ("model.hf: Qwen/Qwen3.5-2B@main is not resolved (offline); pin a commit in the recipe or run "
                "'qbuild lock update' online")
    tree = qbuild("plan", recipe, *where, env={**OFFLINE, "COLUMNS": "400"}, check=True).stdout
    assert "1 not resolved" in tree and expected in tree
    rows = json.loads(qbuild("explain", recipe, "--json", *where, env=OFFLINE, check=True).stdout)
    fetch = next(r for r in rows if r["name"] == "fetch Qwen/Qwen3.5-2B")
    assert fetch["status"] == "unresolved" and fetch["why"].endswith(expected)
    line = _one_line(qbuild("compile", recipe, *where, env=OFFLINE), 3)
    assert line.endswith(expected) and not (tmp_path / "artifacts.lock").exists()


def test_compile_update_moves_the_pin_before_building(tmp_path, hub):
    recipe = _recipe(tmp_path)
    qbuild("lock", "update", str(recipe), cwd=tmp_path, env=hub.online, check=True)
    hub.double.move(REPO_ID, "main", hub.b)
    line = _one_line(qbuild("compile", str(recipe), "--update", "--frozen", cwd=tmp_path, env=hub.online), 2)
    assert "--update and --frozen" in line
    # --strict builds nothing: what --update did to the lock is all that happens.
    proc = qbuild("compile", str(recipe), "--update", "--strict", cwd=tmp_path, env=hub.online)
    assert proc.returncode != 0 and f"hubby: model {REPO_ID}@main: {hub.a[:8]} -> {hub.b[:8]}" in proc.stderr
    assert lockmod.read(tmp_path / "artifacts.lock").hub_pins()["hubby"].revision == hub.b
    assert _manifests(tmp_path / "store") == []
    # With --progress json the move is a `pin` event: stderr holds JSON lines only, but for the one-line error.
    hub.double.move(REPO_ID, "main", hub.a)
    proc = qbuild("compile", str(recipe), "--update", "--strict", "--progress", "json", cwd=tmp_path, env=hub.online)
    *events, error = proc.stderr.splitlines()
    assert proc.returncode != 0 and not error.startswith("{")
    pins = [e for e in map(json.loads, events) if e["event"] == "pin"]
    assert pins == [{"event": "pin", "step": "compile", "recipe": "hubby", "repo": REPO_ID, "requested": "main",
                     "revision": hub.a, "before": hub.b, "moved": True}]


# --- a pinned build, a moved branch, a moved pin ------------------------------------------------------------------

@pytest.fixture(scope="module")
def built(tmp_path_factory, small_checkpoints, seed_one) -> Path:
    """A project whose recipe was built online at main = a (store, lock, HF cache and qbuild's caches beside it).
    Read-only: tests take a copy (_copy)."""
    root = tmp_path_factory.mktemp("pinned")
    _recipe(root / "project")
    with serving(small_checkpoints, seed_one) as h:
        qbuild("compile", "recipes/hubby.yaml", "-j", "2", cwd=root / "project",
               env={**_machine(root), **h.online}, check=True, timeout=600)
    return root


def _machine(root: Path) -> dict[str, str]:
    """The caches and store of the machine whose files lie under `root`. Module fixtures run before each test's own
    environment is set, so PYTHONPATH too, or the CLI would import an installed qbuild."""
    return {"HF_HOME": str(root / "hf"), "HF_HUB_CACHE": "", "XDG_CACHE_HOME": str(root / "xdg"),
            "QBUILD_STORE": str(root / "store"), "QBUILD_REMOTE": "", "PYTHONPATH": str(REPO)}


def _copy(built: Path, tmp_path: Path) -> tuple[Path, dict]:
    root = Path(shutil.copytree(built, tmp_path / "machine", symlinks=True))
    return root, _machine(root)


def _drop_fetch(root: Path) -> dict:
    """Remove the fetch step's store entry, so the next build fetches again; returns the lock's fetch node."""
    doc = _read_lock(root / "project" / "artifacts.lock")
    node = doc["nodes"][doc["recipes"]["hubby"]["nodes"]["fetch"]]
    (root / "store" / "ac" / node["key"][:2] / f"{node['key']}.json").unlink()
    return node


def _fetched_revision(root: Path) -> str:
    doc = _read_lock(root / "project" / "artifacts.lock")
    digest = doc["nodes"][doc["recipes"]["hubby"]["nodes"]["fetch"]]["outputs"]["snapshot.json"]["digest"]
    return json.loads((root / "store" / "cas" / digest[:2] / digest).read_text())["revision"]


@pytest.mark.slow
@pytest.mark.xdist_group("hf-pinning")
def test_a_build_keeps_its_pin_until_lock_update_moves_it(built, hub, tmp_path):
    root, env = _copy(built, tmp_path)
    env.update(hub.online)
    project = root / "project"
    model = _read_lock(project / "artifacts.lock")["recipes"]["hubby"]["model"]
    assert {k: v for k, v in model.items() if k != "files"} == {"source": "hf", "repo": REPO_ID, "requested": "main",
                                                               "revision": hub.a}
    assert model["files"]["config.json"].startswith("git-sha1:") and _fetched_revision(root) == hub.a
    # main moves; a machine without the snapshot (no HF cache, no fetch in the store) builds the pinned commit.
    hub.double.move(REPO_ID, "main", hub.b)
    shutil.rmtree(root / "hf")
    _drop_fetch(root)
    out = json.loads(qbuild("compile", "recipes/hubby.yaml", "--json", cwd=project, env=env, check=True).stdout)
    assert out["built"] == [FETCH] and _fetched_revision(root) == hub.a
    assert hub.double.resolution_requests(REPO_ID) == 0
    before = _read_lock(project / "artifacts.lock")
    # Moving the pin is explicit, and moves nothing else.
    proc = qbuild("lock", "update", cwd=project, env=env, check=True)
    assert proc.stderr.splitlines() == [f"hubby: model {REPO_ID}@main: {hub.a[:8]} -> {hub.b[:8]}"]
    after = _read_lock(project / "artifacts.lock")
    assert after["recipes"]["hubby"]["model"] == {"source": "hf", "repo": REPO_ID, "requested": "main",
                                                  "revision": hub.b, "files": {}}
    assert after["nodes"] == before["nodes"]
    assert {k: v for k, v in after["recipes"]["hubby"].items() if k != "model"} == \
        {k: v for k, v in before["recipes"]["hubby"].items() if k != "model"}
    # explain and plan name the pin that moved, for the steps that rebuild because of it.
    moved = f"model {REPO_ID}@main: {hub.a[:8]} -> {hub.b[:8]}"
    rows = {r["name"]: r for r in json.loads(qbuild("explain", "recipes/hubby.yaml", "--json", cwd=project,
                                                    env=env, check=True).stdout)}
    assert (rows[FETCH]["status"], rows[FETCH]["why"]) == ("build", moved)
    assert rows["convert qwen3_5 float32 fp8=none"]["why"] == f"waits on snapshot; {moved}"
    compiles = [r for name, r in rows.items() if name.startswith("compile ")]
    assert compiles and {r["why"] for r in compiles} == {"cached"}     # a compile does not read the weights
    plan = _plan(project, env, project / "recipes" / "hubby.yaml")["hubby"]
    assert plan["fetch"]["why"] == moved and plan["fetch"]["params"]["revision"] == hub.b
    assert plan["reference"]["why"] == f"waits on snapshot; {moved}"
    proc = qbuild("lock", "update", "hubby", cwd=project, env=env, check=True)
    assert proc.stderr.splitlines() == [f"hubby: model {REPO_ID}@main: {hub.b[:8]} (unchanged)"]


@pytest.mark.slow
@pytest.mark.xdist_group("hf-pinning")
def test_offline_with_a_pin_builds_from_the_hf_cache(built, hub, tmp_path, seed_one):
    root, env = _copy(built, tmp_path)
    env.update({**hub.online, **OFFLINE})
    # The cache also holds b, on main, as a later download of main leaves it: the pin, not the ref, decides.
    populate_hf_cache(root / "hf" / "hub", REPO_ID, seed_one, commit=hub.b)
    hub.double.move(REPO_ID, "main", hub.b)
    _drop_fetch(root)
    out = json.loads(qbuild("compile", "recipes/hubby.yaml", "--json", cwd=root / "project", env=env,
                            check=True).stdout)
    assert out["built"] == [FETCH] and _fetched_revision(root) == hub.a
    assert hub.double.requests == []


@pytest.mark.slow
@pytest.mark.xdist_group("hf-pinning")
def test_a_flipped_byte_in_the_hf_cache_never_reaches_a_rebuilt_step_or_the_lock(built, tmp_path):
    """The fetch step is cached, the steps that read the weights are not (a store that lost them, another machine's
    store): they read the HF cache's bytes, which must still be the snapshot's."""
    root, env = _copy(built, tmp_path)
    env.update(OFFLINE)
    project = root / "project"
    lock_before = (project / "artifacts.lock").read_bytes()
    doc = _read_lock(project / "artifacts.lock")
    for role in ("convert", "reference"):
        key = doc["nodes"][doc["recipes"]["hubby"]["nodes"][role]]["key"]
        (root / "store" / "ac" / key[:2] / f"{key}.json").unlink()
    before = _manifests(root / "store")
    snap = root / "hf" / "hub" / "models--tiny-org--dense" / "snapshots" / doc["recipes"]["hubby"]["model"]["revision"]
    shard = min(p for p in snap.iterdir() if p.name.endswith(".safetensors"))
    blob = Path(os.path.realpath(shard))
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF          # tensor data: the header still parses, the size is the same
    blob.write_bytes(bytes(data))
    proc = qbuild("compile", "recipes/hubby.yaml", cwd=project, env=env)
    assert proc.returncode == 3, proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("error: convert ") and f"{shard}: its bytes hash to sha256 " in error and \
        f"`hf download {REPO_ID} {shard.name} --revision {snap.name}`" in error, error
    assert (project / "artifacts.lock").read_bytes() == lock_before and _manifests(root / "store") == before
