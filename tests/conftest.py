"""Shared fixtures: an isolated environment per test and tiny checkpoints made once per run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Commands the tests run plan in process: a resident planner (qbuild.planserver) would outlive the test that started
# it. The tests of the server turn it on for themselves, in a runtime directory of their own, and stop it.
os.environ["QBUILD_PLAN_SERVER"] = "off"


@pytest.fixture(autouse=True)
def isolated_env(tmp_path, monkeypatch):
    """No test reads or writes the user's caches, store, or the Hub."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
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


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, worker_id) -> dict[str, Path]:
    """One seeded tiny checkpoint per family (MoE experts per expert, as save_pretrained writes them), written once
    per run: the first worker to get here writes them while the others wait. Read-only: copy one to damage it."""
    from filelock import FileLock

    from qbuild.families import FAMILIES
    from qbuild.tinymodel import write_tiny_checkpoint

    root = _run_dir(tmp_path_factory, worker_id) / "tiny-checkpoints"
    with FileLock(f"{root}.lock"):
        if not (root / "complete").exists():
            for fam in FAMILIES:
                write_tiny_checkpoint(root / fam, fam)
            (root / "complete").touch()
    return {fam: root / fam for fam in FAMILIES}


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
