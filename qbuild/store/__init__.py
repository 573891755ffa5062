"""Stores: where action outputs live. A local store, optionally backed by a remote one (S3)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .local import LocalStore, atomic_write, safe_join
from .manifest import Manifest, tree_digest

__all__ = ["LocalStore", "Manifest", "StoreSpec", "atomic_write", "default_store_path", "open_store", "safe_join",
           "tree_digest"]


@dataclass(frozen=True)
class StoreSpec:
    """Plain data naming a store, so a worker process can open the same one."""

    local: str
    remote: str | None = None
    push: bool = False


def default_store_path() -> Path:
    """--store, else QBUILD_STORE, else the per-user cache directory."""
    if os.environ.get("QBUILD_STORE"):
        return Path(os.environ["QBUILD_STORE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "qbuild" / "store"


def open_store(spec: StoreSpec) -> LocalStore:
    return LocalStore(Path(spec.local))
