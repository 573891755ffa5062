"""Remote failures: one line naming the bucket/object, exit code 3, never a credential; interrupted publishes.

Each case runs the real CLI against a real S3 API (moto's server in its own process) or a port nobody listens on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qbuild.core.hashing import digest_json
from qbuild.store.local import LocalStore
from qbuild.store.manifest import Manifest
from tests.s3server import (FAKE_CREDENTIALS, free_port, s3_env, shared_server, start_relay, start_server,
                            stop_process)
from tests.conftest import wait_until
from tests.remote_actions import blob_bytes

BUCKET = "qb-errors"


def make_locked_store(root: Path, files: int, size: int, seed: str = "bundle") -> dict:
    """A local store holding one bundle of `files` blobs of `size` bytes, and artifacts.lock naming it (unverified:
    the lock has no verify step, so pulls pass --allow-unverified)."""
    store = LocalStore(root / "store")
    outputs = {}
    for i in range(files):
        tmp = root / f"part{i}"
        tmp.write_bytes(blob_bytes(f"{seed}/{i}", size))
        outputs[f"weights/part{i:03d}.bin"] = {"digest": store.put_file(tmp), "size": size}
    preimage = {"action": "package", "seed": seed}
    m = Manifest(key=digest_json(preimage), kind="package", preimage=preimage, outputs=outputs)
    store.put_manifest(m)
    node = {"kind": "package", "name": f"package {seed}", "key": m.key, "preimage": preimage, "digest": m.digest,
            "outputs": outputs}
    lock = {"version": 1, "nodes": {"n" + m.key[:15]: node},
            "recipes": {seed: {"recipe": f"recipes/{seed}.yaml", "model": {"source": "path", "revision": None,
                                                                           "files": {}},
                               "nodes": {"package": "n" + m.key[:15]}, "bundle": m.digest, "verified": False}}}
    (root / "artifacts.lock").write_text(json.dumps(lock, indent=2, sort_keys=True) + "\n")
    return lock


def cli(cwd: Path, *args: str, endpoint: str, env: dict | None = None, timeout: float = 120):
    full = {**s3_env(endpoint), "XDG_CACHE_HOME": str(cwd / ".cache"), **(env or {})}
    return subprocess.run([sys.executable, "-m", "qbuild.cli", *args], cwd=cwd, env=full, capture_output=True,
                          text=True, timeout=timeout)


def assert_one_line_infra_error(proc, *fragments: str, secrets: tuple[str, ...] = ()) -> None:
    assert proc.returncode == 3, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stderr.strip().splitlines()   # progress lines may come first; the error is one line, last
    assert lines[-1].startswith("error: s3://") and "Traceback" not in proc.stderr, proc.stderr
    assert sum("error" in line for line in lines) == 1, proc.stderr
    for f in fragments:
        assert f in lines[-1], lines[-1]
    for s in (*FAKE_CREDENTIALS.values(), *secrets):
        assert s not in proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def server():
    srv = shared_server()
    srv.client().create_bucket(Bucket=BUCKET)
    return srv


def test_missing_bucket_and_refused_connection_are_one_line_exit_3(server, tmp_path):
    make_locked_store(tmp_path, files=2, size=1000)
    lock_before = (tmp_path / "artifacts.lock").read_bytes()
    proc = cli(tmp_path, "publish", "--all", "--store", "store", "--remote", "s3://qb-no-such-bucket/p",
               endpoint=server.endpoint)
    assert_one_line_infra_error(proc, "s3://qb-no-such-bucket/p/", "no such bucket qb-no-such-bucket")

    proc = cli(tmp_path, "pull", "bundle", "--to", "out", "--store", "empty", "--remote", "s3://qb-no-such-bucket/p",
               "--allow-unverified", endpoint=server.endpoint)
    assert_one_line_infra_error(proc, "s3://qb-no-such-bucket/p/ac/", "no such bucket")
    assert not (tmp_path / "out").exists()

    port = free_port()   # nothing listens here
    proc = cli(tmp_path, "pull", "bundle", "--to", "out", "--store", "empty", "--remote", f"s3://{BUCKET}/p",
               "--allow-unverified", endpoint=f"http://127.0.0.1:{port}")
    assert_one_line_infra_error(proc, f"s3://{BUCKET}/p/ac/", f"cannot connect to 127.0.0.1:{port}")
    assert (tmp_path / "artifacts.lock").read_bytes() == lock_before


def test_rejected_and_unauthorised_credentials_are_named_never_shown(tmp_path):
    # IAM is enforced after the first three requests: make a bucket, a user without policies, and its key.
    srv = start_server(env={"INITIAL_NO_AUTH_ACTION_COUNT": "3"})
    try:
        import boto3

        kw = dict(endpoint_url=srv.endpoint, region_name="us-east-1", aws_access_key_id="AKIAADMIN000000000000",
                  aws_secret_access_key="admin-secret")
        boto3.client("s3", **kw).create_bucket(Bucket="qb-auth")
        iam = boto3.client("iam", **kw)
        iam.create_user(UserName="nobody")
        key = iam.create_access_key(UserName="nobody")["AccessKey"]
        make_locked_store(tmp_path, files=2, size=1000)

        proc = cli(tmp_path, "publish", "--all", "--store", "store", "--remote", "s3://qb-auth/p",
                   endpoint=srv.endpoint)
        # (the first request is the push's lease, a PUT, whose answer names the rejected key)
        assert_one_line_infra_error(proc, "s3://qb-auth/p/", "access key id was rejected")
        proc = cli(tmp_path, "pull", "bundle", "--to", "out", "--store", "empty", "--remote", "s3://qb-auth/p",
                   "--allow-unverified", endpoint=srv.endpoint)
        assert_one_line_infra_error(proc, "s3://qb-auth/p/ac/", "access key id was rejected")

        nobody = {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
        env = {**nobody, "AWS_SESSION_TOKEN": ""}
        proc = cli(tmp_path, "pull", "bundle", "--to", "out", "--store", "empty", "--remote", "s3://qb-auth/p",
                   "--allow-unverified", endpoint=srv.endpoint, env=env)
        assert_one_line_infra_error(proc, "s3://qb-auth/p/ac/", "access denied", secrets=tuple(nobody.values()))
        assert not (tmp_path / "out").exists()
        lock = (tmp_path / "artifacts.lock").read_text()
        assert not any(s in lock for s in (*FAKE_CREDENTIALS.values(), *nobody.values()))
    finally:
        srv.stop()


@pytest.mark.slow
def test_server_gone_mid_publish_leaves_no_visible_manifest_and_rerun_completes(server, tmp_path):
    files, size = 24, 1 << 20
    lock = make_locked_store(tmp_path, files=files, size=size)
    (node,) = lock["nodes"].values()
    client = server.client()
    prefix = "interrupted"
    relay_port = free_port()
    relay = start_relay(relay_port, server.port, bytes_per_s=2 << 20)   # ~4 uploads at 2 MiB/s each
    try:
        publish = subprocess.Popen(
            [sys.executable, "-m", "qbuild.cli", "publish", "--all", "--store", "store", "--remote",
             f"s3://{BUCKET}/{prefix}"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**s3_env(f"http://127.0.0.1:{relay_port}"), "XDG_CACHE_HOME": str(tmp_path / ".cache")})
        wait_until(lambda: client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/cas/").get("KeyCount")
                   or publish.poll() is not None, 60, "the first blob to land")
        assert publish.poll() is None, "publish ended before any blob landed"
        stop_process(relay, sig=9)   # the server vanishes for the client mid-upload
        out, err = publish.communicate(timeout=90)
    finally:
        stop_process(relay, sig=9)
    assert publish.returncode == 3, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith(f"error: s3://{BUCKET}/{prefix}/") and "cannot connect" in lines[-1], err
    assert "Traceback" not in err and not any(v in out + err for v in FAKE_CREDENTIALS.values())
    landed = {o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/").get("Contents", [])
              if "/leases/" not in o["Key"]}   # the push's lease, which it could not remove once the server was gone
    assert not any("/ac/" in k for k in landed), "a manifest became visible before all its blobs"
    assert 0 < len(landed) < files

    proc = cli(tmp_path, "publish", "--all", "--store", "store", "--remote", f"s3://{BUCKET}/{prefix}", "--json",
               endpoint=server.endpoint)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["blobs_uploaded"] == files - len(landed) and report["blobs_present"] == len(landed)
    assert report["bytes_uploaded"] == (files - len(landed)) * size and report["manifests_uploaded"] == 1
    assert client.head_object(Bucket=BUCKET, Key=f"{prefix}/ac/{node['key'][:2]}/{node['key']}.json")

    proc = cli(tmp_path, "publish", "--all", "--store", "store", "--remote", f"s3://{BUCKET}/{prefix}", "--json",
               endpoint=server.endpoint)
    assert json.loads(proc.stdout)["bytes_uploaded"] == 0

    # and the bundle comes back intact on an empty machine
    proc = cli(tmp_path, "pull", "bundle", "--to", "out", "--store", "empty", "--remote", f"s3://{BUCKET}/{prefix}",
               "--allow-unverified", endpoint=server.endpoint)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "out" / "weights").iterdir()) == [f"part{i:03d}.bin" for i in
                                                                                  range(files)]
    assert (tmp_path / "out" / "weights" / "part007.bin").read_bytes() == blob_bytes("bundle/7", size)


def test_credentials_in_the_endpoint_are_not_echoed(server, tmp_path):
    make_locked_store(tmp_path, files=1, size=10)
    port = free_port()
    proc = cli(tmp_path, "pull", "bundle", "--to", "out", "--store", "empty", "--remote", f"s3://{BUCKET}/p",
               "--allow-unverified", endpoint=f"http://user:hunter2secret@127.0.0.1:{port}")
    assert_one_line_infra_error(proc, f"127.0.0.1:{port}", secrets=("hunter2secret",))


def test_no_remote_means_no_boto3_on_the_planning_path():
    code = ("import sys; import qbuild.cli, qbuild.execution.workspace, qbuild.execution.transfer, qbuild.store.gc, qbuild.store.remote; "
            "from qbuild.store.spec import StoreSpec; from qbuild.store.remote import open_store; open_store(StoreSpec(local='/tmp/x')); "
            "print('boto3' in sys.modules or 'botocore' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("QBUILD_REMOTE")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == "False"


def test_corrupt_local_blob_is_never_uploaded_and_foreign_manifests_are_refused(server, tmp_path, monkeypatch):
    from qbuild.core.errors import InfraError
    from qbuild.store.remote import RemoteStore, push_manifests
    from qbuild.store.s3 import S3Remote

    for k, v in s3_env(server.endpoint).items():
        monkeypatch.setenv(k, v)
    lock = make_locked_store(tmp_path, files=2, size=4096, seed="local-rot")
    (node,) = lock["nodes"].values()
    store = LocalStore(tmp_path / "store")
    meta = min(node["outputs"].values(), key=lambda o: o["digest"])
    blob = store.blob_path(meta["digest"])
    blob.chmod(0o644)
    blob.write_bytes(b"rot" * 1000)
    remote = S3Remote(f"s3://{BUCKET}/rot")
    with pytest.raises(InfraError, match="does not match its digest; not uploading it"):
        push_manifests(store, remote, [store.get_manifest(node["key"])])
    assert not remote.has_blobs([meta["digest"]]) and not remote.has_manifests([node["key"]])

    # A manifest stored under a key its preimage does not hash to is refused, and nothing is recorded.
    doc = json.loads(store.manifest_path(node["key"]).read_text())
    server.client().put_object(Bucket=BUCKET, Key=remote.manifest_key("ab" * 32), Body=json.dumps(doc).encode())
    reader = RemoteStore(LocalStore(tmp_path / "reader"), remote)
    with pytest.raises(InfraError, match="does not belong to key abababababababab"):
        reader.get_manifest("ab" * 32)
    assert not (tmp_path / "reader" / "ac").exists()


def test_lookups_download_no_blobs_and_get_each_manifest_once(server, tmp_path, monkeypatch):
    """A remote hit is checked and returned without its blobs (and kept by the store, so a second lookup does not GET
    it again); ensure_blobs downloads them and records the entry."""
    from qbuild.store.remote import RemoteStore, push_manifests
    from qbuild.store.s3 import S3Remote

    for k, v in s3_env(server.endpoint).items():
        monkeypatch.setenv(k, v)
    lock = make_locked_store(tmp_path, files=3, size=4096, seed="lazy")
    (node,) = lock["nodes"].values()
    remote = S3Remote(f"s3://{BUCKET}/lazy")
    push_manifests(LocalStore(tmp_path / "store"), remote, [LocalStore(tmp_path / "store").get_manifest(node["key"])])

    gets: list[str] = []

    class CountingRemote(S3Remote):
        def get_manifest(self, key):
            gets.append(key)
            return super().get_manifest(key)

    reader_root = tmp_path / "reader"
    reader = RemoteStore(LocalStore(reader_root), CountingRemote(remote.url))
    hit = reader.get_manifest(node["key"])
    assert hit is not None and hit.digest == node["digest"] and gets == [node["key"]]
    assert not (reader_root / "cas").exists() and not (reader_root / "ac").exists()
    assert reader.get_manifest(node["key"]) == hit and gets == [node["key"]]

    reader.materialize(hit.outputs, tmp_path / "out", verify=True)
    assert {p.name for p in (reader_root / "cas").glob("*/*")} == {o["digest"] for o in node["outputs"].values()}
    assert LocalStore(reader_root).get_manifest(node["key"]) == hit     # recorded once all its blobs are local
    assert sorted(p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*")
                  if p.is_file()) == sorted(node["outputs"])


def test_a_workspace_opens_one_store_and_hands_it_its_progress_display(tmp_path):
    from qbuild.render import TransferDisplay
    from qbuild.store.spec import StoreSpec
    from qbuild.store.remote import RemoteStore
    from qbuild.execution.workspace import Workspace

    display = TransferDisplay(bars=False)
    ws = Workspace(StoreSpec(local=str(tmp_path / "s"), remote=f"s3://{BUCKET}/one"), progress=display)
    store = ws.store
    assert isinstance(store, RemoteStore) and ws.store is store
    assert store.progress is display and store.local.root == tmp_path / "s" and store.local.local is store.local
