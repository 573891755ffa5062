"""This user's directories on this host: one only this user can enter, for sockets and locks that must not be shared
with other users (the NeuronCores lock), and the cache directory (what qbuild may recompute, such as the platform
probe's answer)."""

from __future__ import annotations

import os


def runtime_dir() -> str | None:
    """A directory only this user can enter: $XDG_RUNTIME_DIR, else /tmp/qbuild-<uid> (made 0700). None if neither
    is safe to use."""
    import stat

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


def cache_dir() -> str:
    """qbuild's directory in this user's cache: $XDG_CACHE_HOME/qbuild, else ~/.cache/qbuild (not created here)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "qbuild")
