"""A build step may only read its inputs: they are hardlinks to the store's read-only blobs, and root writes through
the read-only bit. A step that opens an input for writing from Python is refused at the call (the audit hook the
suite switches on); a write by any other code (here libc itself, as a C++ or Rust library would write) is found after
the step, which then fails, and the blob it damaged leaves the store so every entry naming it is rebuilt."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest

from qbuild.planning.step import Context, Step
from qbuild.execution.job import AUDIT_ENV, Job, build_job
from qbuild.core.errors import BuildError
from qbuild.core.hashing import digest_file, digest_json
from qbuild.store.local import LocalStore
from qbuild.store.manifest import Manifest
from qbuild.store.spec import StoreSpec

PAYLOAD = b"weights" * 1000


def writer(ctx: Context) -> None:
    """The test step: reads its input, and writes into it the way `ctx.params["how"]` says."""
    path = ctx.inputs["a"] / "w.bin"
    data = path.read_bytes()
    how = ctx.params["how"]
    if how == "python":
        with open(path, "r+b") as f:
            f.write(b"X")
    elif how == "libc":   # no Python open: what a native library does
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.open(os.fsencode(path), os.O_WRONLY)
        assert fd >= 0, os.strerror(ctypes.get_errno())
        assert libc.write(fd, b"X", 1) == 1
        libc.close(fd)
    elif how == "replace":   # a new file at the input's name: the blob is not touched
        tmp = path.with_name("w.tmp")
        tmp.write_bytes(b"X" + data[1:])
        os.replace(tmp, path)
    (ctx.out / "n.txt").write_text(str(len(data)))


class Writer(Step):
    kind, params = "test-write", dict
    run = staticmethod(writer)


def _setup(tmp_path: Path, how: str) -> tuple[LocalStore, Manifest, Job]:
    store = LocalStore(tmp_path / "store")
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(PAYLOAD)
    pre = {"producer": 1}
    produced = Manifest(key=digest_json(pre), kind="convert", preimage=pre, outputs=store.ingest_tree(src))
    store.put_manifest(produced)
    pre = {"consumer": how}
    job = Job(node_id="n1", step=Writer, name=f"write {how}", key=digest_json(pre), preimage=pre,
              params={"how": how}, inputs={"a": produced.outputs}, store_spec=StoreSpec(local=str(store.root)))
    return store, produced, job


def _blob(store: LocalStore, m: Manifest) -> Path:
    return store.blob_path(m.outputs["w.bin"]["digest"])


def test_a_python_write_into_an_input_is_refused_at_the_open(tmp_path, monkeypatch):
    monkeypatch.setenv(AUDIT_ENV, "1")
    store, produced, job = _setup(tmp_path, "python")
    with pytest.raises(BuildError) as e:
        build_job(job, store)
    assert "PermissionError" in str(e.value) and "may only read its inputs" in str(e.value)
    assert digest_file(_blob(store, produced)) == produced.outputs["w.bin"]["digest"]
    assert store.get_manifest(produced.key) == produced and store.get_manifest(job.key) is None
    assert store.verify() == []


@pytest.mark.parametrize("how,audit", [("python", ""), ("libc", "1")])
def test_a_write_into_an_input_fails_the_step_and_drops_the_damaged_blob(tmp_path, monkeypatch, how, audit):
    """The audit hook off (a Python write gets through) or unable to see the write (libc): the check after the step
    finds it by the input's mtime."""
    monkeypatch.setenv(AUDIT_ENV, audit)
    store, produced, job = _setup(tmp_path, how)
    blob = _blob(store, produced)
    with pytest.raises(BuildError) as e:
        build_job(job, store)
    assert f"{job.name}: wrote into its input a/w.bin" in str(e.value) and blob.name[:16] in str(e.value)
    assert not blob.exists()                        # the damaged bytes are gone from the store
    assert store.get_manifest(produced.key) is None  # so the producer is a miss: rebuilt before any use
    assert store.get_manifest(job.key) is None


def test_a_step_that_replaces_an_input_name_leaves_the_blob_alone(tmp_path, monkeypatch):
    monkeypatch.setenv(AUDIT_ENV, "1")
    store, produced, job = _setup(tmp_path, "replace")
    build_job(job, store)
    assert digest_file(_blob(store, produced)) == produced.outputs["w.bin"]["digest"]
    assert store.verify() == []


def test_the_suite_builds_with_the_audit_hook():
    assert os.environ.get(AUDIT_ENV) == "1", "tests/conftest.py switches the audit of input writes on"
