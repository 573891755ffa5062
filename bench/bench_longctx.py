"""Benchmark: long prompts on a CPU bundle of the tiny model, each figure a ratio to a baseline of the same run.

    .venv/bin/python bench/bench_longctx.py [--bucket 128] [--times 21] [--repeats 5] [--width 1]
                                            [--backend export|inductor] [--dir DIR] [--out FILE]

Builds a tiny dense Qwen3.5 bundle (float32, with the CPU backend --backend names) whose largest context-encoding
bucket is --bucket, with chunked prefill in chunks of that bucket, KV buckets doubling from twice the bucket to the
sequence length (as NxDI's token-generation buckets: a piece attends to the KV bucket that holds it, not to the
whole cache) and a prefix cache (blocks of bucket/4 tokens, a DeltaNet checkpoint every bucket), then, on one prompt
of --times x the bucket (at least 8; the tiny model's 4096 positions bound it):
- chunked prefill: time to the first token of the bundle with the cache off (every piece prefilled), against one
  forward of the whole prompt through transformers in the same process (the logits of every position, the first
  token's argmax), the figure the goal compares; and against one prefill of the whole prompt through qbuild's
  reference model (what chunking costs by itself);
- an exact repeat: time to the first token cold (cache empty) against warm (the prompt cached); the warm request
  resumes at the last checkpoint before the prompt's last token and prefills one piece;
- a shared prefix: a prompt with the same first 3/4 and another last 1/4, cold against warm (after the first prompt);
- the prefix cache's peak memory against its budget (blocks x block bytes + slots x checkpoint bytes).
Medians of --repeats timed runs after one untimed run; torch on one thread, as the test suite and build workers run.
Each figure is a ratio of CPU times (this process's), with the ratio of wall times beside it (`..._wall`): on a
shared machine wall time moves with the other work, CPU time hardly. The times to the first token are the runtime's
generate() of one token (prefill, the argmax, and the decoding of one token to text).
Writes the figures as JSON (--out, default bench/results/longctx.json). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# The dense Qwen3.5 of `qbuild tiny` (one Gated DeltaNet and one gated-attention layer; text prompts only). Not an MoE
# family: qbuild's reference MoE runs every expert on every token (exact and static-shaped), four times the expert
# work transformers' routed experts do at top-2 of 8, which would be measured instead of the chunking.
FAMILY = "qwen3_5"


def widened(width: int) -> dict:
    """Text-model overrides that make the tiny model `width` times as wide (the MLP and every head count; the hidden
    size stays 64, which the tiny vision encoder's output is): the same two layers, more work in each operation."""
    return {"intermediate_size": 96 * width, "num_attention_heads": 4 * width, "num_key_value_heads": 2 * width,
            "linear_num_key_heads": 2 * width, "linear_num_value_heads": 4 * width}


def build_bundle(work: Path, bucket: int, times: int, width: int, backend: str = "export") -> tuple[Path, Path]:
    """The tiny checkpoint and its bundle (built with qbuild compile, then pulled). Returns (checkpoint, bundle)."""
    from qbuild.model.tinymodel import write_tiny_checkpoint

    checkpoint = work / "tiny"
    if not checkpoint.exists():
        write_tiny_checkpoint(checkpoint, FAMILY, text_overrides=widened(width) if width > 1 else None)
    seq_len = (times + 1) * bucket
    kv_buckets = [b for b in (bucket * 2 ** i for i in range(1, 16)) if b < seq_len] + [seq_len]
    recipe = work / "recipes" / "longctx.yaml"
    recipe.parent.mkdir(parents=True, exist_ok=True)
    recipe.write_text(
        f"model: {{path: {checkpoint}}}\nbackend: {backend}\ndtype: float32\n"
        f"text:\n  seq_len: {seq_len}\n  cte_buckets: [{bucket // 2}, {bucket}]\n  tkg_buckets: {kv_buckets}\n"
        f"  chunked_prefill: {{chunk_size: {bucket}}}\n"
        f"  prefix_cache: {{block_size: {bucket // 4}, checkpoint_interval: {bucket}, checkpoint_slots: {2 * times}}}\n"
        "verify: {top1_min: 0.99, token_match_min: 1.0, max_logit_err: 0.001, new_tokens: 4}\n")
    env = dict(os.environ, QBUILD_STORE=str(work / "store"), HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    qbuild = [sys.executable, "-m", "qbuild.cli"]
    proc = subprocess.run([*qbuild, "compile", str(recipe), "-j", "2"], cwd=work, env=env, capture_output=True,
                          text=True)
    if proc.returncode:
        raise SystemExit(f"qbuild compile failed:\n{proc.stderr[-4000:]}")
    bundle = work / "bundle"
    if not bundle.exists():
        subprocess.run([*qbuild, "pull", "longctx", "--to", str(bundle)], check=True, cwd=work, env=env,
                       capture_output=True)
    return checkpoint, bundle


def timed(fn, repeats: int, before=None) -> tuple[float, float, object]:
    """Median wall and CPU seconds of fn() over `repeats` runs after one untimed run (`before()` runs untimed before
    each), and the last run's result. CPU time (this process, one torch thread) hardly moves when other work shares
    the machine; wall time does."""
    wall, cpu, result = [], [], None
    for i in range(repeats + 1):
        if before is not None:
            before()
        w, c = time.perf_counter(), time.process_time()
        result = fn()
        if i:
            wall.append(time.perf_counter() - w)
            cpu.append(time.process_time() - c)
    return statistics.median(wall), statistics.median(cpu), result


def reference_prefill(runtime, ids):
    """One prefill of the whole prompt through qbuild's reference model (eager; the code the bundle's graphs trace),
    with the bundle's weights: what the chunking costs, apart from what the reference model costs."""
    import torch

    from qbuild.model.modeling import TextModel, text_position_ids

    m = runtime.manifest
    model = TextModel(runtime.arch, tp=m["tp"], ep=m["ep"], dtype=getattr(torch, m["dtype"]),
                      max_seq_len=ids.shape[1]).eval()
    model.load_state_dict(runtime.weights)
    n = ids.shape[1]

    def run() -> None:
        with torch.no_grad():
            int(model.prefill(ids, text_position_ids(n), torch.tensor([n]))[0][0, -1].argmax())

    return run


def measure(checkpoint: Path, bundle: Path, bucket: int, times: int, repeats: int) -> dict:
    import torch
    import transformers

    from qbuild.model.runtime import Runtime

    torch.set_num_threads(1)
    runtime = Runtime.load(bundle)
    cache = runtime.prefix_cache
    n = times * bucket
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 400, (n,), generator=gen).tolist()
    shared = prompt[:3 * n // 4] + torch.randint(0, 400, (n - 3 * n // 4,), generator=gen).tolist()
    hf = transformers.AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])

    def first_token(p: list[int], use_cache: bool = True):   # the runtime's time to the first token
        return lambda: runtime.generate(p, 1, stop_at_eos=False, use_cache=use_cache)

    def cache_first_prompt() -> None:
        cache.clear()
        runtime.generate(prompt, 1, stop_at_eos=False)

    for _ in range(2):   # first calls of an exported graph and of the allocator are slower than the rest
        runtime.generate(prompt, 1, stop_at_eos=False, use_cache=False)
    with torch.no_grad():
        t = {"whole_forward_transformers": timed(lambda: int(hf(input_ids=ids).logits[0, -1].argmax()), repeats),
             "whole_prefill_reference_model": timed(reference_prefill(runtime, ids), repeats),
             "chunked_prefill": timed(first_token(prompt, use_cache=False), repeats),
             "exact_repeat_cold": timed(first_token(prompt), repeats, before=cache.clear),
             "exact_repeat_warm": timed(first_token(prompt), repeats),
             "shared_prefix_cold": timed(first_token(shared), repeats, before=cache.clear),
             "shared_prefix_warm": timed(first_token(shared), repeats, before=cache_first_prompt)}
    doc = {"family": FAMILY, "largest_bucket": bucket, "prompt_tokens": n, "prompt_x_bucket": times,
           "pieces": len(runtime._pieces(n)), "repeats": repeats}
    for name, (wall, cpu, _) in t.items():
        doc[f"{name}_wall_s"], doc[f"{name}_cpu_s"] = wall, cpu

    def ratio(a: str, b: str, key: str) -> None:   # the CPU-time ratio is the figure; the wall-time one beside it
        doc[key], doc[f"{key}_wall"] = t[a][1] / t[b][1], t[a][0] / t[b][0]

    ratio("chunked_prefill", "whole_forward_transformers", "chunked_vs_whole_forward")
    ratio("chunked_prefill", "whole_prefill_reference_model", "chunked_vs_reference_whole_prefill")
    ratio("exact_repeat_cold", "exact_repeat_warm", "warm_speedup_exact_repeat")
    ratio("shared_prefix_cold", "shared_prefix_warm", "warm_speedup_shared_prefix")
    doc["chunked_tok_s"] = n / t["chunked_prefill"][1]
    doc["first_token_agrees_with_transformers"] = t["chunked_prefill"][2].token_ids[0] == t[
        "whole_forward_transformers"][2]
    for case in ("exact_repeat", "shared_prefix"):
        cold, warm = t[f"{case}_cold"][2], t[f"{case}_warm"][2]
        doc[f"{case}_cached_tokens"] = warm.cached_tokens
        doc[f"{case}_same_tokens"] = warm.token_ids == cold.token_ids
    stats = cache.stats
    doc.update({"cache_peak_bytes": stats.peak_bytes, "cache_budget_bytes": stats.budget_bytes,
                "cache_peak_of_budget": stats.peak_bytes / stats.budget_bytes, "cache_blocks": stats.blocks,
                "cache_checkpoints": stats.checkpoints})
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bucket", type=int, default=128, help="the largest context-encoding bucket (= the chunk)")
    # 21 pieces by default: the prompt PR 173 measured warm against cold on Neuron (10.8K tokens in 512-token chunks)
    ap.add_argument("--times", type=int, default=21, help="the prompt's length in largest buckets (at least 8)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--width", type=int, default=1, help="make the tiny model this many times as wide")
    ap.add_argument("--backend", default="export", choices=["export", "inductor"],
                    help="the CPU backend the bundle is built with")
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir); kept, so a rerun reuses it")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "longctx.json"))
    args = ap.parse_args()
    if args.times < 8 or args.bucket % 4:
        ap.error("--times must be at least 8 and --bucket a multiple of 4")
    work = Path(args.dir or tempfile.mkdtemp(prefix="qbuild-bench-longctx-"))
    work.mkdir(parents=True, exist_ok=True)
    checkpoint, bundle = build_bundle(work, args.bucket, args.times, args.width, args.backend)
    result = {**measure(checkpoint, bundle, args.bucket, args.times, args.repeats), "width": args.width,
              "backend": args.backend}
    for k, v in result.items():
        print(f"{k:40s} {v:.4f}" if isinstance(v, float) else f"{k:40s} {v}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
