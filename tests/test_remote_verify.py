"""`qbuild publish --verify-remote` reads back every locked remote blob, whether or not the local store has it."""

from __future__ import annotations

import json
import shutil

import blake3
import pytest

from tests.s3server import shared_server
from tests.test_remote_pipeline import make_project, ok, remote_state, run_qbuild

BUCKET = "qb-verify"


@pytest.fixture(scope="module")
def s3():
    client = shared_server().client()
    client.create_bucket(Bucket=BUCKET)
    return client


def _locked_blobs(lock) -> dict[str, str]:
    """digest -> the first recipe (by name) whose locked nodes name it, for every blob the lockfile names."""
    doc = json.loads(lock.read_text())
    out: dict[str, str] = {}
    for name, r in sorted(doc["recipes"].items()):
        for nid in r["nodes"].values():
            for o in doc["nodes"][nid]["outputs"].values():
                out.setdefault(o["digest"], name)
    return out


def _break_two(s3, prefix: str, blobs: list[str]) -> tuple[str, str]:
    deleted, corrupted = blobs[0], blobs[1]
    s3.delete_object(Bucket=BUCKET, Key=f"{prefix}/cas/{deleted[:2]}/{deleted}")
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/cas/{corrupted[:2]}/{corrupted}", Body=b"not the bytes")
    return deleted, corrupted


def _remote_digest(s3, prefix: str, digest: str) -> str | None:
    try:
        body = s3.get_object(Bucket=BUCKET, Key=f"{prefix}/cas/{digest[:2]}/{digest}")["Body"].read()
    except s3.exceptions.NoSuchKey:
        return None
    return blake3.blake3(body).hexdigest()


@pytest.mark.slow
def test_verify_remote_repairs_from_a_store_that_has_the_blobs_and_names_them_from_one_that_does_not(s3, tmp_path):
    project = make_project(tmp_path / "p")
    remote = f"s3://{BUCKET}/v"
    ok(run_qbuild(project, "compile", "--all", "--store", "store", "--mem", "1T"))
    ok(run_qbuild(project, "publish", "--all", "--store", "store", "--remote", remote))
    locked = _locked_blobs(project / "artifacts.lock")
    host = tmp_path / "host"       # a machine with the lockfile and an empty store
    host.mkdir()
    shutil.copyfile(project / "artifacts.lock", host / "artifacts.lock")

    # A sound remote passes from the empty store, every locked blob read back.
    out = json.loads(ok(run_qbuild(host, "publish", "--all", "--verify-remote", "--store", "s", "--remote", remote,
                                   "--json")).stdout)
    assert out["blobs_present"] == len(locked) and out["blobs_uploaded"] == 0, out

    # (b) From the empty store: exit 3, one line per bad blob naming it and the command that repairs it; the remote
    # is left as it was.
    deleted, corrupted = _break_two(s3, "v", sorted(locked))
    before = remote_state(s3, BUCKET, "v")
    proc = run_qbuild(host, "publish", "--all", "--verify-remote", "--store", "s", "--remote", remote)
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "/cas/" in line]   # the rest is progress
    assert len(lines) == 2 and lines[0].startswith("error: "), proc.stderr
    for line, digest in zip(lines, sorted([deleted, corrupted])):
        assert digest in line and f"qbuild publish {locked[digest]} --verify-remote --remote {remote}" in line, line
        assert ("missing" if digest == deleted else "corrupt") in line, line
    assert remote_state(s3, BUCKET, "v") == before

    # (a) From the store that has them: both re-uploaded, exit 0, and the remote's bytes match again.
    out = json.loads(ok(run_qbuild(project, "publish", "--all", "--verify-remote", "--store", "store", "--remote",
                                   remote, "--json")).stdout)
    assert out["blobs_repaired"] == 2
    assert _remote_digest(s3, "v", deleted) == deleted and _remote_digest(s3, "v", corrupted) == corrupted
    ok(run_qbuild(host, "publish", "--all", "--verify-remote", "--store", "s", "--remote", remote))
