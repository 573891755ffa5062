"""The lockfile through the flows CI and serving hosts run, with the real tiny recipes and the real steps: a build
that reproduces the lock leaves it byte-identical on fresh stores, whatever the order recipes are named or built in;
compile, publish and pull through a loopback S3 server give a verified bundle, with and without --frozen."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.s3server import s3_env, shared_server

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("lock-flows")]

TINY = ("dense-tp2", "moe-tp2-ep2", "next-tp1")
BUCKET = "qb-lock-flows"


def qb(project: Path, store: Path, *args: str, remote: bool = False) -> subprocess.CompletedProcess:
    env = {**s3_env(shared_server().endpoint)} if remote else {}
    env.update(XDG_CACHE_HOME=str(project / ".cache"), HF_HUB_OFFLINE="1", QBUILD_STORE=str(store),
               PYTHONPATH=str(REPO))
    full = {**{k: v for k, v in os.environ.items() if not k.startswith("QBUILD_")}, **env}
    proc = subprocess.run([sys.executable, "-m", "qbuild.cli", *args], cwd=project, env=full, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, f"qbuild {' '.join(args)}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def _project(root: Path, small_checkpoints) -> Path:
    """The repository's tiny recipes in a project of their own, their checkpoints where `make demo` writes them."""
    shutil.copytree(REPO / "recipes" / "tiny", root / "recipes" / "tiny")
    shutil.copytree(REPO / "recipes" / "bases", root / "recipes" / "bases")
    (root / ".qbuild" / "tiny").mkdir(parents=True)
    for family, path in small_checkpoints.items():
        (root / ".qbuild" / "tiny" / family).symlink_to(path)
    return root


def _recipes(*names: str) -> list[str]:
    return [f"recipes/tiny/{n}.yaml" for n in names]


@pytest.fixture(scope="module")
def locked(tmp_path_factory, small_checkpoints) -> tuple[Path, bytes]:
    """The tiny recipes built in one command on an empty store (-j 2): (the project, its lockfile's bytes)."""
    project = _project(tmp_path_factory.mktemp("lock-flows") / "project", small_checkpoints)
    qb(project, project / "store", "compile", *_recipes(*TINY), "-j", "2")
    return project, (project / "artifacts.lock").read_bytes()


def test_a_build_on_a_fresh_store_leaves_the_lock_byte_identical_every_time(locked, tmp_path):
    """CI's runner: a fresh store, the committed lock, no --frozen. Every step runs again and gives the locked bytes,
    so the lock must come out as it went in, run after run (it lost the verify node every other run)."""
    project, lock = locked
    work = Path(shutil.copytree(project, tmp_path / "p", symlinks=True, ignore=shutil.ignore_patterns("store")))
    doc = json.loads(lock)
    assert all(doc["recipes"][n]["verified"] for n in TINY)
    for run in range(2):
        out = json.loads(qb(work, tmp_path / f"store-{run}", "compile", *_recipes("dense-tp2"), "-j", "2",
                            "--json").stdout)
        assert out["cached"] == [] and len(out["built"]) == len(doc["recipes"]["dense-tp2"]["nodes"])
        assert (work / "artifacts.lock").read_bytes() == lock, f"run {run} changed the lock"


def test_the_lock_is_the_same_built_in_one_command_or_several_in_any_order(locked, tmp_path):
    project, lock = locked
    work = Path(shutil.copytree(project, tmp_path / "p", symlinks=True, ignore=shutil.ignore_patterns("store")))
    # Three commands on an empty store, in another order, one step at a time.
    (work / "artifacts.lock").unlink()
    for name in reversed(TINY):
        qb(work, tmp_path / "store", "compile", *_recipes(name), "-j", "1")
    assert (work / "artifacts.lock").read_bytes() == lock
    # One command naming them in another order, everything cached.
    (work / "artifacts.lock").unlink()
    qb(work, tmp_path / "store", "compile", *_recipes("next-tp1", "dense-tp2", "moe-tp2-ep2"))
    assert (work / "artifacts.lock").read_bytes() == lock
    qb(work, tmp_path / "store", "compile", *_recipes("moe-tp2-ep2", "next-tp1", "dense-tp2"), "--frozen")


def test_two_recipes_sharing_every_step_lock_alike_whichever_was_built_last(locked, tmp_path):
    """A copy of a recipe under another name plans the same steps (one node each): which recipe was compiled last, or
    named first, must not show in the lock, and --frozen must hold in either order."""
    project, _ = locked
    work = Path(shutil.copytree(project, tmp_path / "p", symlinks=True, ignore=shutil.ignore_patterns("store")))
    shutil.copyfile(work / "recipes/tiny/next-tp1.yaml", work / "recipes/tiny/twin.yaml")
    store = project / "store"     # every step of both is built there: nothing here builds
    qb(work, store, "compile", *_recipes("next-tp1", "twin"))
    both = (work / "artifacts.lock").read_bytes()
    qb(work, store, "compile", *_recipes("twin", "next-tp1"), "--frozen")
    for last in ("twin", "next-tp1", "twin"):
        qb(work, store, "compile", *_recipes(last))
        assert (work / "artifacts.lock").read_bytes() == both
        qb(work, store, "compile", *_recipes("next-tp1", "twin"), "--frozen")


def test_compile_publish_then_pull_on_another_store_gives_the_verified_bundle(locked, tmp_path):
    """CI builds on a fresh store without --frozen and publishes; a second CI job on another fresh store builds
    --frozen from the remote; a serving host with the lockfile alone pulls every bundle, verified."""
    project, lock = locked
    client = shared_server().client()
    client.create_bucket(Bucket=BUCKET)
    remote = f"s3://{BUCKET}/ci"
    ci = Path(shutil.copytree(project, tmp_path / "ci", symlinks=True, ignore=shutil.ignore_patterns("store")))
    qb(ci, tmp_path / "ci-store", "compile", *_recipes(*TINY), "-j", "2")
    assert (ci / "artifacts.lock").read_bytes() == lock
    qb(ci, tmp_path / "ci-store", "publish", "--all", "--remote", remote, remote=True)
    again = json.loads(qb(ci, tmp_path / "ci-store-2", "compile", *_recipes(*TINY), "--frozen", "--remote", remote,
                          "--json", remote=True).stdout)
    assert again["built"] == [] and (ci / "artifacts.lock").read_bytes() == lock
    host = tmp_path / "host"     # nothing but the lockfile and an empty store
    host.mkdir()
    shutil.copyfile(ci / "artifacts.lock", host / "artifacts.lock")
    for name in TINY:
        pulled = json.loads(qb(host, host / "store", "pull", name, "--to", f"bundles/{name}", "--remote", remote,
                               "--json", remote=True).stdout)
        assert pulled["digest"] == json.loads(lock)["recipes"][name]["bundle"]
        assert (host / "bundles" / name / "bundle.json").is_file()
