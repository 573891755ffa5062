"""The real pipeline through S3: a tiny Qwen3.5 recipe built with the export backend (conftest's dense_project)
and pushed by `compile --push`, then pulled onto an empty machine and run there."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qbuild.core.hashing import digest_file
from tests.s3server import FAKE_CREDENTIALS, s3_env, shared_server
from tests.test_remote_pipeline import assert_no_dangling_manifest, remote_state

BUCKET = "qb-real"


def qb(cwd: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**s3_env(shared_server().endpoint), "XDG_CACHE_HOME": str(cwd / ".cache"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "qbuild.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"qbuild {' '.join(args)}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert not any(v in proc.stdout + proc.stderr for v in FAKE_CREDENTIALS.values())
    return proc


@pytest.mark.slow
def test_real_tiny_bundle_pushed_pulled_and_run_on_an_empty_machine(dense_project, tmp_path):
    client = shared_server().client()
    client.create_bucket(Bucket=BUCKET)
    remote = f"s3://{BUCKET}/ci"
    project = Path(shutil.copytree(dense_project, tmp_path / "project", symlinks=True))

    # Everything is in the local store already: --push uploads what the remote lacks, which is all of it.
    qb(project, "compile", "--all", "-j", "2", "--push", "--store", "store", "--remote", remote)
    lock = json.loads((project / "artifacts.lock").read_text())
    entry = lock["recipes"]["tiny-dense"]
    assert entry["verified"] and entry["bundle"]
    manifests, _ = remote_state(client, BUCKET, "ci")
    assert set(manifests) == {n["key"] for n in lock["nodes"].values()}
    assert_no_dangling_manifest(client, BUCKET, "ci")
    published = json.loads(qb(project, "publish", "--all", "--store", "store", "--remote", remote, "--json").stdout)
    assert published["bytes_uploaded"] == 0 and published["manifests_present"] == len(lock["nodes"])

    host = tmp_path / "host"     # nothing but qbuild and the lockfile
    host.mkdir()
    shutil.copyfile(project / "artifacts.lock", host / "artifacts.lock")
    qb(host, "pull", "tiny-dense", "--to", "bundle", "--store", "store", "--remote", remote)
    package = lock["nodes"][entry["nodes"]["package"]]
    pulled = {p.relative_to(host / "bundle").as_posix(): p for p in (host / "bundle").rglob("*") if p.is_file()}
    assert set(pulled) == set(package["outputs"]) and any(r.endswith(".pt2") for r in pulled)
    assert all(digest_file(pulled[r]) == m["digest"] for r, m in package["outputs"].items())
    assert package["digest"] == entry["bundle"]

    gen = json.loads(qb(host, "run", "bundle", "--prompt-ids", "1,2,3,4,5", "--max-new-tokens", "4",
                        "--json").stdout)
    assert 1 <= len(gen["token_ids"]) <= 4   # greedy decoding may stop early at the end-of-text token
