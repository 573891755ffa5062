"""Weight conversion (HF -> NxDI layout, tp-independent) and sharding (per tensor-parallel rank).

The layout rules follow docs/nxd-layout.md; each lives once, in the module of its concern:
norms (+1), attention (q/gate split, kv heads, fused Wqkv), deltanet (renames, Qwen3-Next de-interleave, per-rank
[Q|K|V]), mlp / moe (experts, expert parallelism), embeddings (tied head, pad row), vision (renames),
fp8 (quantization and policies). layout.py assembles them per family; safetensors_header.py and checkpoint.py read
and validate, without torch; convert.py and shard.py are the entry points. description.py makes the converted text
weights data (each tensor's source tensors, rule and dtype: what a build stores instead of the weights), and
converted.py gives the shard step either form, described or materialized. parallel.py says what a shard layout is
(its ranks are a qbuild.model.ranks.RankLayout); shard.py streams any layout's program into rank files and holds the
"cpu" layout, the one qbuild's reference model reads. A backend whose runtime loads other files keeps their layout
itself (the neuron backend: NxD's files for its port lineages).
"""

from __future__ import annotations

from qbuild.model.convert.errors import CheckpointError, ShardError

__all__ = ["CheckpointError", "ShardError"]
