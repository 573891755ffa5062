"""This user's directories on this host: one only this user can enter, for sockets and locks that must not be shared
with other users (the NeuronCores lock), private folders of the user's cache directory (the Neuron compile work
directories), never a path shared in /tmp, and the cache directory (what qbuild may recompute, such as the platform
probe's answer)."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def runtime_dir() -> str | None:
    """A directory only this user can enter: $XDG_RUNTIME_DIR, else /tmp/qbuild-<uid> (made 0700). None if neither
    is safe to use."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = base if base and os.path.isdir(base) else os.path.join("/tmp", f"qbuild-{os.getuid()}")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return path


def cache_dir(name: str) -> Path:
    """qbuild's cache directory's <name>, as platformdirs finds the user's cache directory now (on Linux
    $XDG_CACHE_HOME/qbuild/<name>, ~/.cache/qbuild/<name> by default); not made here."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("qbuild")) / name


def private_dir(path: Path) -> Path:
    """`path`, made 0700 where missing. An OSError, or a ValueError saying why, where it is not a directory of this
    user, or other users may write in it."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{path} is not a directory")
    if st.st_uid != os.getuid():
        raise ValueError(f"{path} belongs to another user")
    if st.st_mode & 0o022:
        raise ValueError(f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}); make it 0700")
    return path
