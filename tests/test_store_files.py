"""Staged writes and link-or-copy: a reader sees the old path or the complete new one, never a part."""

from __future__ import annotations

import errno
import os

import pytest

from qbuild.core.errors import InfraError
from qbuild.core.files import atomic_write, link_or_copy, staged


def test_a_failed_staged_directory_leaves_nothing_and_a_good_one_replaces_an_empty_dir(tmp_path):
    dst = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with staged(dst, directory=True) as tmp:
            (tmp / "half").write_text("x")
            raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []
    dst.mkdir()
    with staged(dst, directory=True) as tmp:
        (tmp / "whole").write_text("x")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (dst / "whole").read_text() == "x"
    with pytest.raises(FileExistsError):
        with staged(dst, directory=True):
            pass


def test_atomic_write_replaces_and_names_the_path_on_failure(tmp_path):
    path = tmp_path / "a" / "doc.json"
    atomic_write(path, b"1")
    atomic_write(path, b"2")
    assert path.read_bytes() == b"2" and [p.name for p in path.parent.iterdir()] == ["doc.json"]
    (tmp_path / "file").write_text("")
    with pytest.raises(InfraError, match="file"):
        atomic_write(tmp_path / "file" / "doc.json", b"x")


def test_link_or_copy_links_and_copies_across_filesystems(tmp_path, monkeypatch):
    src = tmp_path / "blob"
    src.write_bytes(b"data")
    link_or_copy(src, tmp_path / "d" / "linked")
    assert os.path.samefile(src, tmp_path / "d" / "linked")

    def cross_device(a, b):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cross_device)   # an OS-level fault: no second filesystem is sure to exist
    link_or_copy(src, tmp_path / "d" / "copied")
    assert (tmp_path / "d" / "copied").read_bytes() == b"data"
    assert not os.path.samefile(src, tmp_path / "d" / "copied")
