"""The platform a build depends on: this host's tag, in the keys of the nodes whose output is not portable and only
there; `compile --frozen` on another platform; tiny checkpoints that are the same bytes on every CPU; a failed build
that writes nothing; a SIGKILLed driver that leaves no leaked-semaphore warning.

A platform "other than this host's" is ATEN_CPU_CAPABILITY=default: torch's scalar kernels, which every CPU runs
(qbuild.core.platform cites where torch reads it)."""

from __future__ import annotations

import json
import os
import platform as pyplatform
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from qbuild import backends
from qbuild.core.hashing import StatCache
from qbuild.model.families import FAMILIES
from qbuild.planning.environment import HostEnvironment
from qbuild.planning.dag import Plan
from qbuild.planning.keys import diff_preimages, portability, walk
from qbuild.planning.plan import build_plan
from qbuild.recipe.schema import load_recipe
from qbuild.planning import lock as lockmod
from qbuild.planning.plan import HubPin
from tests.conftest import REPO, qbuild, wait_until
from qbuild.steps.registry import STEPS
from tests.engine_actions import Sleep, add

OTHER = {"ATEN_CPU_CAPABILITY": "default"}
STARTUP = Path(__file__).resolve().parent / "startup"
RECIPE = """\
name: dense
model: {{path: {model}}}
text: {{seq_len: 48, cte_buckets: [32], tkg_buckets: [48]}}
dtype: float32
backend: {backend}
verify: {{prompts: ["Hello"], new_tokens: 2, top1_min: 0.99, token_match_min: 1.0, max_logit_err: 0.001}}
"""


def _host_tag(env: dict | None = None) -> str:
    """host_tag() as a fresh process sees it, which must not import torch to say it."""
    code = ("import sys; from qbuild.core.platform import host_tag; print(host_tag()); "
            "assert 'torch' not in sys.modules, 'the platform tag imported torch'")
    return subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **(env or {})), check=True,
                          capture_output=True, text=True, timeout=300).stdout.strip()


# --- the tag ---------------------------------------------------------------------------------------------------------

def test_the_tag_names_machine_os_libc_python_and_torchs_cpu_capability():
    import torch

    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(pyplatform.machine().lower(), pyplatform.machine().lower())
    libc, version = pyplatform.libc_ver()
    python = f"cp{sys.version_info.major}{sys.version_info.minor}"
    here = torch.backends.cpu.get_cpu_capability().replace(" ", "")
    assert _host_tag() == f"{machine}-{sys.platform}-{libc}{version}-{python}-{here}"
    assert _host_tag(OTHER) == f"{machine}-{sys.platform}-{libc}{version}-{python}-DEFAULT"


def test_the_probe_runs_once_per_capability_setting(tmp_path):
    """The answer is cached per ATEN_CPU_CAPABILITY (and torch version and CPU flags): a command asks the cache."""
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    cached = tmp_path / "cache" / "qbuild" / "platform"
    first = _host_tag({**env, **OTHER})
    assert first.endswith("-DEFAULT") and len(list(cached.iterdir())) == 1
    (entry,) = cached.iterdir()
    entry.write_text(json.dumps({**json.loads(entry.read_text()), "capability": "CACHED"}))
    assert _host_tag({**env, **OTHER}) == first.removesuffix("DEFAULT") + "CACHED"
    assert not _host_tag(env).endswith(("DEFAULT", "CACHED")) and len(list(cached.iterdir())) == 2


# --- keys ------------------------------------------------------------------------------------------------------------

def _keyed(small_checkpoints, tmp_path, backend: str, host: str = "TAG") -> tuple[Plan, dict]:
    recipe = tmp_path / f"{backend}.yaml"
    recipe.write_text(RECIPE.format(model=small_checkpoints["qwen3_5"], backend=backend))
    plan = build_plan([load_recipe(recipe)], HostEnvironment(StatCache(tmp_path / "stat-cache")), backends=backends, steps=STEPS)
    # Every node's output digest known, as after a build: every node is keyed.
    return plan, walk(plan, lambda nid, key: f"blake3:{nid}", host=lambda: host)


@pytest.mark.parametrize("backend, native", [("export", set()), ("inductor", {"compile", "package"})])
def test_the_platform_is_in_the_keys_of_non_portable_nodes_only(small_checkpoints, tmp_path, backend, native):
    plan, keys = _keyed(small_checkpoints, tmp_path, backend)
    with_platform = {plan.nodes[nid].kind for nid, nk in keys.items() if "platform" in nk.preimage}
    without = {plan.nodes[nid].kind for nid, nk in keys.items() if "platform" not in nk.preimage}
    assert with_platform == {"reference", "verify"} | native
    assert without == {"fetch", "convert", "shard", "compile", "package"} - native
    assert all(nk.preimage["platform"] == "TAG" for nk in keys.values() if "platform" in nk.preimage)
    # Another platform: other keys for exactly those nodes.
    _, elsewhere = _keyed(small_checkpoints, tmp_path, backend, host="OTHER")
    changed = {plan.nodes[nid].kind for nid in keys if keys[nid].key != elsewhere[nid].key}
    assert changed == with_platform


def test_a_node_that_takes_a_non_portable_input_is_not_portable():
    native = type("Native", (Sleep,), {"kind": "test-native", "portable": False})
    nodes: dict = {}
    a = add(nodes, native, "a", {"name": "a"}, {}, 1, 1)
    b = add(nodes, Sleep, "b", {"name": "b"}, {"up": a}, 1, 1)
    c = add(nodes, Sleep, "c", {"name": "c"}, {"up": b}, 1, 1)
    d = add(nodes, Sleep, "d", {"name": "d"}, {}, 1, 1)
    e = add(nodes, Sleep, "e", {"name": "e"}, {"up": d}, 1, 1)
    plan = Plan(nodes, {})
    assert portability(plan) == {a: False, b: False, c: False, d: True, e: True}
    here = walk(plan, lambda nid, key: f"d-{nid}", host=lambda: "HERE")
    there = walk(plan, lambda nid, key: f"d-{nid}", host=lambda: "THERE")
    assert [here[n].key == there[n].key for n in (a, b, c, d, e)] == [False, False, False, True, True]
    assert diff_preimages(here[c].preimage, there[c].preimage) == ["platform: HERE -> THERE"]


# --- qbuild tiny -----------------------------------------------------------------------------------------------------

CLI_FAMILY = "qwen3_5_moe"      # the one written by `qbuild tiny` itself: vision, MoE, DeltaNet


@pytest.fixture(scope="module")
def tiny_elsewhere(tmp_path_factory) -> tuple[Path, str]:
    """Each family's tiny checkpoint written on another platform: CLI_FAMILY by `qbuild tiny` with umask 027, the
    others by one interpreter (an import of torch each costs more than the writing). (root, `qbuild tiny`'s stderr)"""

    root = tmp_path_factory.mktemp("tiny-elsewhere")
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", **OTHER)
    proc = subprocess.run([sys.executable, "-m", "qbuild.cli", "tiny", CLI_FAMILY, str(root / CLI_FAMILY)], env=env,
                          capture_output=True, text=True, timeout=600, umask=0o027)
    assert proc.returncode == 0, proc.stderr
    others = [fam for fam in FAMILIES if fam != CLI_FAMILY]
    code = ("import sys; from pathlib import Path; from qbuild.model.tinymodel import write_tiny_checkpoint\n"
            "for fam in sys.argv[2:]: write_tiny_checkpoint(Path(sys.argv[1]) / fam, fam)")
    subprocess.run([sys.executable, "-c", code, str(root), *others], env=env, check=True, timeout=600)
    return root, proc.stderr


@pytest.mark.xdist_group("tiny-elsewhere")
def test_tiny_writes_the_same_bytes_on_another_platform(tiny_elsewhere, small_checkpoints):
    root, _ = tiny_elsewhere
    for fam, here in small_checkpoints.items():
        files = sorted(p.name for p in here.iterdir())
        assert sorted(p.name for p in (root / fam).iterdir()) == files
        differ = [f for f in files if (root / fam / f).read_bytes() != (here / f).read_bytes()]
        assert differ == [], f"{fam}: {differ} differ between CPU capabilities"


@pytest.mark.xdist_group("tiny-elsewhere")
def test_tiny_prints_one_line_and_writes_files_as_the_umask_says(tiny_elsewhere):
    """No progress bar on stderr; the shards get the mode the JSON files get: 0666 less the umask (027 here)."""
    root, stderr = tiny_elsewhere
    assert stderr.splitlines() == [f"wrote a tiny {CLI_FAMILY} checkpoint to {root / CLI_FAMILY}"], stderr
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (root / CLI_FAMILY).iterdir()}
    assert set(modes.values()) == {0o640}, modes
    assert any(name.endswith(".safetensors") for name in modes)


@pytest.mark.slow
@pytest.mark.xdist_group("tiny-elsewhere")
def test_frozen_on_another_platform_reproduces_the_tiny_lock_and_rebuilds_what_is_not_portable(tiny_elsewhere,
                                                                                                   tmp_path):
    """`make lock-check` on a machine whose CPU differs from the one that wrote the committed lock: checkpoints written
    there, an empty store, the shipped tiny recipes and artifacts.lock."""
    from qbuild.store.local import LocalStore

    there = tmp_path / "there"
    shutil.copytree(REPO / "recipes", there / "recipes")
    for fam in FAMILIES:
        shutil.copytree(tiny_elsewhere[0] / fam, there / ".qbuild" / "tiny" / fam)
    shutil.copy(REPO / "artifacts.lock", there / "artifacts.lock")
    locked = (there / "artifacts.lock").read_bytes()
    nodes = json.loads(locked)["nodes"]
    locked_for = sorted({e["preimage"]["platform"] for e in nodes.values() if "platform" in e["preimage"]})
    assert _host_tag(OTHER) not in locked_for, "the lock must have been written on another CPU capability than OTHER"

    # One recipe: the MoE VL one holds every kind of layer the others have (DeltaNet, gated attention, experts, the
    # vision encoder); `make lock-check` reproduces all of them on the platform that wrote the lock.
    recipe = "recipes/tiny/moe-tp2-ep2.yaml"
    proc = qbuild("compile", recipe, "--frozen", "-j", "2", "--store", "store", cwd=there, env=OTHER, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (there / "artifacts.lock").read_bytes() == locked
    said = [line for line in proc.stderr.splitlines() if line.startswith("rebuilt for ")]
    assert said == [f"rebuilt for {_host_tag(OTHER)} (locked for {', '.join(locked_for)}): reference x1, verify x1"]
    # Every portable node was rebuilt from nothing into the same bytes; the others under this platform's keys.
    store = LocalStore(there / "store")
    ours = set(json.loads(locked)["recipes"]["moe-tp2-ep2"]["nodes"].values())
    assert ours and ours <= nodes.keys()
    for nid, entry in ((nid, nodes[nid]) for nid in ours):
        manifest = store.get_manifest(entry["key"])
        if "platform" in entry["preimage"]:
            assert manifest is None and entry["kind"] in ("reference", "verify"), nid
        else:
            assert manifest is not None and manifest.outputs == entry["outputs"], nid


# --- nothing written on failure --------------------------------------------------------------------------------------

def test_a_failed_compile_leaves_the_lockfile_byte_identical(tmp_path):
    """An HF model that is not cached, offline: the build fails (exit 3) before its bundle exists."""
    lock = tmp_path / "artifacts.lock"
    shutil.copy(REPO / "artifacts.lock", lock)
    before = lock.read_bytes()
    args = ("compile", str(REPO / "recipes" / "2b-tp8.yaml"), "--store", str(tmp_path / "store"))
    proc = qbuild(*args, "--lock", str(lock), cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr
    assert lock.read_bytes() == before
    assert qbuild(*args, "--lock", str(tmp_path / "new.lock"), cwd=tmp_path).returncode == 3
    assert not (tmp_path / "new.lock").exists()


def test_lock_check_fails_on_a_recipe_pinned_but_never_built(tmp_path):
    lock = tmp_path / "artifacts.lock"
    pin = HubPin("Qwen/Qwen3.5-2B", "main", "a" * 40)
    entry = lockmod.RecipeEntry.pinned_only("recipes/2b-tp8.yaml", lockmod.ModelEntry.pinned(pin))
    lock.write_text(lockmod.Lock(recipes={"2b-tp8": entry}).dumps())
    proc = qbuild("lock", "check", "--lock", str(lock), "--store", str(tmp_path / "store"), cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == ["2b-tp8: pinned, but no bundle is locked for it; run `qbuild compile` on "
                                        "recipes/2b-tp8.yaml"]


# --- a SIGKILLed driver ----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_sigkilled_driver_leaves_no_resource_tracker_warning_and_no_worker(small_checkpoints, tmp_path):
    """Only the driver is killed: what it started lives on and writes to the same stderr until it exits."""
    import psutil

    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.format(model=small_checkpoints["qwen3_next"], backend="export"))
    marker = tmp_path / "stopped-at"
    env = dict(os.environ, QBUILD_CRASH_AT="convert:start", QBUILD_CRASH_MARKER=str(marker),
               PYTHONPATH=os.pathsep.join([str(STARTUP), str(REPO)]))
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "qbuild.cli", "compile", str(recipe), "--store",
                                 str(tmp_path / "store"), "--lock", str(tmp_path / "lock"), "-j", "2"],
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True, env=env)
        try:
            wait_until(lambda: marker.exists() or proc.poll() is not None, 300, "the convert step to start")
            children = psutil.Process(proc.pid).children(recursive=True)
            assert marker.exists() and children, (tmp_path / "stderr").read_text()
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
            # Every process the driver started exits by itself (a convert step's worker in the middle of its step).
            wait_until(lambda: not [p for p in children if _alive(p)], 30, "the driver's children to exit")
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)   # whatever is left of the session, should the test fail
            except ProcessLookupError:
                pass
    stderr = (tmp_path / "stderr").read_text()
    assert "resource_tracker" not in stderr and "leaked" not in stderr, stderr


def _alive(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
