"""The plan cache: a cached answer is byte for byte the full path's, every input kind invalidates it, random edits
never make it wrong, and the cached commands load no heavy module.

In-process tests shrink the window in which a just-changed file is not trusted (plancache.RACY_NS) from a second to
RACY_TEST_NS and wait that long after each change, so that entries get recorded without second-long sleeps; the
kernel's file timestamps move in steps of at most a few milliseconds, well inside it. Tests through the command
line keep the real window.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qbuild import fastpath, plancache, planserver
from qbuild.engine import BuildOptions
from qbuild.keys import key_of, preimage
from qbuild.render import plan_json
from qbuild.store import StoreSpec
from qbuild.store.manifest import Manifest
from qbuild.workspace import Workspace
from tests.conftest import REPO

RACY_TEST_NS = 20_000_000
LOCK = Path("artifacts.lock")
HF_COMMIT = "a" * 40

BASE = """\
text: {seq_len: 128, cte_buckets: [32, 64], tkg_buckets: [128]}
dtype: float32
backend: export
verify: {new_tokens: 4}
"""
DENSE = "extends: bases/tiny.yaml\nmodel: {path: ../ck/qwen3_5}\n"
MOE = "extends: bases/tiny.yaml\nmodel: {path: ../ck/qwen3_5_moe}\nparallel: {tp: 2, ep: 2}\n"
HF = "model: {hf: Qwen/Qwen3.5-2B, revision: main}\nparallel: {tp: 8}\ntext: {seq_len: 512, cte_buckets: [128]}\n" \
     "backend: inductor\n"


# --- a workspace: two local tiny models (one fully "built"), one HF model, a base ------------------------------------

@pytest.fixture
def ws_dir(tmp_path, tiny_checkpoints, monkeypatch) -> Path:
    root = tmp_path / "ws"
    (root / "recipes" / "bases").mkdir(parents=True)
    (root / "recipes" / "bases" / "tiny.yaml").write_text(BASE)
    (root / "recipes" / "dense.yaml").write_text(DENSE)
    (root / "recipes" / "moe.yaml").write_text(MOE)
    (root / "recipes" / "hf.yaml").write_text(HF)
    for fam in ("qwen3_5", "qwen3_5_moe"):
        shutil.copytree(tiny_checkpoints[fam], root / "ck" / fam)
    write_hf_snapshot(Path(os.environ["HF_HOME"]) / "hub", HF_COMMIT)
    monkeypatch.chdir(root)
    ws = workspace()
    plan, _ = ws.plan(ws.load(["recipes/dense.yaml"]))
    fake_build(ws, plan)
    return root


def write_hf_snapshot(hub: Path, commit: str) -> None:
    from qbuild.source import shipped_config_path

    repo = hub / "models--Qwen--Qwen3.5-2B"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
    shutil.copy(shipped_config_path("Qwen/Qwen3.5-2B"), repo / "snapshots" / commit / "config.json")


def workspace() -> Workspace:
    from qbuild.store import default_store_path

    return Workspace(StoreSpec(local=str(default_store_path().resolve())), lock_path=LOCK)


def fake_build(ws: Workspace, plan, only: set[str] | None = None) -> None:
    """A store entry for every node (or those in `only`) whose inputs are stored, as if it had been built."""
    store = ws.store
    digests: dict[str, str] = {}
    for nid, node in plan.nodes.items():
        if any(dep not in digests for dep in node.deps.values()):
            continue
        pre = preimage(node, {name: digests[dep] for name, dep in node.deps.items()})
        key = key_of(pre)
        manifest = store.get_manifest(key)
        if manifest is None and (only is None or nid in only):
            scratch = store.staging_dir(key)
            name = "snapshot.json" if node.kind == "fetch" else "out.bin"
            (scratch / name).write_text(json.dumps({"revision": "fake", "files": {}}) if node.kind == "fetch" else key)
            manifest = Manifest(key=key, kind=node.kind, preimage=pre, outputs=store.ingest_tree(scratch))
            store.put_manifest(manifest)
            shutil.rmtree(scratch)
        if manifest is not None:
            digests[nid] = manifest.digest


def no_executor():
    raise AssertionError("a no-op build started an executor")


@pytest.fixture
def short_window(monkeypatch):
    monkeypatch.setattr(plancache, "RACY_NS", RACY_TEST_NS)


def settle() -> None:
    """Wait until what was just written is old enough for the cache to trust its timestamps."""
    time.sleep(2 * RACY_TEST_NS / 1e9)


def begin(monkeypatch) -> None:
    """What the command line does when it starts: the time, and noting what the command reads from then on."""
    monkeypatch.setattr(fastpath, "STARTED_NS", time.time_ns())
    plancache.start_recording()


def full_plan(recipes: list[str], all_: bool):
    ws = workspace()
    return ws, *ws.plan(ws.load(recipes, all_))


def record_plan(recipes: list[str], all_: bool, monkeypatch) -> bool:
    begin(monkeypatch)
    ws, plan, status = full_plan(recipes, all_)
    return fastpath.remember_plan(ws, recipes, all_, True, LOCK, None, plan, status)


def lookup(command: str, recipes: list[str], all_: bool):
    inv = plancache.invocation(command, recipes, all_, True, LOCK, None)
    return plancache.load(fastpath._store_root(None), inv)


def as_json(plan, status) -> str:
    return json.dumps(plan_json(plan, status), indent=1, sort_keys=True)


# --- byte for byte, through the command line ---------------------------------------------------------------------

def _imports(stderr: str) -> set[str]:
    return {line.split("|")[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def _without_imports(stderr: str) -> str:
    return "".join(line for line in stderr.splitlines(keepends=True) if not line.startswith("import time:"))


def _env(**extra: str) -> dict:
    """The test's environment for a child process, with bytecode caching on as for an installed qbuild (otherwise
    every child recompiles the package, and import times measure the compiler)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "COLUMNS": "120", **extra}


def _cli(*args: str, cache: bool = True, importtime: bool = False) -> subprocess.CompletedProcess:
    env = _env() if cache else _env(**{plancache.SWITCH: "off"})
    pre = ("-X", "importtime") if importtime else ()
    proc = subprocess.run([sys.executable, *pre, "-m", "qbuild.cli", *args], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc


SECONDS = re.compile(r" in \d+\.\ds$", re.M)


@pytest.mark.parametrize("args", [("plan", "--all", "--json"), ("plan", "--all"), ("plan", "recipes/dense.yaml"),
                                  ("compile", "--all"), ("compile", "recipes/dense.yaml", "--json"),
                                  ("compile", "recipes/dense.yaml", "--frozen", "-j", "2")],
                         ids=lambda a: " ".join(a))
def test_cached_answer_is_the_full_answer_byte_for_byte(ws_dir, args):
    if args[0] == "compile":
        ws = workspace()
        plan, _ = ws.plan(ws.load([], all_=True))
        fake_build(ws, plan)                          # every node cached: compile is a no-op
        ws.compile(ws.load([], all_=True), BuildOptions(), no_executor)        # the lockfile is current
    reference = _cli(*args, cache=False)
    time.sleep(1.1)                                   # past the real window, so the next run records
    recorded = _cli(*args)
    hit = _cli(*args, importtime=True)
    assert not {"pydantic", "typer", "yaml"} & _imports(hit.stderr), "not answered from the cache"
    for proc in (recorded, hit):
        assert proc.stdout == reference.stdout
        assert SECONDS.sub(" in Ts", _without_imports(proc.stderr)) == SECONDS.sub(" in Ts", reference.stderr)


def test_a_source_change_invalidates(ws_dir, tmp_path):
    """The digest of qbuild's own files is part of every entry: a copy of the package, edited, plans in full."""
    pkg = tmp_path / "pkg"
    shutil.copytree(REPO / "qbuild", pkg / "qbuild", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(pkg), "PYTHONDONTWRITEBYTECODE": "1"}

    def imports() -> set[str]:
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "qbuild.cli", "plan", "--all", "--json"],
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert f"{pkg}/qbuild" in _cli_file(env)
        return _imports(proc.stderr)

    time.sleep(1.1)
    imports()                                   # records
    assert "pydantic" not in imports()          # answered from the cache
    with open(pkg / "qbuild" / "plan.py", "a") as f:
        f.write("# an edit\n")
    assert "pydantic" in imports()


def _cli_file(env: dict) -> str:
    return subprocess.run([sys.executable, "-c", "import qbuild; print(qbuild.__file__)"], env=env,
                          capture_output=True, text=True, check=True).stdout


# --- every input kind invalidates ------------------------------------------------------------------------------------

def _edit_recipe(monkeypatch=None, tmp_path=None):
    Path("recipes/dense.yaml").write_text(DENSE + "text: {seq_len: 128, cte_buckets: [32]}\n")


def _edit_base(monkeypatch, tmp_path):
    Path("recipes/bases/tiny.yaml").write_text(BASE.replace("new_tokens: 4", "new_tokens: 5"))


def _touch_checkpoint(monkeypatch, tmp_path):
    f = next(Path("ck/qwen3_5").glob("*.safetensors"))
    os.utime(f)


def _add_checkpoint_file(monkeypatch, tmp_path):
    Path("ck/qwen3_5/extra.json").write_text("{}")


def _delete_manifest(monkeypatch, tmp_path):
    ws = workspace()
    plan, status = ws.plan(ws.load([], all_=True))
    cached = [st.key for st in status.values() if st.status == "cached"]
    ws.store.manifest_path(cached[-1]).unlink()


def _delete_blob(monkeypatch, tmp_path):
    ws = workspace()
    plan, status = ws.plan(ws.load([], all_=True))
    manifest = next(st.manifest for st in status.values() if st.status == "cached")
    ws.store.blob_path(next(iter(manifest.outputs.values()))["digest"]).unlink()


def _build_a_node(monkeypatch, tmp_path):
    ws = workspace()
    plan, status = ws.plan(ws.load([], all_=True))
    fake_build(ws, plan, {next(nid for nid, st in status.items() if st.status == "build")})


def _write_lock(monkeypatch, tmp_path):
    LOCK.write_text(json.dumps({"version": 1, "recipes": {}, "nodes": {}}))


def _add_recipe(monkeypatch, tmp_path):
    Path("recipes/another.yaml").write_text(DENSE.replace("qwen3_5}", "qwen3_5}\nname: another"))


def _env_hf_home(monkeypatch, tmp_path):
    write_hf_snapshot(tmp_path / "hf2" / "hub", "b" * 40)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf2"))


def _env_remote(monkeypatch, tmp_path):
    monkeypatch.setenv("QBUILD_REMOTE", "s3://bucket/prefix")


def _hf_ref(monkeypatch, tmp_path):
    hub = Path(os.environ["HF_HOME"]) / "hub"
    write_hf_snapshot(hub, "c" * 40)


def _project_config(monkeypatch, tmp_path):
    Path("qbuild.yaml").write_text("{}\n")


def _install_distribution(monkeypatch, tmp_path):
    (tmp_path / "site" / "torch-99.0.dist-info").mkdir()      # into a directory already on sys.path


EDITS = {"recipe": _edit_recipe, "base it extends": _edit_base, "checkpoint touched": _touch_checkpoint,
         "checkpoint file added": _add_checkpoint_file, "manifest deleted": _delete_manifest,
         "blob deleted": _delete_blob, "a node built elsewhere": _build_a_node, "lockfile": _write_lock,
         "recipe added to ./recipes": _add_recipe, "HF_HOME": _env_hf_home, "QBUILD_REMOTE": _env_remote,
         "HF ref moved": _hf_ref, "./qbuild.yaml": _project_config, "distribution installed": _install_distribution}


@pytest.mark.parametrize("edit", list(EDITS), ids=list(EDITS))
def test_each_input_kind_invalidates(ws_dir, short_window, monkeypatch, tmp_path, edit):
    (tmp_path / "site").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    settle()
    assert record_plan([], True, monkeypatch)
    assert lookup("plan", [], True) is not None
    EDITS[edit](monkeypatch, tmp_path)
    assert lookup("plan", [], True) is None


def test_unchanged_bytes_and_unrelated_files_still_hit(ws_dir, short_window, monkeypatch):
    settle()
    assert record_plan([], True, monkeypatch)
    for f in ("recipes/dense.yaml", "recipes/bases/tiny.yaml"):
        Path(f).write_text(Path(f).read_text())            # an editor's save: new timestamps, same bytes
    Path("notes.txt").write_text("the working directory is not an input")
    Path("recipes/bases/unused.yaml").write_text(BASE)     # a base no recipe extends
    assert lookup("plan", [], True) is not None


@pytest.mark.parametrize("change", ["file edited", "file added to a listed directory"])
def test_an_input_the_planner_starts_reading_is_witnessed(ws_dir, short_window, monkeypatch, change):
    """What planning reads is noted as it reads it: a planner that starts reading a new input (here a port's sources,
    folded into compile params) needs no change to the cache for an edit of that input to be a miss."""
    from qbuild import plan as planmod

    Path("port").mkdir()
    Path("port/model.py").write_text("v = 1\n")
    original = planmod.compile_params

    def with_port(*args):
        return {**original(*args), "port": [Path("port/model.py").read_text(), sorted(os.listdir("port"))]}

    monkeypatch.setattr(planmod, "compile_params", with_port)
    settle()
    assert record_plan([], True, monkeypatch)
    assert lookup("plan", [], True) is not None
    if change == "file edited":
        Path("port/model.py").write_text("v = 2\n")
    else:
        Path("port/other.py").write_text("")
    assert lookup("plan", [], True) is None


def test_retargeted_links_invalidate(ws_dir, short_window, monkeypatch):
    """A recipe or a checkpoint directory reached through a symlink: pointing the link elsewhere is a change."""
    shutil.copytree("ck/qwen3_5", "ck/qwen3_5-v2")
    Path("ck/qwen3_5-v2/generation_config.json").write_text("{}")
    os.symlink("qwen3_5", "ck/current")
    Path("variants").mkdir()
    Path("variants/a.yaml").write_text(DENSE.replace("../ck/qwen3_5", "../ck/current").replace("bases/", "../recipes/bases/"))
    Path("variants/b.yaml").write_text(Path("variants/a.yaml").read_text() + "verify: {new_tokens: 5}\n")
    os.symlink("../variants/a.yaml", "recipes/linked.yaml")
    Path("recipes/dense.yaml").unlink()
    for retarget in (lambda: _relink("recipes/linked.yaml", "../variants/b.yaml"),
                     lambda: _relink("ck/current", "qwen3_5-v2")):
        settle()
        assert record_plan([], True, monkeypatch)
        assert lookup("plan", [], True) is not None
        retarget()
        assert lookup("plan", [], True) is None
        ws, plan, status = full_plan([], True)    # and the full path does see something else
        assert as_json(plan, status) != as_json(*_recorded_answer())


def _relink(link: str, target: str) -> None:
    os.unlink(link)
    os.symlink(target, link)


def _recorded_answer():
    inv = plancache.invocation("plan", [], True, True, LOCK, None)
    entry = plancache.decode(plancache.entry_path(fastpath._store_root(None), inv).read_bytes())
    return entry["answer"]["plan"], entry["answer"]["status"]


def test_a_change_during_planning_is_not_recorded(ws_dir, short_window, monkeypatch):
    settle()
    begin(monkeypatch)
    ws, plan, status = full_plan([], True)
    _edit_recipe()                                          # after planning read it, before the entry is written
    assert not fastpath.remember_plan(ws, [], True, True, LOCK, None, plan, status)
    settle()
    assert not fastpath.remember_plan(ws, [], True, True, LOCK, None, plan, status)   # still: it changed after start


def test_compile_entry_needs_a_current_lockfile(ws_dir, short_window, monkeypatch):
    ws = workspace()
    plan, _ = ws.plan(ws.load([], all_=True))
    fake_build(ws, plan)
    settle()
    begin(monkeypatch)
    plan, result = ws.compile(ws.load([], all_=True), BuildOptions(), no_executor)   # writes the lockfile
    assert not fastpath.remember_compile(ws, [], True, True, LOCK, None, plan, result)
    settle()
    begin(monkeypatch)
    plan, result = ws.compile(ws.load([], all_=True), BuildOptions(), no_executor)   # a no-op
    assert fastpath.remember_compile(ws, [], True, True, LOCK, None, plan, result)
    assert lookup("compile", [], True) is not None
    _write_lock(monkeypatch, None)
    assert lookup("compile", [], True) is None


# --- random edits: a cached answer is never wrong ----------------------------------------------------------------

def _random_edit(rng: random.Random, monkeypatch, tmp_path) -> str:
    recipes = sorted(Path("recipes").glob("*.yaml"))
    kind = rng.choice(["recipe value", "recipe same bytes", "recipe touched", "base value", "base swapped",
                       "checkpoint touched", "checkpoint same bytes", "checkpoint bytes", "checkpoint file added",
                       "checkpoint file removed", "manifest deleted", "manifest garbled", "blob deleted",
                       "node built", "lock written", "lock deleted", "recipe added", "recipe removed",
                       "HF_HOME", "HF ref", "qbuild.yaml"] + ["nothing"] * 6)   # a rerun is the common case
    if kind == "recipe value":
        f = rng.choice(recipes)
        field = rng.choice(["text: {seq_len: 128, cte_buckets: [%d]}" % rng.choice([16, 32, 64]),
                            "dtype: %s" % rng.choice(["float32", "bfloat16"]),
                            "verify: {new_tokens: %d}" % rng.randint(1, 6),
                            "parallel: {tp: %d}" % rng.choice([1, 2, 3])])      # tp 3 is invalid: no answer
        lines = [ln for ln in f.read_text().splitlines() if not ln.startswith(field.split(":")[0] + ":")]
        f.write_text("\n".join(lines + [field]) + "\n")
    elif kind in ("recipe same bytes", "checkpoint same bytes"):
        f = rng.choice(recipes if kind.startswith("recipe") else sorted(Path("ck").glob("*/*.json")))
        f.write_bytes(f.read_bytes())
    elif kind in ("recipe touched", "checkpoint touched"):
        os.utime(rng.choice(recipes if kind.startswith("recipe") else sorted(Path("ck").glob("*/*"))))
    elif kind == "base value":
        Path("recipes/bases/tiny.yaml").write_text(BASE.replace("new_tokens: 4", f"new_tokens: {rng.randint(3, 5)}"))
    elif kind == "base swapped":
        Path("recipes/bases/other.yaml").write_text(BASE.replace("float32", "float16"))
        f = rng.choice([f for f in recipes if "extends" in f.read_text()] or recipes)
        target = rng.choice(["bases/tiny.yaml", "bases/other.yaml"])
        f.write_text(re.sub(r"extends: \S+", f"extends: {target}", f.read_text()))
    elif kind == "checkpoint bytes":
        Path("ck/qwen3_5/generation_config.json").write_text(json.dumps({"seed": rng.randint(0, 2)}))
    elif kind == "checkpoint file added":
        Path(f"ck/{rng.choice(['qwen3_5', 'qwen3_5_moe'])}/extra.txt").write_text("x")
    elif kind == "checkpoint file removed":
        for f in Path("ck").glob("*/extra.txt"):
            f.unlink()
    elif kind in ("manifest deleted", "manifest garbled", "blob deleted"):
        store = workspace().store
        manifests = sorted((store.root / "ac").glob("*/*.json"))
        if manifests:
            m = rng.choice(manifests)
            if kind == "manifest deleted":
                m.unlink()
            elif kind == "manifest garbled":
                m.write_text("{not json")
            else:
                try:
                    outputs = json.loads(m.read_text())["outputs"]
                except ValueError:
                    outputs = {}
                for out in outputs.values():
                    store.blob_path(out["digest"]).unlink(missing_ok=True)
    elif kind == "node built":
        try:
            ws, plan, status = full_plan([], True)
        except Exception:
            return kind
        todo = [nid for nid, st in status.items() if st.status == "build"]
        if todo:   # a few nodes, or everything (a no-op compile follows)
            fake_build(ws, plan, set(rng.sample(todo, min(len(todo), rng.randint(1, 4)))) if rng.random() < 0.5
                       else None)
    elif kind == "lock written":
        try:
            ws = workspace()
            ws.compile(ws.load([], all_=True), BuildOptions(strict=True), no_executor)
        except Exception:
            pass
    elif kind == "lock deleted":
        LOCK.unlink(missing_ok=True)
    elif kind == "recipe added":
        Path("recipes/extra.yaml").write_text(MOE.replace("tp: 2, ep: 2", "tp: 1") + "name: extra\n")
    elif kind == "recipe removed":
        Path("recipes/extra.yaml").unlink(missing_ok=True)
    elif kind == "HF_HOME":
        home = rng.choice([tmp_path / "hf-home", tmp_path / "hf-other"])
        if not (home / "hub").exists():
            write_hf_snapshot(home / "hub", "d" * 40)
        monkeypatch.setenv("HF_HOME", str(home))
    elif kind == "HF ref":
        write_hf_snapshot(Path(os.environ["HF_HOME"]) / "hub", rng.choice(["a", "e"]) * 40)
    elif kind == "qbuild.yaml":
        p = Path("qbuild.yaml")
        p.unlink() if p.exists() else p.write_text("{}\n")
    return kind


@pytest.mark.slow
def test_random_edits_never_give_a_wrong_answer(ws_dir, short_window, monkeypatch, tmp_path):
    rng = random.Random(12)
    counts = {"hit": 0, "miss": 0, "error": 0, "compile hit": 0}
    for step in range(300):
        kind = _random_edit(rng, monkeypatch, tmp_path)
        settle()
        cases = [([], True), (["recipes/dense.yaml"], False)]
        recipes, all_ = cases[step // 10 % 2]
        cached = lookup("plan", recipes, all_)
        cached_compile = lookup("compile", recipes, all_)
        begin(monkeypatch)
        try:
            ws, plan, status = full_plan(recipes, all_)
        except Exception:          # an invalid edit: the full path reports it, the cache must not answer
            assert cached is None and cached_compile is None, f"step {step} ({kind}): answered an invalid input"
            counts["error"] += 1
            continue
        if cached is None:
            counts["miss"] += 1
        else:
            counts["hit"] += 1
            assert as_json(cached["plan"], cached["status"]) == as_json(plan, status), f"step {step} ({kind})"
        fastpath.remember_plan(ws, recipes, all_, True, LOCK, None, plan, status)
        all_cached = all(st.status == "cached" for st in status.values())
        assert cached_compile is None or all_cached, f"step {step} ({kind}): a no-op answer for a build"
        if all_cached:
            lock_before = LOCK.read_bytes() if LOCK.exists() else None
            c_plan, result = ws.compile(ws.load(recipes, all_), BuildOptions(), no_executor)
            if cached_compile is not None:
                counts["compile hit"] += 1
                assert not result.built and LOCK.read_bytes() == lock_before, f"step {step} ({kind})"
                assert as_json(cached_compile["plan"], status) == as_json(plan, status), f"step {step} ({kind})"
                assert {n: m.digest for n, m in cached_compile["manifests"].items()} == \
                    {n: m.digest for n, m in result.manifests.items()}, f"step {step} ({kind})"
            settle()
            begin(monkeypatch)
            c_plan, result = ws.compile(ws.load(recipes, all_), BuildOptions(), no_executor)
            fastpath.remember_compile(ws, recipes, all_, True, LOCK, None, c_plan, result)
    # Floors that show the fuzz reached both answers; how many edits fall inside the racy window (and so are not
    # recorded) depends on the machine's load, so they are low. Cached no-op compiles are pinned byte for byte by
    # test_cached_answer_is_the_full_answer_byte_for_byte.
    assert counts["hit"] >= 15 and counts["miss"] >= 15, counts


# --- the serialisation is generic --------------------------------------------------------------------------------

def test_every_field_carries_through_and_values_round_trip(ws_dir):
    import dataclasses

    from qbuild.plan import Node

    ws, plan, status = full_plan([], True)
    back = plancache.decode(json.dumps(plancache.encode({"plan": plan, "status": status})))
    for nid, node in plan.nodes.items():
        assert vars(back["plan"].nodes[nid]) == dataclasses.asdict(node)
    for name, pr in plan.recipes.items():
        got = back["plan"].recipes[name]
        assert set(vars(got)) == {f.name for f in dataclasses.fields(pr)}
        assert got.loaded.path == pr.loaded.path and got.arch.layer_types == pr.arch.layer_types
        assert vars(got.loaded.recipe.parallel) == pr.loaded.recipe.parallel.model_dump()
    for nid, st in status.items():
        assert set(vars(back["status"][nid])) == {f.name for f in dataclasses.fields(st)}

    @dataclasses.dataclass
    class Extended(Node):
        port: dict = dataclasses.field(default_factory=lambda: {"__tuple__": (1, 2), 3: "three"})

    node = next(iter(plan.nodes.values()))
    ext = Extended(**dataclasses.asdict(node))
    got = plancache.decode(json.dumps(plancache.encode(ext)))
    assert got.port == {"__tuple__": (1, 2), 3: "three"} and got.id == node.id
    with pytest.raises(plancache.Uncacheable):
        plancache.encode({"a": {1, 2}})


# --- the command line read exactly as click reads it ------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["plan", "--all"], ["plan", "a.yaml", "b.yaml", "--json"], ["plan", "--lock=x.lock", "--all"],
    ["plan", "--lock", "a", "--lock", "b", "r.yaml"], ["plan", "--store", "s", "--json", "r.yaml"],
    ["plan", "--", "r.yaml"], ["plan", "--remote", "s3://b/p", "--all"], ["plan", "-h"], ["plan", "--all=1"],
    ["compile", "--all", "-j", "4"], ["compile", "--all", "-j4"], ["compile", "--all", "--jobs=2", "--frozen"],
    ["compile", "--all", "-j", "0"], ["compile", "--all", "--executor", "ray"], ["compile", "--all", "--mem", "2G"],
    ["compile", "--all", "--keep-going", "--strict", "--json", "--executor=local"], ["compile", "--lock"],
    ["compile", "--lock", "--all"], ["explain", "x"], [],
])
def test_argument_parsing_matches_click(argv):
    import typer

    from qbuild.cli import app

    parsed = fastpath.parse(argv)
    if parsed is None:
        return
    command, recipes, flags, values = parsed
    cmd = typer.main.get_command(app).commands[command]
    params = cmd.make_context(command, list(argv[1:])).params
    assert list(params["recipes"] or []) == recipes
    assert params["all_"] == ("--all" in flags) and params["json_"] == ("--json" in flags)
    assert str(params["lock"]) == str(Path(values.get("--lock", "artifacts.lock")))
    assert (params["store"] and str(params["store"])) == (values.get("--store") and str(Path(values["--store"])))
    assert params["remote"] is None
    if command == "compile":
        assert params["executor"] == "local" and params["mem"] is None and not params["push"]
        assert params["frozen"] == ("--frozen" in flags) and params["strict"] == ("--strict" in flags)


# --- imports: what each command loads ----------------------------------------------------------------------------

HEAVY = {"torch", "transformers", "boto3", "botocore", "ray", "safetensors", "numpy", "huggingface_hub"}
# What a cached answer must not load: the full path's own modules, and rich (trees are replayed as printed).
CACHED_FORBIDDEN = HEAVY | {"pydantic", "typer", "click", "yaml", "filelock", "sqlite3", "qbuild.plan",
                            "qbuild.engine", "qbuild.workspace", "qbuild.store", "qbuild.arch", "qbuild.recipe"}
# Per kind of command: (most modules it may import beyond the interpreter's own start, most import time it may
# add, as a multiple of that start's own import time). `-X importtime`, best of three; the count is exact, the
# time loose, as the machine is shared.
BUDGETS = {"cached": (20, 2.0), "full": (None, 60.0)}


def _import_profile(argv: list[str], env: dict | None = None) -> tuple[float, set[str]]:
    best, mods = float("inf"), set()
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-X", "importtime", *argv], env=_env(**(env or {})),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        times = [ln.split("|")[0].split(":")[1].strip() for ln in proc.stderr.splitlines()
                 if ln.startswith("import time:")]
        best, mods = min(best, sum(int(t) for t in times if t.isdigit()) / 1000), _imports(proc.stderr)
    return best, mods


def _check_budget(args: tuple[str, ...], kind: str, forbidden: set[str], env: dict | None = None) -> None:
    start_ms, start_mods = _import_profile(["-c", "pass"])
    ms, mods = _import_profile(["-m", "qbuild.cli", *args], env)
    assert not forbidden & mods, sorted(forbidden & mods)
    most_modules, time_ratio = BUDGETS[kind]
    added = mods - start_mods - {"runpy"}
    assert most_modules is None or len(added) <= most_modules, sorted(added)
    assert ms - start_ms <= time_ratio * start_ms, (ms, start_ms)


@pytest.mark.parametrize("args", [("plan", "--all", "--json"), ("plan", "--all"), ("compile", "--all"),
                                  ("compile", "--all", "--json")], ids=" ".join)
def test_import_budget_of_cached_commands(ws_dir, args):
    ws = workspace()
    plan, _ = ws.plan(ws.load([], all_=True))
    fake_build(ws, plan)
    ws.compile(ws.load([], all_=True), BuildOptions(), no_executor)
    time.sleep(1.1)
    _cli(*args)                                     # records
    _check_budget(args, "cached", CACHED_FORBIDDEN | {"rich"})


def test_trees_at_another_width_are_drawn_again(ws_dir):
    """A plan's trees are replayed only for the width (and encoding) they were printed at; elsewhere rich draws
    them from the cached plan, as the full path would."""
    time.sleep(1.1)
    _cli("plan", "--all")                           # records, with the trees at 120 columns
    for columns in ("120", "70"):
        env = _env(COLUMNS=columns)
        hit = subprocess.run([sys.executable, "-X", "importtime", "-m", "qbuild.cli", "plan", "--all"], env=env,
                             capture_output=True, text=True, check=True)
        full = subprocess.run([sys.executable, "-m", "qbuild.cli", "plan", "--all"], capture_output=True,
                              text=True, check=True, env={**env, plancache.SWITCH: "off"})
        assert hit.stdout == full.stdout
        assert ("rich" in _imports(hit.stderr)) == (columns != "120") and "pydantic" not in _imports(hit.stderr)


@pytest.mark.parametrize("args", [("plan", "--all", "--json"), ("compile", "--all"), ("explain", "recipes/hf.yaml"),
                                  ("lock", "check"), ("store", "verify"), ("recipe", "validate", "recipes/hf.yaml"),
                                  ("--help",)], ids=" ".join)
def test_import_budget_of_full_commands(ws_dir, args):
    if args in (("lock", "check"), ("compile", "--all")):
        ws = workspace()
        plan, _ = ws.plan(ws.load([], all_=True))
        fake_build(ws, plan)
        ws.compile(ws.load([], all_=True), BuildOptions(), no_executor)
    _check_budget(args, "full", HEAVY, {plancache.SWITCH: "off"})


# --- the summary line is what rich prints -------------------------------------------------------------------------

@pytest.mark.parametrize("env", [{}, {"COLUMNS": "20"}, {"FORCE_COLOR": "1"}, {"COLUMNS": "200"}],
                         ids=["plain", "narrow", "forced colour", "wide"])
@pytest.mark.parametrize("msg", ["0 built, 27 cached, 0 failed, 0 skipped in 0.1s", "a :smile: [b] line"])
def test_error_line_matches_rich(env, msg, monkeypatch, capsys):
    from rich.console import Console

    from qbuild import render

    for k in ("COLUMNS", "FORCE_COLOR", "TTY_COMPATIBLE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    render.console_err.cache_clear()
    render.print_err_line(msg)
    ours = capsys.readouterr().err
    Console(stderr=True, highlight=False).print(msg, markup=False, highlight=False)
    assert ours == capsys.readouterr().err
    render.console_err.cache_clear()


def test_noop_event_stream_matches_the_engine(ws_dir):
    """The fast path replays the engine's events of a no-op build: one "cached" event per node, in plan order."""
    ws = workspace()
    plan, _ = ws.plan(ws.load([], all_=True))
    fake_build(ws, plan)
    events = []
    plan, result = ws.compile(ws.load([], all_=True), BuildOptions(), no_executor, events.append)
    assert [(e.kind, e.node.id) for e in events] == [("cached", nid) for nid in plan.nodes]
    assert result.cached == list(plan.nodes)


def test_shipped_neuron_recipes_replay_and_a_port_put_in_place_is_a_miss(tmp_path, monkeypatch):
    """The shipped recipes are neuron builds whose ports are not checked out: `plan --all --json` answers from the
    cache exactly as in full, and putting a port where a recipe names it changes the answer (the port is found and
    identified by its files), so the cached one must not be given."""
    ws = tmp_path / "shipped"
    shutil.copytree(REPO / "recipes", ws / "recipes", ignore=shutil.ignore_patterns("tiny"))
    monkeypatch.chdir(ws)
    args = ("plan", "--all", "--json")
    reference = _cli(*args, cache=False)
    time.sleep(1.1)
    _cli(*args)
    hit = _cli(*args, importtime=True)
    assert not {"pydantic", "typer", "yaml"} & _imports(hit.stderr), "not answered from the cache"
    assert hit.stdout == reference.stdout
    assert not json.loads(reference.stdout)["recipes"]["2b-tp8"]["port"]["found"]

    (ws / "ports" / "Qwen3.5-2B" / "src").mkdir(parents=True)
    (ws / "ports" / "Qwen3.5-2B" / "src" / "modeling_qwen35.py").write_text("# the port\n")
    after = _cli(*args)
    assert after.stdout == _cli(*args, cache=False).stdout != reference.stdout
    assert json.loads(after.stdout)["recipes"]["2b-tp8"]["port"]["found"]


# --- the resident planner answers a miss as the command line would --------------------------------------------------

@pytest.fixture
def plan_server(monkeypatch):
    """The resident planner on, in a runtime directory of this test's (short: socket paths are limited); every
    server it started is stopped at the end."""
    import tempfile

    runtime = Path(tempfile.mkdtemp(prefix="qb-"))
    runtime.chmod(0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.delenv("QBUILD_PLAN_SERVER")
    yield runtime
    planserver.stop_all(str(runtime))
    shutil.rmtree(runtime, ignore_errors=True)


def _serving(runtime: Path, timeout: float = 30.0) -> bool:
    """Whether a server is listening in `runtime` (waiting for one that is starting)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(runtime.glob("*.sock")) and planserver.serving(str(runtime)):
            return True
        time.sleep(0.05)
    return False


def _plan_cli(*args: str, server: bool, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    """`qbuild plan` with -X importtime (which imports ran in this process), the plan cache on; with the server
    allowed or not."""
    extra = {} if server else {"QBUILD_PLAN_SERVER": "off"}
    if pythonpath:
        extra["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "qbuild.cli", "plan", *args],
                          env=_env(**extra), capture_output=True, text=True, timeout=300)


@pytest.mark.slow   # 48 commands over random edits: a fuzzer
def test_the_resident_planner_answers_edits_byte_for_byte(ws_dir, plan_server):
    """After each edit the cache misses: the server's child plans it, printing exactly what the command plans in
    process (stdout, stderr less import times, exit code), and the command itself imports no planner."""
    _plan_cli("--all", "--json", server=True)          # a miss with no server: plans in process, starts one
    assert _serving(plan_server)
    rng = random.Random(7)
    edits = [lambda i: Path("recipes/dense.yaml").write_text(DENSE + f"verify: {{new_tokens: {i + 5}}}\n"),
             lambda i: Path("recipes/bases/tiny.yaml").write_text(BASE.replace("[32, 64]", f"[32, {64 + i}]")),
             lambda i: Path("recipes/moe.yaml").write_text(MOE + f"text: {{seq_len: {128 + 64 * i}}}\n"),
             lambda i: os.utime(next(Path("ck/qwen3_5").glob("*.safetensors")))]
    for i in range(8):
        rng.choice(edits)(i)
        for args in (("--all", "--json"), ("--all",), ("recipes/dense.yaml",)):
            served, own = _plan_cli(*args, server=True), _plan_cli(*args, server=False)
            assert (served.returncode, served.stdout) == (own.returncode, own.stdout)
            assert _without_imports(served.stderr) == _without_imports(own.stderr)
            assert "pydantic" in _imports(own.stderr)
            assert not {"pydantic", "yaml", "qbuild.plan"} & _imports(served.stderr), "not planned by the server"


def test_the_resident_planner_leaves_errors_to_the_command_line(ws_dir, plan_server):
    _plan_cli("--all", server=True)
    assert _serving(plan_server)
    Path("recipes/dense.yaml").write_text(DENSE + "parallel: {tp: eight}\n")
    served, own = _plan_cli("--all", server=True), _plan_cli("--all", server=False)
    assert served.returncode == own.returncode == 2
    assert (served.stdout, _without_imports(served.stderr)) == (own.stdout, _without_imports(own.stderr))
    assert "recipes/dense.yaml:3:16: parallel.tp: " in own.stderr


def test_a_source_change_stops_the_resident_planner(ws_dir, plan_server, tmp_path):
    """A server runs the qbuild it started with: once the package's files change it answers nothing and exits, and
    the command plans with the new code."""
    pkg = tmp_path / "pkg"
    shutil.copytree(REPO / "qbuild", pkg / "qbuild", ignore=shutil.ignore_patterns("__pycache__"))
    time.sleep(1.1)             # a server starts only on source old enough for its timestamps to show a change
    _plan_cli("--all", server=True, pythonpath=str(pkg))
    assert _serving(plan_server)
    pid, = planserver.serving(str(plan_server))
    render = pkg / "qbuild" / "render.py"
    render.write_text(render.read_text().replace('"build": "to build"', '"build": "to be built"'))
    Path("recipes/dense.yaml").write_text(DENSE + "verify: {new_tokens: 9}\n")
    served = _plan_cli("--all", server=True, pythonpath=str(pkg))
    assert served.returncode == 0 and "to be built" in served.stdout
    assert "pydantic" in _imports(served.stderr)       # planned by the command itself
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists(), "the stale server is still running"
