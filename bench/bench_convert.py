"""Benchmark: what a build's convert + shard steps write and how long they take, against `cp` of the same bytes, on a
synthetic checkpoint with the real Qwen3.5-35B-A3B per-layer shapes (bf16, fused 3D experts E=256 I=512 H=2048,
DeltaNet Hk 16 / Hv 32 / 128, gated attention 16 heads / 2 kv / 256, vocab 248320 embeddings and head, a one-block
vision encoder of the real width), sharded as recipes/35b-a3b-tp8.yaml shards it (NxD's main-port layout, 8 ranks).

    .venv/bin/python bench/bench_convert.py [--layers 2] [--workers 2] [--dir /tmp/qbuild-bench] [--keep]

Two pipelines, each in a child process of its own (peak RSS is the child's VmHWM over its RSS before the work):
- described (what a build does): convert writes the description of the text weights (and the vision weights), shard
  streams the checkpoint through it into the rank files;
- materialized (the build before the description, and `--keep-intermediates` now): convert writes the converted text
  weights, shard reads them.
Each one's outputs are then put into a store of its own as a build commits them, which gives the bytes the build
wrote and the bytes a publish of those steps uploads (unique blobs); the rank files of both must be identical.
Timings include a final `sync`, so every command is measured to the disk, not to the page cache (the source is read
from the page cache in every case: it was just written). Prints a summary and writes bench/results/convert.json.
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from qbuild.model.convert.safetensors_io import PlannedFile  # noqa: E402

# recipes/35b-a3b-tp8.yaml's shard step (`qbuild plan recipes/35b-a3b-tp8.yaml --json`)
SHARD = dict(layout="nxd-main", ranks=dict(world=8, dense_tp=8, moe_tp=8, moe_ep=1), fused_qkv=False, dtype="bfloat16")

H, E, I, SHARED, VOCAB = 2048, 256, 512, 512, 248320
NH, NKV, D = 16, 2, 256
HK, HV, DK, DV, K = 16, 32, 128, 128, 4
VISION = dict(depth=1, hidden_size=1152, intermediate_size=4304, out_hidden_size=2048, num_heads=16,
              num_position_embeddings=2304, in_channels=3, patch_size=16, temporal_patch_size=2, spatial_merge_size=2)


def layer_types(n: int) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 or i == n - 1 else "linear_attention" for i in range(n)]


def config(n: int) -> dict:
    text = dict(model_type="qwen3_5_moe_text", hidden_size=H, num_hidden_layers=n, layer_types=layer_types(n),
                num_attention_heads=NH, num_key_value_heads=NKV, head_dim=D, linear_num_key_heads=HK,
                linear_num_value_heads=HV, linear_key_head_dim=DK, linear_value_head_dim=DV,
                linear_conv_kernel_dim=K, vocab_size=VOCAB, num_experts=E, num_experts_per_tok=8,
                moe_intermediate_size=I, shared_expert_intermediate_size=SHARED, tie_word_embeddings=False)
    return dict(model_type="qwen3_5_moe", text_config=text, vision_config=VISION, tie_word_embeddings=False)


def layer_shapes(i: int, kind: str) -> dict[str, tuple[int, ...]]:
    p = f"model.language_model.layers.{i}."
    s = {f"{p}input_layernorm.weight": (H,), f"{p}post_attention_layernorm.weight": (H,),
         f"{p}mlp.gate.weight": (E, H), f"{p}mlp.experts.gate_up_proj": (E, 2 * I, H),
         f"{p}mlp.experts.down_proj": (E, H, I), f"{p}mlp.shared_expert.gate_proj.weight": (SHARED, H),
         f"{p}mlp.shared_expert.up_proj.weight": (SHARED, H), f"{p}mlp.shared_expert.down_proj.weight": (H, SHARED),
         f"{p}mlp.shared_expert_gate.weight": (1, H)}
    if kind == "full_attention":
        a = f"{p}self_attn."
        s.update({f"{a}q_proj.weight": (NH * 2 * D, H), f"{a}k_proj.weight": (NKV * D, H),
                  f"{a}v_proj.weight": (NKV * D, H), f"{a}o_proj.weight": (H, NH * D),
                  f"{a}q_norm.weight": (D,), f"{a}k_norm.weight": (D,)})
    else:
        a, conv = f"{p}linear_attn.", 2 * HK * DK + HV * DV
        s.update({f"{a}in_proj_qkv.weight": (conv, H), f"{a}in_proj_z.weight": (HV * DV, H),
                  f"{a}in_proj_a.weight": (HV, H), f"{a}in_proj_b.weight": (HV, H), f"{a}conv1d.weight": (conv, 1, K),
                  f"{a}A_log": (HV,), f"{a}dt_bias": (HV,), f"{a}norm.weight": (DV,),
                  f"{a}out_proj.weight": (H, HV * DV)})
    return s


def vision_shapes() -> dict[str, tuple[int, ...]]:
    v, h, m = "model.visual.", VISION["hidden_size"], VISION["hidden_size"] * 4
    s = {f"{v}patch_embed.proj.weight": (h, 3, 2, 16, 16), f"{v}patch_embed.proj.bias": (h,),
         f"{v}pos_embed.weight": (2304, h), f"{v}merger.norm.weight": (h,), f"{v}merger.norm.bias": (h,),
         f"{v}merger.linear_fc1.weight": (m, m), f"{v}merger.linear_fc1.bias": (m,),
         f"{v}merger.linear_fc2.weight": (VISION["out_hidden_size"], m),
         f"{v}merger.linear_fc2.bias": (VISION["out_hidden_size"],)}
    b, inter = f"{v}blocks.0.", VISION["intermediate_size"]
    s.update({f"{b}norm1.weight": (h,), f"{b}norm1.bias": (h,), f"{b}norm2.weight": (h,), f"{b}norm2.bias": (h,),
              f"{b}attn.qkv.weight": (3 * h, h), f"{b}attn.qkv.bias": (3 * h,), f"{b}attn.proj.weight": (h, h),
              f"{b}attn.proj.bias": (h,), f"{b}mlp.linear_fc1.weight": (inter, h),
              f"{b}mlp.linear_fc1.bias": (inter,), f"{b}mlp.linear_fc2.weight": (h, inter),
              f"{b}mlp.linear_fc2.bias": (h,)})
    return s


def synthesize(src: Path, layers: int) -> tuple[int, int]:
    """Write the checkpoint (one file per layer, one for embeddings + vision, an index); (bytes, largest tensor)."""
    src.mkdir(parents=True)
    (src / "config.json").write_text(json.dumps(config(layers), indent=2))
    groups = [{"model.language_model.embed_tokens.weight": (VOCAB, H), "lm_head.weight": (VOCAB, H),
               "model.language_model.norm.weight": (H,), **vision_shapes()}]
    groups += [layer_shapes(i, kind) for i, kind in enumerate(layer_types(layers))]
    block = (torch.randn(1 << 26) * 0.02).bfloat16()  # 128 MiB of noise, tiled: generation stays cheap
    weight_map, total, largest = {}, 0, 0
    for k, shapes in enumerate(groups):
        name = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        f = PlannedFile(src / name, [(n, torch.bfloat16, s) for n, s in shapes.items()])
        for n, s in shapes.items():
            numel = torch.Size(s).numel()
            data = block.repeat(-(-numel // block.numel()))[:numel] if numel > block.numel() else block[:numel]
            f.write(n, data.reshape(s))
            weight_map[n] = name
            total += numel * 2
            largest = max(largest, numel * 2)
        f.close()
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    (src / "tokenizer_config.json").write_text("{}")
    return total, largest


# RSS from /proc/self/status: VmHWM belongs to this process's own address space, whereas ru_maxrss survives exec and
# starts at the (large, torch-synthesising) parent's RSS, which hid the converter's peak entirely.
CHILD = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    from qbuild.model.convert.convert import convert_checkpoint, describe_checkpoint
    from qbuild import backends
    from qbuild.model.convert.shard import shard_checkpoint
    from qbuild.model.ranks import RankLayout
    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
    mode, src, conv, shard, workers = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5])
    digests, shard_args = json.loads(sys.argv[6]), json.loads(sys.argv[7])
    shard_args.update(layout=backends.shard_layout(shard_args["layout"]), ranks=RankLayout(**shard_args["ranks"]))
    files = {p.name: p for p in src.iterdir()}
    base = status("VmRSS")
    t0 = time.perf_counter()
    if mode == "described":
        describe_checkpoint(src, conv, files=files, digests=digests)
    else:
        convert_checkpoint(src, conv, files=files, workers=workers)
    os.sync()
    t1 = time.perf_counter()
    shard_checkpoint(conv, shard, files=files, digests=digests, workers=workers, **shard_args)
    os.sync()
    t2 = time.perf_counter()
    print(json.dumps({"convert_s": t1 - t0, "shard_s": t2 - t1, "base_rss": base, "peak_rss": status("VmHWM")}))
""")


def timed(fn) -> tuple[float, float, object]:
    """(wall seconds including a final sync, CPU seconds of the children it ran, fn's result)."""
    os.sync()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = fn()
    os.sync()
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, out


def copy(root: Path) -> tuple[float, float]:
    """`cp -r` of the checkpoint: (wall, CPU) seconds."""
    wall, cpu, _ = timed(lambda: subprocess.run(["cp", "-r", str(root / "src"), str(root / "cp")], check=True))
    shutil.rmtree(root / "cp")
    return wall, cpu


def run_pipeline(mode: str, root: Path, digests: dict, workers: int) -> dict:
    """One pipeline in a child process, then its outputs committed to a store of its own, as a build commits them."""
    from qbuild.core.hashing import digest_file
    from qbuild.store.local import LocalStore

    conv, shard = root / f"{mode}-convert", root / f"{mode}-shard"
    cmd = [sys.executable, "-c", CHILD, mode, str(root / "src"), str(conv), str(shard), str(workers),
           json.dumps(digests), json.dumps(SHARD)]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    wall, cpu, proc = timed(lambda: subprocess.run(cmd, check=True, capture_output=True, text=True, env=env))
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    ranks = [digest_file(p) for p in sorted((shard / "weights").iterdir())]
    store = LocalStore(root / f"{mode}-store")
    t0 = time.perf_counter()
    outputs = [store.ingest_tree(conv), store.ingest_tree(shard)]
    ingest_s = time.perf_counter() - t0
    blobs = {m["digest"]: m["size"] for out in outputs for m in out.values()}
    stored = sum(p.stat().st_size for p in (store.root / "cas").rglob("*") if p.is_file())
    for d in (conv, shard, store.root):
        shutil.rmtree(d)
    return {"wall_s": wall, "cpu_s": cpu, "convert_s": child["convert_s"], "shard_s": child["shard_s"],
            "steps_s": child["convert_s"] + child["shard_s"],
            "peak_rss_growth": child["peak_rss"] - child["base_rss"], "written_bytes": stored,
            "published_bytes": sum(blobs.values()), "convert_output_bytes": sum(m["size"] for m in outputs[0].values()),
            "ingest_s": ingest_s, "ranks": ranks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (2 -> ~5.5 GB, each more ~1.6 GB)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="cp / described pairs, run back to back; medians")
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "convert.json")
    args = ap.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="qbuild-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        result = bench(root, args.layers, args.workers, args.repeats)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def _median(runs: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in runs), 3)


def bench(root: Path, layers: int, workers: int, repeats: int) -> dict:
    from qbuild.core.hashing import digest_file

    t0 = time.perf_counter()
    total, largest = synthesize(root / "src", layers)
    print(f"synthesised {total / 1e9:.2f} GB ({layers} layers) in {time.perf_counter() - t0:.1f} s; "
          f"largest tensor {largest / 2**20:.0f} MiB", file=sys.stderr)
    # A build keys convert on the snapshot's digests, computed when planning (the stat cache), not by the steps.
    digests = {p.name: "blake3:" + digest_file(p) for p in sorted((root / "src").iterdir())}
    # The disk's speed moves with whatever else the host does: each run of the steps is paired with a cp just
    # before it, and the figures are the medians of the pairs' ratios.
    runs = []
    for _ in range(repeats):
        cp_wall, cp_cpu = copy(root)
        run = run_pipeline("described", root, digests, workers)
        run.update(cp_s=cp_wall, cp_cpu_s=cp_cpu, over_cp=run["steps_s"] / cp_wall,
                   with_startup_over_cp=run["wall_s"] / cp_wall, load=os.getloadavg()[0])
        print(f"described: {json.dumps({k: v for k, v in run.items() if k != 'ranks'})}", file=sys.stderr)
        runs.append(run)
    cp_wall, cp_cpu = copy(root)
    old = run_pipeline("materialized", root, digests, workers)
    old.update(cp_s=cp_wall, over_cp=old["steps_s"] / cp_wall)
    new = runs[0]
    return {
        "checkpoint_bytes": total, "layers": layers, "workers": workers, "largest_tensor_bytes": largest,
        "shard": SHARD, "repeats": repeats, "load_average_1min": _median(runs, "load"),
        "cp_seconds": _median(runs, "cp_s"), "cp_cpu_seconds": _median(runs, "cp_cpu_s"),
        "convert_shard_seconds": _median(runs, "steps_s"), "convert_shard_cpu_seconds": _median(runs, "cpu_s"),
        "convert_shard_over_cp": _median(runs, "over_cp"),
        "convert_shard_with_startup_over_cp": _median(runs, "with_startup_over_cp"),
        "convert_shard_over_cp_each": [round(r["over_cp"], 3) for r in runs],
        "written_over_model": round(new["written_bytes"] / total, 4),
        "published_over_model": round(new["published_bytes"] / total, 4),
        "peak_rss_growth_over_largest_tensor": round(max(r["peak_rss_growth"] for r in runs) / largest, 2),
        "identical_rank_files": all(r["ranks"] == old["ranks"] for r in runs),
        "described": {k: round(v, 2) if isinstance(v, float) else v for k, v in new.items() if k != "ranks"},
        "materialized": {k: round(v, 2) if isinstance(v, float) else v for k, v in old.items() if k != "ranks"},
        "materialized_convert_shard_over_cp": round(old["over_cp"], 3),
        "materialized_written_over_model": round(old["written_bytes"] / total, 4),
        "materialized_peak_rss_growth_over_largest_tensor": round(old["peak_rss_growth"] / largest, 2),
    }


if __name__ == "__main__":
    main()
