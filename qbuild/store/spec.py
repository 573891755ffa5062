"""Which store a command uses: a store named as plain data (StoreSpec, so a worker process opens the same one), the
default local store, and the remote a command reads through to (--remote, $QBUILD_REMOTE, ./qbuild.yaml)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from qbuild.core.userdir import cache_dir

CONFIG_FILE = "qbuild.yaml"


@dataclass(frozen=True)
class StoreSpec:
    """Plain data naming a store, so a worker process can open the same one."""

    local: str
    remote: str | None = None           # s3://bucket/prefix: read through to it (see store/remote.py)
    push: bool = False                  # upload every commit to the remote


def default_store_path() -> Path:
    """--store, else QBUILD_STORE, else the per-user cache directory."""
    if os.environ.get("QBUILD_STORE"):
        return Path(os.environ["QBUILD_STORE"])
    return cache_dir("store")


def resolve_remote(flag: str | None, cwd: Path | None = None) -> str | None:
    """--remote, else $QBUILD_REMOTE, else `remote:` in ./qbuild.yaml, else None (no remote)."""
    if flag is not None:
        return flag   # even when empty: `--remote ''` is an error (parse_remote), never "no remote"
    if os.environ.get("QBUILD_REMOTE"):
        return os.environ["QBUILD_REMOTE"]
    config = (cwd or Path.cwd()) / CONFIG_FILE
    if not config.is_file():
        return None
    import yaml

    from qbuild.core.errors import UserError

    try:
        doc = yaml.safe_load(config.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise UserError(f"{config}: unreadable project config: {e}") from None
    remote = doc.get("remote") if isinstance(doc, dict) else None
    if remote is not None and not isinstance(remote, str):
        raise UserError(f"{config}: remote: expected an s3://bucket/prefix string, got {type(remote).__name__}")
    return remote or None
