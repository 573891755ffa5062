"""Sizes and durations on the command line: one parser, so every flag refuses the same spellings the same way."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qbuild.core.errors import UserError
from qbuild.core.units import parse_duration, parse_size

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text, size", [("0", 0), ("20G", 20 << 30), ("20GiB", 20 << 30), ("512m", 512 << 20),
                                        ("1.5T", 3 << 39), ("4096", 4096), (" 1K ", 1024)])
def test_sizes_read_as_binary_units(text, size):
    assert parse_size(text, "--x") == size


@pytest.mark.parametrize("text", ["-5G", "+5G", "1e9", "nan", "inf", "", "5 X", "--"])
def test_sizes_refused(text):
    with pytest.raises(UserError, match=re.escape(f"--x: cannot read {text!r}; use a size like 20G, 512M or 0")):
        parse_size(text, "--x")


def test_durations():
    assert parse_duration("1h", "--g") == 3600 and parse_duration("90s", "--g") == 90 and parse_duration("0", "--g") == 0
    with pytest.raises(UserError, match="^--g: cannot read '-1h'"):
        parse_duration("-1h", "--g")


@pytest.mark.parametrize("args, flag", [(["compile", "--all", "--mem", "-5G"], "--mem"),
                                        (["gc", "--keep-size", "-5G"], "--keep-size")])
def test_a_negative_size_is_one_line_exit_2_before_anything_else(tmp_path, args, flag):
    """No recipes, no lockfile, no store here: the size is read first, and refused the same way for every flag."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "QBUILD_STORE": str(tmp_path / "store")}
    proc = subprocess.run([sys.executable, "-m", "qbuild.cli", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [f"error: {flag}: cannot read '-5G'; use a size like 20G, 512M"
                                        + ("" if flag == "--mem" else " or 0")]
    assert not (tmp_path / "store").exists()
