"""Reading the small files a user points qbuild at (recipes, configs, tokenizers, lockfiles): regular files only,
of a bounded size, so that a FIFO, a device or a runaway file is one error line instead of a hang or an OOM kill."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from qbuild.core.errors import UserError


def read_small_file(path: Path, limit: int, what: str) -> bytes:
    """The bytes of a regular file of at most `limit` bytes; UserError naming `path` otherwise.

    The file is opened non-blocking so that a FIFO or a device answers at once instead of hanging, and is checked
    to be a regular file on the open descriptor (no window between the check and the read).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise UserError(f"{path}: cannot read {what}: {e.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UserError(f"{path}: {what} must be a regular file")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 16, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise UserError(f"{path}: cannot read {what}: {e.strerror}") from None
    finally:
        os.close(fd)
    if size > limit:
        size_text = f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit >> 10} KiB"
        raise UserError(f"{path}: {what} is larger than {size_text}")
    return b"".join(chunks)
