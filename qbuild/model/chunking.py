"""Where a long prompt is cut into prefill chunks, and which compiled graph runs each: plain data and arithmetic,
shared by the CPU backends' planning (which graphs to compile) and the runtime (which graph to call). No torch.

A bundle with chunked prefill prefills a prompt in pieces of `step` tokens on a fixed grid (0, step, 2*step, ...):
the first piece through a context-encoding graph (it starts from an empty state, which is what those graphs do), every
later piece through the `extend` graph compiled for that step at the smallest KV bucket that holds its slots. With a
prefix cache, `step` is the smaller of the chunk and the DeltaNet checkpoint interval (the recipe checks make one a
multiple of the other), so every checkpoint is a piece boundary: a prefill resumed from a checkpoint then runs exactly
the pieces, through exactly the graphs, with exactly the inputs that the cold prefill ran from there, and its tokens
are the cold prefill's bit for bit. Without a prefix cache, a prompt that fits a context-encoding bucket is one piece,
as it always was.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

EXTEND = "extend"   # the graph kind of the chunk-continuing graphs: extend-<kv bucket>


@dataclass(frozen=True)
class PrefixCacheSpec:
    """A bundle's prefix cache (the recipe's text.prefix_cache, defaults resolved)."""

    block_size: int
    num_blocks: int
    checkpoint_interval: int
    checkpoint_slots: int


@dataclass(frozen=True)
class LongContext:
    """A bundle's long-prompt serving: the prefill chunk and the prefix cache (None: off). bundle.json keeps it
    under "long_context"."""

    chunk_size: int
    prefix_cache: PrefixCacheSpec | None = None

    @property
    def step(self) -> int:
        """The tokens of one prefill piece: the chunk, or the checkpoint interval where that is smaller."""
        if self.prefix_cache is None:
            return self.chunk_size
        return min(self.chunk_size, self.prefix_cache.checkpoint_interval)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict | None) -> "LongContext | None":
        if not doc:
            return None
        cache = doc.get("prefix_cache")
        return cls(doc["chunk_size"], PrefixCacheSpec(**cache) if cache else None)


def pieces(n: int, step: int) -> list[tuple[int, int]]:
    """[start, end) of each prefill piece of a prompt of n tokens, cut at every multiple of `step`."""
    return [(start, min(start + step, n)) for start in range(0, n, step)]


def kv_bucket(end: int, tkg_buckets: list[int]) -> int:
    """The KV bucket an extend piece whose slots end before `end` runs in: the smallest that holds them."""
    return next(b for b in sorted(tkg_buckets) if b >= end)


def extend_buckets(step: int, tkg_buckets: list[int]) -> list[int]:
    """The KV buckets of the extend graphs a bundle needs: those some piece after the first runs in. Pieces start at
    step, 2*step, ... below the largest KV bucket, and each needs `step` slots from its start."""
    kv_len = max(tkg_buckets)
    return sorted({kv_bucket(start + step, tkg_buckets) for start in range(step, kv_len, step)
                   if start + step <= kv_len})
