"""Shared fixtures: an isolated environment per test and tiny checkpoints made once per run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parent.parent

# The suite runs two workers on two cores, and each build in it runs steps in two processes of its own: with torch's
# default of a thread per core in every one of them, the threads outnumber the cores and wait on each other (a tiny
# build took 10% more CPU). One thread each, as a Ray worker gets; the steps whose floats depend on the thread count
# set their own (qbuild.core.numerics), so no output changes.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every build the suite runs refuses, from Python, to open a step's input for writing (qbuild/execution/job.py): the
# inputs are hardlinks to the store's blobs, which root could otherwise write through. Not part of any key.
os.environ.setdefault("QBUILD_AUDIT_INPUT_WRITES", "1")


def pytest_runtest_setup(item):
    """Under `--dist loadgroup` a test of an xdist group must carry its group in its node id, or the group is split
    over the workers and each builds the group's module fixture again. pytest-xdist adds the suffix through an
    attribute pytest 9.2 no longer reads, hence the pin in pyproject.toml; this makes a recurrence fail loudly."""
    if getattr(item.config.option, "loadgroup", False) and item.get_closest_marker("xdist_group") \
            and "@" not in item.nodeid:
        pytest.fail("--dist loadgroup left this test out of its xdist group: this pytest-xdist does not work with "
                    "this pytest (see the pin in pyproject.toml)", pytrace=False)


@pytest.fixture(scope="session")
def user_cache_seed(tmp_path_factory, worker_id) -> Path:
    """qbuild's part of a user cache as the first command leaves it, made once per run: this host's platform probe
    (qbuild.core.platform), the map of modules to installed distributions, and the digest and imports of each of
    qbuild's modules (qbuild.planning.closures; each entry is found again only by the file's inode, size, mtime and
    ctime). Every test's fresh cache starts with a copy, instead of importing torch in a subprocess, reading every
    installed distribution's file list and parsing every module of a closure again (half a second a command)."""
    def make(root: Path) -> None:
        env = dict(os.environ, XDG_CACHE_HOME=str(root), PYTHONPATH=str(REPO))
        env.pop("ATEN_CPU_CAPABILITY", None)
        code = ("from qbuild.core.platform import host_tag; host_tag(); "
                "from qbuild.planning.closures import DEFAULT, distribution_versions; distribution_versions(('torch',)); "
                "from pathlib import Path; import qbuild; "
                "[DEFAULT.facts(p) for p in sorted(Path(qbuild.__file__).parent.rglob('*.py'))]")
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)

    return _once_per_run(tmp_path_factory, worker_id, "user-cache", make) / "qbuild"


@pytest.fixture(autouse=True)
def isolated_env(tmp_path, monkeypatch, user_cache_seed):
    """No test reads or writes the user's caches, store, or the Hub. The user cache lies beside tmp_path, so that a
    test may expect tmp_path to hold only what the test made."""
    cache = tmp_path.with_name(f"{tmp_path.name}-xdg-cache")
    shutil.copytree(user_cache_seed, cache / "qbuild")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.setenv("QBUILD_STORE", str(tmp_path / "store"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("QBUILD_REMOTE", raising=False)
    monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    yield


def _run_dir(tmp_path_factory, worker_id: str) -> Path:
    """A directory every xdist worker of this run shares (pytest's own base temp when there are no workers)."""
    base = tmp_path_factory.getbasetemp()
    return base if worker_id == "master" else base.parent


def _once_per_run(tmp_path_factory, worker_id: str, name: str, make: Callable[[Path], None]) -> Path:
    """The directory `name` of this run, made by `make` once: the first worker to get here makes it while the others
    wait; one that died halfway left no marker, so the next starts over."""
    from filelock import FileLock

    root = _run_dir(tmp_path_factory, worker_id) / name
    done = root.with_name(f"{name}.complete")
    with FileLock(f"{root}.lock"):
        if not done.exists():
            shutil.rmtree(root, ignore_errors=True)
            make(root)
            done.touch()
    return root


def _checkpoints(tmp_path_factory, worker_id, name: str, text_overrides: dict | None) -> dict[str, Path]:
    from qbuild.model.families import FAMILIES
    from qbuild.model.tinymodel import write_tiny_checkpoint

    def make(root: Path) -> None:
        for fam in FAMILIES:
            write_tiny_checkpoint(root / fam, fam, text_overrides=text_overrides)

    root = _once_per_run(tmp_path_factory, worker_id, name, make)
    return {fam: root / fam for fam in FAMILIES}


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, worker_id) -> dict[str, Path]:
    """One seeded tiny checkpoint per family with the published layer pattern (three DeltaNet layers, then gated
    attention; MoE experts per expert, as save_pretrained writes them), written once per run: for the model's own
    tests (conversion, sharding, modeling, FP8), which check rules per layer. Read-only: copy one to damage it."""
    from qbuild.model.tinymodel import FOUR_LAYERS

    return _checkpoints(tmp_path_factory, worker_id, "tiny-checkpoints", FOUR_LAYERS)


@pytest.fixture(scope="session")
def small_checkpoints(tmp_path_factory, worker_id) -> dict[str, Path]:
    """What `qbuild tiny` writes for each family: one DeltaNet and one gated-attention layer, written once per run;
    for tests of the build around the model (pipelines, stores, serving), which need every layer kind but not
    several of each. Read-only: copy one to damage it."""
    return _checkpoints(tmp_path_factory, worker_id, "small-checkpoints", None)


DENSE_RECIPE = """name: tiny-dense
model: {{path: {model}}}
text: {{seq_len: 48, cte_buckets: [32], tkg_buckets: [48]}}
dtype: float32
backend: export
verify: {{prompts: ["Hello"], new_tokens: 2, top1_min: 0.99, token_match_min: 1.0, max_logit_err: 0.001}}
"""


@pytest.fixture(scope="session")
def dense_project(tmp_path_factory, worker_id, small_checkpoints) -> Path:
    """A project holding recipes/tiny-dense.yaml (the small Qwen3.5, text only, export backend) built and verified
    into its store/ with its artifacts.lock by the local executor (`qbuild compile --all -j 2`, without -v), once per
    run; what that build printed on stderr is in dense_project_stderr(). Read-only: copy it (shutil.copytree) to
    build on it."""
    def make(root: Path) -> None:
        (root / "recipes").mkdir(parents=True)
        (root / "recipes" / "tiny-dense.yaml").write_text(DENSE_RECIPE.format(model=small_checkpoints["qwen3_5"]))
        caches = root.with_name("dense-project-caches")
        env = {"QBUILD_STORE": "", "XDG_CACHE_HOME": str(caches / "xdg"), "HF_HOME": str(caches / "hf"),
               "HF_HUB_CACHE": "", "HF_HUB_OFFLINE": "1", "QBUILD_REMOTE": ""}
        proc = qbuild("compile", "--all", "-j", "2", "--store", "store", cwd=root, env=env, check=True, timeout=600)
        _stderr_of(root).write_text(proc.stderr)

    return _once_per_run(tmp_path_factory, worker_id, "dense-project", make)


def _stderr_of(project: Path) -> Path:
    return project.with_name(f"{project.name}.stderr")   # beside the project: a copy of it stays a plain project


def dense_project_stderr(project: Path) -> str:
    """The stderr of the build that made conftest's dense_project."""
    return _stderr_of(project).read_text()


def qbuild(*args: str, cwd: Path | None = None, env: dict | None = None, check: bool = False,
           timeout: float = 900) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess, as a user would."""
    full_env = dict(os.environ, **(env or {}))
    # Module- and session-scoped fixtures run before isolated_env sets PYTHONPATH: without this they would run
    # whichever qbuild the venv has installed instead of this checkout's.
    full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "qbuild.cli", *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"qbuild {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def wait_until(condition: Callable[[], object], timeout: float, what: str, interval: float = 0.02):
    """Poll `condition` until it returns something true, and return that; fail naming `what` after `timeout` seconds.
    For an event another process shows only as state (a file it writes, an object on a server): the poll ends the
    moment the state appears, and the deadline turns a hang into a failure."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout:g}s waiting for {what}")
        time.sleep(interval)
    return value
