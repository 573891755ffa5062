"""gc: keeps what lockfiles reference (plus an LRU budget locally) and removes exactly the rest, here and on S3."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from qbuild.core.hashing import digest_json
from qbuild.planning.lock import referenced_keys
from qbuild.store.gc import gc_local
from qbuild.store.local import LocalStore
from qbuild.store.manifest import Manifest
from tests.s3server import shared_server
from tests.test_remote_pipeline import (assert_no_dangling_manifest, local_blobs, local_keys, lock_keys, make_project,
                                        ok, remote_state, run_qbuild, write_recipe)

BUCKET = "qb-gc"


@pytest.fixture(scope="module")
def s3():
    client = shared_server().client()
    client.create_bucket(Bucket=BUCKET)
    return client


@pytest.mark.slow
def test_gc_removes_exactly_the_unreferenced_entries_locally_and_remotely(s3, tmp_path):
    project = make_project(tmp_path / "p")
    remote = f"s3://{BUCKET}/p"
    ok(run_qbuild(project, "compile", "--all", "--push", "--store", "store", "--mem", "1T", "--remote", remote))
    write_recipe(project, "beta", tp=2, buckets=[32, 64])        # beta's package and verify change; alpha's do not
    ok(run_qbuild(project, "compile", "--all", "--push", "--store", "store", "--mem", "1T", "--remote", remote))
    store, lock = project / "store", project / "artifacts.lock"
    locked = lock_keys(lock)
    stale = local_keys(store) - locked
    assert stale and locked <= local_keys(store)
    manifests, blobs = remote_state(s3, BUCKET, "p")
    assert set(manifests) - locked == stale

    def named(keys: set[str], docs: dict[str, dict]) -> set[str]:
        return {o["digest"] for k in keys for o in docs[k]["outputs"].values()}

    local_docs = {p.stem: json.loads(p.read_text()) for p in (store / "ac").glob("*/*.json")}
    want_local_blobs = local_blobs(store) - named(locked, local_docs)
    want_remote_blobs = set(blobs) - named(locked, manifests)
    assert want_local_blobs and want_remote_blobs

    # A generous budget keeps everything; --dry-run lists what would go and removes nothing.
    out = ok(run_qbuild(project, "gc", "--keep-size", "1G", "--store", "store")).stdout
    assert out == "" and local_keys(store) == locked | stale
    # --grace 0: the entries were written a moment ago, and within the grace period gc keeps them.
    dry = json.loads(ok(run_qbuild(project, "gc", "--dry-run", "--keep-size", "0", "--grace", "0", "--store", "store",
                                   "--remote", remote, "--json")).stdout)
    assert local_keys(store) == locked | stale and set(remote_state(s3, BUCKET, "p")[0]) == locked | stale

    proc = ok(run_qbuild(project, "gc", "--keep-size", "0", "--grace", "0", "--store", "store", "--remote", remote,
                         "--json"))
    local_report, remote_report = json.loads(proc.stdout)
    assert [r["removed"] for r in dry] == [local_report["removed"], remote_report["removed"]]
    for report, keys, blob_set in ((local_report, stale, want_local_blobs), (remote_report, stale, want_remote_blobs)):
        assert {r["name"] for r in report["removed"] if r["what"] == "manifest"} == keys
        assert {r["name"] for r in report["removed"] if r["what"] == "blob"} == blob_set
        kinds = [r["what"] for r in report["removed"]]
        assert kinds == sorted(kinds, key=["manifest", "blob"].index)    # manifests before blobs
    assert local_keys(store) == locked and local_blobs(store) == named(locked, local_docs)
    manifests, blobs = remote_state(s3, BUCKET, "p")
    assert set(manifests) == locked and set(blobs) == named(locked, manifests)
    assert_no_dangling_manifest(s3, BUCKET, "p")
    ok(run_qbuild(project, "lock", "check", "--store", "store"))

    # The human form names each removal; a second gc has nothing left to do.
    out = ok(run_qbuild(project, "gc", "--keep-size", "0", "--grace", "0", "--store", "store", "--remote",
                        remote)).stdout
    assert out == ""
    host = tmp_path / "host"
    host.mkdir()
    shutil.copyfile(lock, host / "artifacts.lock")
    ok(run_qbuild(host, "pull", "beta", "--to", "bundle", "--store", "s", "--remote", remote))


def _entry(store: LocalStore, name: str, size: int, used: float, shared: Path | None = None) -> Manifest:
    src = store.root.parent / f"{name}.bin"
    src.write_bytes(name.encode() * (size // len(name)))
    outputs = {"out.bin": {"digest": store.put_file(src), "size": size // len(name) * len(name)}}
    if shared is not None:
        outputs["shared.bin"] = {"digest": shared.name, "size": shared.stat().st_size}
    pre = {"entry": name}
    m = Manifest(key=digest_json(pre), kind="compile", preimage=pre, outputs=outputs)
    store.put_manifest(m)
    os.utime(store.manifest_path(m.key), (used, used))
    return m


def _locked_node(m: Manifest) -> dict:
    """A lockfile's node entry for a store entry, as a build writes it (qbuild.planning.lock.NodeEntry.of)."""
    return {"kind": m.kind, "key": m.key, "preimage": m.preimage, "digest": m.digest, "outputs": m.outputs}


def test_local_gc_keeps_the_most_recently_used_within_the_budget(tmp_path):
    store = LocalStore(tmp_path / "store")
    now = time.time()
    shared_src = tmp_path / "shared.src"
    shared_src.write_bytes(b"s" * 1000)
    shared = store.blob_path(store.put_file(shared_src))
    locked = _entry(store, "locked", 5000, now - 9000, shared)
    old = _entry(store, "old", 3000, now - 7000)
    mid = _entry(store, "mid", 3000, now - 5000, shared)
    new = _entry(store, "new", 3000, now - 100)
    orphan_src = tmp_path / "orphan"
    orphan_src.write_bytes(b"orphan")
    orphan = store.put_file(orphan_src)
    doc = tmp_path / "artifacts.lock"
    doc.write_text(json.dumps({"version": 2, "recipes": {}, "nodes": {"n": _locked_node(locked)}}))

    # Budget for two unlocked entries: the two most recently used stay (mid's shared blob is already kept).
    # blobs of two entries plus their small manifests; a grace shorter than every entry's age, so none is in use
    report = gc_local(store, lambda: referenced_keys([doc]), keep_size=7000, grace_s=60)
    gone = {r.name for r in report.removed}
    assert gone == {old.key, old.outputs["out.bin"]["digest"]}
    assert report.young_orphans == 1 and store.has_blob(orphan)
    assert {m.key for m in store.manifests()} == {locked.key, mid.key, new.key}

    report = gc_local(store, lambda: referenced_keys([doc]), keep_size=0, grace_s=0)
    assert {r.name for r in report.removed} == {mid.key, new.key, mid.outputs["out.bin"]["digest"],
                                                new.outputs["out.bin"]["digest"], orphan}
    assert {m.key for m in store.manifests()} == {locked.key} and store.has_blob(shared.name)
    assert sorted(p.name for p in (store.root / "cas").glob("*/*")) == sorted(
        o["digest"] for o in locked.outputs.values())


