"""The SDK worker's environment is hermetic: an allow-list of host variables plus what qbuild sets from the recipe and
the store. A switch a port reads while tracing (Coder-Next's SKIP_MOE_COMPUTE) reaches it only from `port.env`, which
changes the compile's key; from the host it never arrives. Work directories are this user's (0700), never a shared
/tmp path."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from qbuild.backends.neuron import worker_env
from qbuild.core.errors import InfraError
from tests.conftest import qbuild
from tests.nxdi_double import MOE_PORT
from tests.test_neuron_double import Build, compiled, write_recipe

PINS = 'toolchain: {sdk: "2.31.0"}\n'
# What qbuild itself sets for a compile (qbuild.backends.neuron.driver, worker_env).
COMPILE_SET = {"BASE_COMPILE_WORK_DIR", "NEURON_COMPILE_CACHE_URL", "NEURON_LOGICAL_NC_CONFIG",
               "NEURON_PLATFORM_TARGET_OVERRIDE", "TMPDIR"}


def test_the_worker_keeps_only_allow_listed_host_variables(tmp_path):
    host = {"PATH": "/usr/bin", "HOME": "/home/u", "LC_ALL": "C.UTF-8", "PYTHONPATH": "/sdk",
            "SKIP_MOE_COMPUTE": "1", "QWEN36_DELTANET_CTE_IMPL": "legacy", "NEURON_CC_FLAGS": "--cache_dir=/x",
            "NXD_LAYOUT_TRANSFORMATION_OPTIONS": "x", "DISABLE_NUMERIC_CC_TOKEN": "0", "XLA_FLAGS": "--x",
            "AWS_SECRET_ACCESS_KEY": "s", "NEURON_RT_VISIBLE_CORES": "0-1", "BASE_COMPILE_WORK_DIR": "/tmp/nxd_model",
            "TMPDIR": "/tmp"}
    env = worker_env.worker_env({"NEURON_LOGICAL_NC_CONFIG": "2", "SKIP_CONV1D": "1"}, tmp_path, host=host)
    assert set(env) == {"PATH", "HOME", "LC_ALL", "PYTHONPATH", "TMPDIR", "NEURON_LOGICAL_NC_CONFIG", "SKIP_CONV1D"}
    assert env["PATH"].split(os.pathsep) == [str(Path(sys.executable).parent), "/usr/bin"]
    assert env["TMPDIR"] == str(tmp_path / "tmp") and (tmp_path / "tmp").is_dir()
    # A bundle run keeps the NeuronCores it was given, and nothing more.
    run = worker_env.worker_env({}, tmp_path, runtime=True, host=host)
    assert set(run) == {"PATH", "HOME", "LC_ALL", "PYTHONPATH", "TMPDIR", "NEURON_RT_VISIBLE_CORES"}
    assert run["NEURON_RT_VISIBLE_CORES"] == "0-1"


@pytest.mark.parametrize("env, field, needle", [
    ("{NEURON_COMPILE_CACHE_URL: s3://b/p}", "port.env.NEURON_COMPILE_CACHE_URL", "qbuild sets"),
    ("{BASE_COMPILE_WORK_DIR: /tmp/nxd_model}", "port.env.BASE_COMPILE_WORK_DIR", "qbuild sets"),
    ("{NEURON_CC_FLAGS: '--auto-cast matmult --cache_dir=/var/tmp/x'}", "port.env.NEURON_CC_FLAGS", "--cache_dir"),
    ("{NEURON_CC_FLAGS: '--no_cache'}", "port.env.NEURON_CC_FLAGS", "--no_cache"),
])
def test_port_env_may_not_replace_what_qbuild_sets(tmp_path, env, field, needle):
    f = tmp_path / "r.yaml"
    f.write_text(f"model: {{hf: Qwen/Qwen3.5-2B}}\nbackend: neuron\nport: {{path: ./p, env: {env}}}\n"
                 "text: {seq_len: 128, cte_buckets: [64]}\n" + PINS)
    proc = qbuild("recipe", "validate", str(f))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"{field}: " in proc.stderr and needle in proc.stderr and str(f) in proc.stderr


def test_work_dirs_are_this_users_and_never_writable_by_others(tmp_path, monkeypatch):
    from qbuild.backends.neuron import driver

    monkeypatch.delenv("QBUILD_NEURON_WORKDIR", raising=False)
    root = driver.work_root()
    assert root == Path(os.environ["XDG_CACHE_HOME"]) / "qbuild" / driver.WORK_DIR   # conftest's per-test cache
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("QBUILD_NEURON_WORKDIR", str(shared))
    with pytest.raises(InfraError, match="writable by other users") as info:
        driver.work_root()
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_a_host_switch_never_reaches_the_trace_and_port_env_does_and_changes_the_key(tmp_path, small_checkpoints):
    """The tiny Qwen3-Next on the moe lineage, compiled with SKIP_MOE_COMPUTE=1 (and a variable of no meaning) in the
    CLI's environment: the trace saw neither (its MoE traced), and the worker had nothing but allow-listed variables
    and qbuild's. With `port.env: {SKIP_MOE_COMPUTE: "1"}` the trace sees it (no MoE traced) and the compile, and
    what depends on it, has another key."""
    build = Build(tmp_path / "build")
    fields = {"fused_qkv": True, "moe_backend": "shard_on_block"}
    locks = {}
    for name, env in (("host", {}), ("recipe", {"SKIP_MOE_COMPUTE": "1"})):
        recipe = write_recipe(build.root / "recipes" / "next.yaml", small_checkpoints["qwen3_next"], MOE_PORT,
                              port={"lineage": "moe", "env": env}, **fields)
        locks[name] = build.root / f"{name}.lock"
        log = build.root / f"{name}.jsonl"
        result, stderr = build.compile(recipe, lock=locks[name], log=log, SKIP_MOE_COMPUTE="1",
                                       QBUILD_TEST_HOST_ONLY="1")
        compiled(result, stderr)
        (call,) = [c for c in map(json.loads, log.read_text().splitlines()) if c["call"] == "compile"]
        allowed = set(worker_env.HOST) | COMPILE_SET | set(env)
        assert {n for n in call["env_names"] if not n.startswith("LC_")} <= allowed, call["env_names"]
        assert "QBUILD_TEST_HOST_ONLY" not in call["env_names"]
        for neff in call["neffs"]:
            assert neff["traced"]["env"]["SKIP_MOE_COMPUTE"] == env.get("SKIP_MOE_COMPUTE")
            assert (neff["traced"]["experts"] is None) == bool(env)
    docs = {name: json.loads(path.read_text()) for name, path in locks.items()}

    def node(doc: dict, role: str) -> dict:
        return doc["nodes"][doc["recipes"]["next"]["nodes"][role]]

    host, recipe = node(docs["host"], "compile text"), node(docs["recipe"], "compile text")
    assert host["key"] != recipe["key"]
    assert host["preimage"]["params"]["port_env"] == {}
    assert recipe["preimage"]["params"]["port_env"] == {"SKIP_MOE_COMPUTE": "1"}
    assert node(docs["host"], "package")["key"] != node(docs["recipe"], "package")["key"]
