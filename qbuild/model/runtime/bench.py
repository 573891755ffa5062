"""`qbuild bench`: TTFT / TPOT over a sweep of prompt lengths (16, 64, 256, ... up to the largest CTE bucket)."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from qbuild.core.errors import UserError
from qbuild.model.runtime import Runtime

FILLER = "The quick brown fox jumps over the lazy dog. "


@dataclass
class Point:
    prompt_len: int
    cte_bucket: int
    new_tokens: int
    repeats: int
    ttft_ms: dict           # mean, median, stdev
    tpot_ms: dict
    prefill_tok_s: float    # prompt tokens / mean TTFT
    decode_tok_s: float     # 1 / mean TPOT


def prompt_lengths(largest: int) -> list[int]:
    """16, 64, 256, ... below the largest CTE bucket, then the largest bucket itself."""
    lengths, n = [], 16
    while n < largest:
        lengths.append(n)
        n *= 4
    return lengths + [largest]


def synthetic_prompt(runtime: Runtime, length: int) -> list[int]:
    """`length` token ids of ordinary text (the filler sentence repeated), deterministic."""
    one = runtime.encode(FILLER)
    return (one * (length // len(one) + 1))[:length]


def _stats(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "median": statistics.median(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0}


DEFAULT_NEW_TOKENS = 16


def bench(runtime: Runtime, *, repeats: int = 5, warmup: int = 1, new_tokens: int | None = None,
          lengths: list[int] | None = None) -> list[Point]:
    """Time `repeats` generations of `new_tokens` tokens (None: DEFAULT_NEW_TOKENS, or fewer where the KV cache holds
    fewer after a prompt) at each prompt length. A `new_tokens` the cache cannot hold after the longest prompt is
    refused, never cut short: a point's figures would not be for the count asked."""
    if repeats < 1:
        raise UserError("--repeats must be at least 1")
    lengths = lengths or prompt_lengths(runtime.cte[-1])
    room = runtime.tkg[-1] - max(lengths) + 1    # tokens the KV cache holds after the longest prompt's
    if new_tokens is not None and new_tokens > room >= 2:
        raise UserError(f"--new-tokens {new_tokens}: after the longest prompt ({max(lengths)} tokens) the KV cache "
                        f"({runtime.tkg[-1]} tokens) holds {room} more; pass at most {room}")
    points = []
    for length in lengths:
        steps = min(new_tokens or DEFAULT_NEW_TOKENS, runtime.tkg[-1] - length + 1)
        if steps < 2:
            raise UserError(f"prompt length {length} leaves no room to decode in the KV length {runtime.tkg[-1]}")
        ids = synthetic_prompt(runtime, length)
        # The prefix cache off: every run of the same prompt would otherwise be answered from it after the first.
        runs = [runtime.generate(ids, steps, stop_at_eos=False, use_cache=False)
                for _ in range(warmup + repeats)][warmup:]
        ttft, tpot = _stats([r.ttft_ms for r in runs]), _stats([r.tpot_ms for r in runs])
        points.append(Point(length, runs[0].cte_bucket, steps, repeats, ttft, tpot,
                            prefill_tok_s=length / ttft["mean"] * 1e3, decode_tok_s=1e3 / tpot["mean"]))
    return points


def to_json(points: list[Point], manifest: dict) -> dict:
    return {"backend": manifest["backend"], "family": manifest["family"], "tp": manifest["tp"], "ep": manifest["ep"],
            "dtype": manifest["dtype"], "points": [asdict(p) for p in points]}
