"""Weight conversion (HF -> NxDI layout, tp-independent) and sharding (per tensor-parallel rank).

The layout rules follow docs/nxd-layout.md; each lives once, in the module of its concern:
norms (+1), attention (q/gate split, kv heads, fused Wqkv), deltanet (renames, Qwen3-Next de-interleave, per-rank
[Q|K|V]), mlp / moe (experts, expert parallelism, padding), embeddings (tied head, pad row), vision (renames),
fp8 (quantisation and policies). layout.py assembles them per family; safetensors_header.py and checkpoint.py read
and validate, without torch; convert.py and shard.py are the entry points. shard.py's "cpu" layout is the one
qbuild's reference model reads; nxd.py holds the "nxd-main" / "nxd-main-replicated" / "nxd-moe" layouts, the files NxD
itself writes for the three port lineages.
"""

from __future__ import annotations

import importlib

from qbuild.model.convert.errors import CheckpointError, ShardError

# The entry points import torch, and a header check (checkpoint.py) runs where nothing else needs it: they load when
# first named.
_ENTRY_POINTS = {"convert_checkpoint": "convert", "convert_state_dict": "convert", "shard_checkpoint": "shard",
                 "shard_state_dict": "shard"}

__all__ = ["CheckpointError", "ShardError", *_ENTRY_POINTS]


def __getattr__(name: str):
    if name not in _ENTRY_POINTS:
        raise AttributeError(f"module 'qbuild.model.convert' has no attribute {name!r}")
    return getattr(importlib.import_module(f"qbuild.model.convert.{_ENTRY_POINTS[name]}"), name)
