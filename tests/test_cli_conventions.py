"""The command line's conventions: --version, shell completion, choices checked by click (exit 2, naming them),
environment variables declared on the options that read them, compile --json keyed by node id, bench's table
and --json, no process outliving a command, and a plan that loads no heavy library."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import qbuild
from qbuild.backends import NAMES
from tests.conftest import REPO, qbuild as run_qbuild

WIDE = {"COLUMNS": "250"}   # help text unwrapped, so that an option and its env var share a line


def _help_line(command: list[str], option: str) -> str:
    out = run_qbuild(*command, "--help", env=WIDE, check=True).stdout
    (line,) = [line for line in out.splitlines() if f" {option} " in line]
    return line


def test_version_prints_the_package_version_and_exits_0():
    proc = run_qbuild("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"qbuild {qbuild.__version__}\n"


def test_shell_completion_options_are_offered():
    out = run_qbuild("--help", env=WIDE, check=True).stdout
    assert "--install-completion" in out and "--show-completion" in out


@pytest.mark.parametrize("command, option, choices", [
    (["plan", "--all"], "--backend", NAMES),
    (["compile", "--all"], "--backend", NAMES),
    (["compile", "--all"], "--executor", ("local", "ray")),
    (["compile", "--all"], "--progress", ("auto", "plain", "json")),
])
def test_a_value_outside_the_choices_is_a_usage_error_naming_them(tmp_path, command, option, choices):
    proc = run_qbuild(*command, option, "bogus", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Usage:" in proc.stderr and f"Invalid value for '{option}'" in proc.stderr, proc.stderr
    for choice in choices:
        assert repr(choice) in proc.stderr, proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("command, option, envvar", [
    (["plan"], "--store", "QBUILD_STORE"), (["plan"], "--remote", "QBUILD_REMOTE"),
    (["compile"], "--address", "RAY_ADDRESS"), (["gc"], "--store", "QBUILD_STORE"),
    (["pull"], "--remote", "QBUILD_REMOTE"),
])
def test_help_names_the_env_var_an_option_reads(command, option, envvar):
    assert f"[env var: {envvar}]" in _help_line(command, option)


def test_gc_remote_never_reads_the_environment():
    # Deleting shared artifacts takes an explicit --remote: $QBUILD_REMOTE must not be able to point gc at one.
    assert "env var" not in _help_line(["gc"], "--remote")


def test_qbuild_remote_is_honoured(tmp_path):
    # A malformed URL is refused before any work, naming it: proof that plan read the variable.
    proc = run_qbuild("plan", "--all", cwd=tmp_path, env={"QBUILD_REMOTE": "ftp://nowhere"})
    assert proc.returncode == 2 and "ftp://nowhere" in proc.stderr, proc.stderr


def test_ray_address_from_the_environment_does_not_bind_a_local_build(tmp_path):
    # $RAY_ADDRESS is read for --executor ray; a local build ignores it, while an explicit --address is an error.
    from_env = run_qbuild("compile", cwd=tmp_path, env={"RAY_ADDRESS": "auto"})
    assert from_env.returncode == 2 and "--address" not in from_env.stderr, from_env.stderr
    explicit = run_qbuild("compile", "--address", "auto", cwd=tmp_path)
    assert explicit.returncode == 2 and "--address: only used with --executor ray" in explicit.stderr


def test_plan_of_the_tiny_recipes_loads_no_heavy_library(tmp_path, small_checkpoints):
    for f in (REPO / "recipes" / "tiny").glob("*.yaml"):
        text = f.read_text().replace("../../.qbuild/tiny/", str(small_checkpoints["qwen3_5"].parent) + "/")
        (tmp_path / f.name).write_text(text.replace("../bases/", str(REPO / "recipes" / "bases") + "/"))
    code = ("import sys, runpy\n"
            "sys.argv = ['qbuild', 'plan', *sys.argv[1:]]\n"
            "try:\n"
            "    runpy.run_module('qbuild.cli', run_name='__main__')\n"
            "except SystemExit as e:\n"
            "    assert not e.code, e.code\n"
            "print([m for m in ('torch', 'transformers', 'boto3', 'ray') if m in sys.modules], file=sys.stderr)\n")
    recipes = sorted(str(p) for p in tmp_path.glob("*.yaml"))
    proc = subprocess.run([sys.executable, "-c", code, *recipes], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "verify dense-tp2" in proc.stdout
    assert proc.stderr.strip().splitlines()[-1] == "[]", proc.stderr


# --- commands on a built project -------------------------------------------------------------------------------

@pytest.fixture
def project(tmp_path, dense_project) -> Path:
    copy = tmp_path / "project"
    shutil.copytree(dense_project, copy, symlinks=True)
    return copy


@pytest.mark.slow
def test_compile_json_keys_nodes_by_id_with_their_names(project):
    plan = json.loads(run_qbuild("plan", "--all", "--json", "--store", "store", cwd=project, check=True).stdout)
    proc = run_qbuild("compile", "--all", "--json", "--store", "store", cwd=project, check=True)
    doc = json.loads(proc.stdout)
    assert doc["ok"] and doc["failed"] == {}
    assert set(doc["nodes"]) == {n["id"] for n in plan["nodes"]}
    for node in plan["nodes"]:
        assert doc["nodes"][node["id"]] == {"name": node["name"], "kind": node["kind"], "status": "cached"}


@pytest.mark.slow
def test_qbuild_store_is_honoured(project):
    plan = run_qbuild("plan", "--all", "--json", cwd=project, env={"QBUILD_STORE": str(project / "store")}, check=True)
    assert {n["status"] for n in json.loads(plan.stdout)["nodes"]} == {"cached"}


@pytest.mark.slow
def test_bench_prints_a_table_and_with_json_the_document(project, tmp_path):
    """One sweep: the table on stdout, the document in --out (`--json` printing it is tests/test_e2e.py's)."""
    out = tmp_path / "bench.json"
    args = ["bench", "tiny-dense", "--repeats", "1", "--warmup", "0", "--new-tokens", "2", "--store", "store"]
    table = run_qbuild(*args, "--out", str(out), cwd=project, check=True).stdout
    assert table.splitlines()[0].split() == ["prompt", "bucket", "TTFT", "ms", "TPOT", "ms", "tok/s"]
    assert not table.lstrip().startswith("{")
    doc = json.loads(out.read_text())
    assert doc["points"] and all(str(p["prompt_len"]) in table for p in doc["points"])


# --- no process outlives a command -----------------------------------------------------------------------------

def _session_survivors(leader: int) -> list[str]:
    """Processes of the session `leader` started that are still alive (zombies awaiting a wait do not count)."""
    alive = []
    for p in psutil.process_iter(["pid", "status", "cmdline"]):
        try:
            if os.getsid(p.info["pid"]) == leader and p.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(f"{p.info['pid']}: {' '.join(p.info['cmdline'] or [])}")
        except (ProcessLookupError, PermissionError):
            continue
    return alive


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _run_in_new_session(*args: str, cwd: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "qbuild.cli", *args], cwd=cwd, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    descendants = []
    try:
        while proc.poll() is None:
            try:
                descendants += psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
            time.sleep(0.05)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, f"qbuild {' '.join(args)} exited {proc.returncode}:\n{out}\n{err}"
    survivors = _session_survivors(proc.pid) + [f"{p.pid}: {p.name()}" for p in set(descendants) if _alive(p)]
    assert survivors == [], f"qbuild {' '.join(args)} left processes running: {survivors}"


@pytest.mark.slow
def test_no_process_outlives_a_command(project):
    recipe = project / "recipes" / "tiny-dense.yaml"
    # A new verify threshold rebuilds the reference and verify steps: a real compile on the local pool.
    recipe.write_text(recipe.read_text().replace("new_tokens: 2", "new_tokens: 3"))
    store = ["--store", "store"]
    _run_in_new_session("plan", "--all", *store, cwd=project)
    _run_in_new_session("compile", "--all", "-j", "2", *store, cwd=project)
    _run_in_new_session("lock", "check", *store, cwd=project)
    _run_in_new_session("gc", "--dry-run", *store, cwd=project)
