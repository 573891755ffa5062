"""Weight conversion (HF -> NxDI layout, tp-independent) and sharding (per tensor-parallel rank).

The layout rules follow /work/shared/reference/nxdi-layout.md; each lives once, in the module of its concern:
norms (+1), attention (q/gate split, kv heads, fused Wqkv), deltanet (renames, Qwen3-Next de-interleave, per-rank
[Q|K|V]), mlp / moe (experts, expert parallelism, padding), embeddings (tied head, pad row), vision (renames),
fp8 (quantisation and policies). layout.py assembles them per family; checkpoint.py reads and validates;
convert.py and shard.py are the entry points. shard.py's "cpu" layout is the one qbuild's reference model reads;
nxd.py holds the "nxd-main" / "nxd-moe" layouts, the files NxD itself writes for the two port lineages.
"""

from qbuild.convert.convert import convert_checkpoint, convert_state_dict
from qbuild.convert.errors import CheckpointError, ShardError
from qbuild.convert.shard import shard_checkpoint, shard_state_dict

__all__ = ["CheckpointError", "ShardError", "convert_checkpoint", "convert_state_dict", "shard_checkpoint",
           "shard_state_dict"]
