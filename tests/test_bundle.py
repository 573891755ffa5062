"""The bundle manifest: every file with its digest, checked on load; no path may leave the bundle."""

from __future__ import annotations

import json

import pytest

from qbuild.model.bundle import MANIFEST, check_files, read_manifest, write_manifest
from qbuild.core.errors import InfraError, UserError


def _bundle(tmp_path):
    root = tmp_path / "b"
    (root / "weights").mkdir(parents=True)
    (root / "weights" / "tp0_sharded_checkpoint.safetensors").write_bytes(b"w" * 10)
    (root / "config.json").write_text("{}")
    doc = write_manifest(root, {"family": "qwen3_next", "backend": "export", "tp": 1, "ep": 1})
    return root, doc


def test_manifest_lists_every_file_with_digest(tmp_path):
    root, doc = _bundle(tmp_path)
    assert set(doc["files"]) == {"config.json", "weights/tp0_sharded_checkpoint.safetensors"}
    assert doc["files"]["config.json"]["size"] == 2 and len(doc["files"]["config.json"]["digest"]) == 64
    assert read_manifest(root) == doc
    check_files(root, doc)


def test_corrupt_or_missing_file_is_named(tmp_path):
    root, doc = _bundle(tmp_path)
    target = root / "weights" / "tp0_sharded_checkpoint.safetensors"
    target.write_bytes(b"x" * 10)
    with pytest.raises(UserError, match="tp0_sharded_checkpoint.safetensors: content does not match"):
        check_files(root, doc)
    target.write_bytes(b"x" * 12)   # longer, not "truncated": the message says what it found
    with pytest.raises(UserError, match="safetensors: 12 bytes where bundle.json says 10: changed since"):
        check_files(root, doc, digests=False)
    target.unlink()
    with pytest.raises(UserError, match="safetensors: missing"):
        check_files(root, doc)


def test_paths_cannot_escape_the_bundle(tmp_path):
    root, doc = _bundle(tmp_path)
    doc["files"]["../outside"] = {"digest": "0" * 64, "size": 1}
    (root / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(InfraError, match="escape"):
        read_manifest(root)


def test_not_a_bundle(tmp_path):
    with pytest.raises(UserError, match="not a qbuild bundle"):
        read_manifest(tmp_path)


def test_errors_name_the_bundle_as_shown(tmp_path):
    """A bundle laid out where the user did not choose (a locked recipe's, for `run`) is named as the caller says,
    and its files inside that name; the directory itself is never named."""
    root, doc = _bundle(tmp_path)
    shown = "recipes/r.yaml (its locked bundle)"
    (root / "weights" / "tp0_sharded_checkpoint.safetensors").unlink()
    with pytest.raises(UserError) as e:
        check_files(root, doc, shown_as=shown)
    assert str(e.value) == f"{shown}/weights/tp0_sharded_checkpoint.safetensors: missing (bundle.json lists it)"
    (root / MANIFEST).write_text("{")
    with pytest.raises(UserError) as e:
        read_manifest(root, shown)
    assert str(e.value).startswith(f"{shown}/bundle.json: unreadable bundle manifest") and str(root) not in str(e.value)
    (root / MANIFEST).unlink()
    with pytest.raises(UserError) as e:
        read_manifest(root, shown)
    assert str(e.value).startswith(f"{shown}: not a qbuild bundle (no bundle.json)")
