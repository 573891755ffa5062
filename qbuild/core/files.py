"""Putting files in place: staged writes that readers see whole or not at all, and immutable files placed by link
or copy. Every state write (store, lock, caches) and every laid-out tree goes through these."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from qbuild.core.errors import InfraError

FICLONE = 0x40049409   # linux/fs.h: make dst share src's extents, copy-on-write (btrfs, XFS, bcachefs)


def infra_error(e: OSError, path: Path) -> InfraError:
    """An OSError at `path` as the one-line infrastructure error (exit 3) it is."""
    if e.errno == errno.ENOSPC:
        return InfraError(f"{path}: no space left on device; free space or point --store elsewhere")
    return InfraError(f"{path}: {e.strerror or e}")


# A staged write is `.<name>.partial-<nonce>` beside its destination `<name>`.
PARTIAL = ".partial-"


def staged_for(path: Path) -> str:
    """The destination name a staged write's temporary path is for."""
    return path.name[1:].rpartition(PARTIAL)[0]


@contextmanager
def staged(dst: Path, *, directory: bool = False) -> Iterator[Path]:
    """A temporary path beside `dst` (a new empty directory with `directory`, else a file name to write), renamed to
    `dst` when the block succeeds and removed when it fails, so `dst` is the old one or the complete new one, never
    a part. An empty directory at `dst` is replaced; a non-empty one is refused (FileExistsError)."""
    dst = Path(dst)
    if directory and dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"{dst} already exists and is not an empty directory")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}{PARTIAL}{uuid.uuid4().hex[:12]}"
    if directory:
        tmp.mkdir()
    try:
        yield tmp
        if directory and dst.is_dir():
            dst.rmdir()
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(dst.parent)


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` so readers see the old file or the new one, never a torn one."""
    try:
        with staged(path) as tmp, open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise infra_error(e, path) from None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def link_tree(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> None:
    """link_or_copy every file under `src` to the same relative path under `dst`, but those under a top-level
    folder named in `skip`."""
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if path.is_file() and rel.parts[0] not in skip:
            link_or_copy(path, dst / rel)


def link_or_copy(src: Path, dst: Path) -> None:
    """Place the immutable file `src` at `dst` by hardlink, copying where a link cannot be made (another filesystem,
    a filesystem without links, an inode at its link limit)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise infra_error(e, dst) from None
        shutil.copyfile(src, dst)


def clone_or_copy(src: Path, dst: Path) -> None:
    """A copy of `src` at `dst` that shares no inode with it: a reflink where the filesystem supports one (instant,
    no extra space), else a byte copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if _reflink(src, dst):
        return
    try:
        shutil.copyfile(src, dst)
    except OSError as e:
        raise infra_error(e, dst) from None


def _reflink(src: Path, dst: Path) -> bool:
    """Whether `dst` now shares `src`'s extents; False where the filesystem cannot (ext4, tmpfs, across devices)."""
    import fcntl

    try:
        with open(src, "rb") as s, open(dst, "wb") as d:
            fcntl.ioctl(d.fileno(), FICLONE, s.fileno())
    except OSError:
        return False
    return True


def read_regular(path: Path, *, noatime: bool = False) -> tuple[bytes, os.stat_result]:
    """The bytes of the regular file at `path` and its status, both taken through one descriptor, so they describe
    the same file even while another process replaces or removes the name. FileNotFoundError where nothing is
    there; another OSError where something other than a regular file is (a symlink, a directory; a FIFO answers at
    once instead of blocking). With `noatime` the read leaves the access time alone where the kernel allows it (the
    file's owner), as gc's LRU order needs."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags | (getattr(os, "O_NOATIME", 0) if noatime else 0))
    except PermissionError:
        fd = os.open(path, flags)   # O_NOATIME needs ownership of the file
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks), st
    finally:
        os.close(fd)


def same_file(a: os.stat_result, b: os.stat_result) -> bool:
    """Whether two lstats of one name saw the same file, untouched in between: the same inode (a replacement is a new
    one), and the same size, mtime and ctime (a number the kernel gave again to a file made since, a write, a link,
    a chmod)."""
    return (a.st_dev, a.st_ino, a.st_size, a.st_mtime_ns, a.st_ctime_ns) == \
        (b.st_dev, b.st_ino, b.st_size, b.st_mtime_ns, b.st_ctime_ns)


def discard_path(path: Path) -> None:
    """Remove whatever is at `path` (a file, a link, or a directory someone put where a blob belongs)."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError as e:
        raise infra_error(e, path) from None


def safe_join(root: Path, rel: str) -> Path:
    """`root / rel`, refusing any relative path that would land outside `root`."""
    p = Path(rel)
    if p.is_absolute() or ".." in p.parts or rel in ("", "."):
        raise InfraError(f"refusing path {rel!r}: it would escape {root}")
    return root / p


_NOT_SOURCE_DIRS = {"test", "tests", "__pycache__", ".git"}


def python_sources(root: Path) -> list[Path]:
    """The files whose digests identify a port's source: every .py under `root`, tests excluded, sorted."""
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if not _NOT_SOURCE_DIRS.intersection(rel.parts[:-1]) and path.is_file():
            out.append(path)
    return sorted(out)
