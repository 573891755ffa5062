"""Side caches: what a backend keeps in the store beside the CAS and the action cache (a compiler's own cache of its
results), which `qbuild gc` trims with the store's unlocked entries and `qbuild store verify` checks.

The store names none. Each lives under a folder of its own name, in the local store and under the remote's prefix,
and is trimmed in groups: the unit it is used, shared and removed in. A backend registers its own
(qbuild.backends.side_caches; the neuron backend's compile cache is one), and whoever runs gc or verify hands them in.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class CacheGroup:
    """One group of a side cache in the local store, as gc lists it."""

    path: Path
    name: str                      # relative to the cache's folder
    used: float                    # the last time a build used it (gc keeps the most recently used)
    size: int                      # bytes of its files


class SideCache(Protocol):
    name: str                      # its folder under the store root, and its prefix on a remote

    def groups(self, store_root: Path) -> list[CacheGroup]:
        """Every group of this cache in the local store at `store_root`."""

    def remove_group(self, store, group: CacheGroup) -> bool:
        """Remove `group` from `store` (a LocalStore) unless a build holds it or used it since it was listed; returns
        whether it went."""

    def index_blobs(self, remote, key: str) -> set[str]:
        """The digests of the remote CAS blobs that the cache's index object at `key` (under the cache's prefix, a
        `.json` per group) names; InfraError naming an unreadable one."""

    def verify(self, store, repair: bool) -> list[str]:
        """One line per broken entry of this cache in `store` (a LocalStore); with `repair` they are removed."""
