"""Weight conversion (HF -> NxDI layout, tp-independent) and sharding (per tensor-parallel rank).

The layout rules follow docs/nxd-layout.md; each lives once, in the module of its concern:
norms (+1), attention (q/gate split, kv heads, fused Wqkv), deltanet (renames, Qwen3-Next de-interleave, per-rank
[Q|K|V]), mlp / moe (experts, expert parallelism, padding), embeddings (tied head, pad row), vision (renames),
fp8 (quantisation and policies). layout.py assembles them per family; safetensors_header.py and checkpoint.py read
and validate, without torch; convert.py and shard.py are the entry points. description.py makes the converted text
weights data (each tensor's source tensors, rule and dtype: what a build stores instead of the weights), and
converted.py gives the shard step either form, described or materialised. shard.py's "cpu" layout is the one
qbuild's reference model reads; nxd.py holds the "nxd-main" / "nxd-main-replicated" / "nxd-moe" layouts, the files NxD
itself writes for the three port lineages.
"""

from __future__ import annotations

from qbuild.model.convert.errors import CheckpointError, ShardError

__all__ = ["CheckpointError", "ShardError"]
