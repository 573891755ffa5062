"""Reliability: corruption found on use, disk full, hostile paths. Engine-level, on toy graphs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from qbuild.core.errors import InfraError
from qbuild.core.files import safe_join
from qbuild.store.local import LocalStore
from qbuild.store.manifest import Manifest
from tests.engine_actions import read_log
from tests.test_engine import _graph, _run


def _flip_byte(path: Path) -> None:
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupt_blob_is_detected_on_use_and_rebuilt(tmp_path):
    log, root = tmp_path / "log", tmp_path / "store"
    first = _graph(log, [("a", "test-sleep", [], 1), ("b", "test-sleep", ["a"], 1)], seconds=0.01)
    result, _ = _run(first, root)
    a_id = list(first.nodes)[0]
    blob = LocalStore(root).blob_path(result.manifests[a_id].outputs["value.txt"]["digest"])
    _flip_byte(blob)
    # A new consumer of `a` (b with other params) must never see the corrupt bytes: `a` is rebuilt first.
    second = _graph(log, [("a", "test-sleep", [], 1), ("b2", "test-sleep", ["a"], 1)], seconds=0.01)
    result2, events = _run(second, root)
    assert result2.ok, result2.failed
    assert any(e.kind == "corrupt" for e in events)
    b2 = result2.manifests[list(second.nodes)[1]]
    assert LocalStore(root).blob_path(b2.outputs["value.txt"]["digest"]).read_text() == "b2(a())"
    assert [e["node"] for e in read_log(log) if e["event"] == "start"].count("a") == 2


def test_store_verify_finds_a_flipped_byte_and_repair_forces_a_rebuild(tmp_path):
    log, root = tmp_path / "log", tmp_path / "store"
    plan = _graph(log, [("a", "test-sleep", [], 1)], seconds=0.01)
    result, _ = _run(plan, root)
    store = LocalStore(root)
    blob = store.blob_path(next(iter(result.manifests.values())).outputs["value.txt"]["digest"])
    _flip_byte(blob)
    problems = store.verify()
    assert any("corrupt blob" in p for p in problems) and any("lost value.txt" in p for p in problems)
    store.verify(repair=True)
    assert store.verify() == []
    result2, _ = _run(plan, root)
    assert len(result2.built) == 1


def test_disk_full_fails_clearly_and_leaves_the_store_consistent(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs is not permitted here")
    try:
        log = tmp_path / "log"
        from qbuild.planning.dag import Plan
        from tests.engine_actions import Big, add

        nodes = {}
        add(nodes, Big, "big", {"name": "big", "log": str(log), "bytes": 4 << 20})
        result, _ = _run(Plan(nodes, {}), mnt / "store")
        (error,) = result.failed.values()
        assert "no space left on device" in error.lower()
        assert LocalStore(mnt / "store").verify() == []
        assert not list((mnt / "store").glob("ac/*/*.json"))
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("rel", ["../escape", "/etc/passwd", "a/../../b", ""])
def test_paths_that_escape_are_refused(tmp_path, rel):
    with pytest.raises(InfraError, match="escape"):
        safe_join(tmp_path, rel)


def test_a_manifest_naming_an_escaping_path_is_never_materialized(tmp_path):
    store = LocalStore(tmp_path / "store")
    src = tmp_path / "x"
    src.write_text("payload")
    digest = store.put_file(src)
    bad = Manifest(key="k" * 64, kind="test", preimage={}, outputs={"../../outside": {"digest": digest, "size": 7}})
    with pytest.raises(InfraError):
        store.materialize(bad.outputs, tmp_path / "dest")
    assert not (tmp_path / "outside").exists()


def test_actions_may_not_emit_symlinks(tmp_path):
    store = LocalStore(tmp_path / "store")
    out = tmp_path / "out"
    out.mkdir()
    (out / "link").symlink_to("/etc/passwd")
    with pytest.raises(InfraError, match="symlink"):
        store.ingest_tree(out)

