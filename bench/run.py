"""qbuild benchmarks. Every figure is a ratio to a baseline measured in the same run, on the same bytes.

    python bench/run.py [--only planning,plan_scale,lock,hashing,restore,scheduling,convert,longctx,plan_bytes]
                        [--size-gb 2]
                        [--out bench/results]

Prints a table, then each goal next to its measured value, and writes bench/results/summary.json. The planning
benchmark installs DVC into bench/.dvc-venv the first time, to compare against `dvc repro` and `dvc status` of an
equivalent pipeline.

Commands run this checkout's qbuild (PYTHONPATH), not whichever checkout the venv's `qbuild` script was installed
from, and with bytecode caching on, as for any installed package: PYTHONDONTWRITEBYTECODE in the caller's
environment would otherwise make every run recompile qbuild's modules.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))   # in-process imports (tiny checkpoints, the scheduling bench) use this checkout too
VENV_BIN = Path(sys.executable).parent
QBUILD = str(VENV_BIN / "qbuild")


def timed(cmd: list[str], repeat: int = 5, before=None, **kw) -> float:
    """Median wall time of a command (seconds); `before(i)`, if given, runs untimed before the i-th run."""
    times = []
    for i in range(repeat):
        if before is not None:
            before(i)
        t = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, **kw)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def timed_wall_cpu(cmd: list[str], repeat: int = 11, **kw) -> tuple[float, float]:
    """Median wall time and median CPU time (user + system) of a command, in seconds. CPU time hardly moves when
    other work shares the machine, so its ratios hold where wall-time ratios are noise."""
    wall, cpu = [], []
    for _ in range(repeat):
        before, t = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, **kw)
        wall.append(time.perf_counter() - t)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return statistics.median(wall), statistics.median(cpu)


def bench_env(**extra: str) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                                                          os.environ.get("PYTHONPATH")])))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.update(extra)
    return env


def warm_up(cmd: list[str], **kw) -> None:
    """An untimed run first: it writes the bytecode every later run reads."""
    subprocess.run(cmd, check=True, capture_output=True, **kw)


def _scale_models(hub: Path) -> list[tuple[str, str, str]]:
    """20 models in an HF cache (config.json only: planning never reads weights): 10 dense, 10 MoE, told apart by
    their vocabulary size so that every one has its own compile keys. Returns (repo, family kind, commit) triples: the
    recipes name the commit, as a locked build would, since planning never resolves a branch from the HF cache."""
    models = []
    for i in range(20):
        kind, base = ("dense", "Qwen--Qwen3.5-2B") if i < 10 else ("moe", "Qwen--Qwen3.5-35B-A3B")
        config = json.loads((REPO / "qbuild" / "configs" / f"{base}.json").read_text())
        config["text_config"]["vocab_size"] += 128 * i
        repo, commit = f"bench/m{i:02d}", f"{i:040x}"
        repo_dir = hub / ("models--" + repo.replace("/", "--"))
        (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs" / "main").write_text(commit)
        (repo_dir / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
        (repo_dir / "snapshots" / commit / "config.json").write_text(json.dumps(config))
        models.append((repo, kind, commit))
    return models


# Five parallel layouts per model, each valid for its family (heads, experts, per-rank memory).
_LAYOUTS = {"dense": ["parallel: {tp: 1}", "parallel: {tp: 2}", "parallel: {tp: 4}", "parallel: {tp: 8}",
                      "parallel: {tp: 8}\nfused_qkv: true"],
            "moe": ["parallel: {tp: 4}", "parallel: {tp: 8, ep: 1}", "parallel: {tp: 8, ep: 2}",
                    "parallel: {tp: 8, ep: 4}", "parallel: {tp: 8, ep: 8}"]}


def bench_plan_scale(args) -> dict:
    """`qbuild plan --all --json` of 10, 30 and 100 generated recipes (20 models x 5 parallel layouts), against an
    empty store. Cost per node must not grow with n."""
    work = Path(args.work) / "scale"
    shutil.rmtree(work, ignore_errors=True)
    models = _scale_models(work / "hf" / "hub")
    recipes = []
    for repo, kind, commit in models:
        for j, layout in enumerate(_LAYOUTS[kind]):
            recipes.append((f"{repo.split('/')[1]}-l{j}", f"model: {{hf: {repo}, revision: '{commit}'}}\n"
                                                          f"{layout}\n"
                                                          "text: {seq_len: 512, cte_buckets: [128, 512]}\n"
                                                          "backend: inductor\n"))
    out = {}
    for n in (10, 30, 100):
        ws = work / f"n{n}"
        (ws / "recipes").mkdir(parents=True)
        # Ordered by layout, then model: 10 recipes are 10 models, 100 are every model in every layout.
        for name, text in sorted(recipes, key=lambda r: (r[0][-1], r[0]))[:n]:
            (ws / "recipes" / f"{name}.yaml").write_text(text)
        base = dict(HF_HUB_CACHE=str(work / "hf" / "hub"), XDG_CACHE_HOME=str(ws / "cache"))
        plan = [QBUILD, "plan", "--all", "--json"]
        env = bench_env(**base, QBUILD_STORE=str(ws / "store"))
        warm_up(plan, env=env, cwd=ws)
        nodes = len(json.loads(subprocess.run(plan, env=env, cwd=ws, check=True, capture_output=True,
                                              text=True).stdout)["nodes"])
        took = timed(plan, env=env, cwd=ws, repeat=3)
        out[f"n{n}"] = {"recipes": n, "nodes": nodes, "plan_s": took, "plan_ms_per_node": 1000 * took / nodes}
    args.plan_n100_s = out["n100"]["plan_s"]     # the lock benchmark reports its cost beside it
    return out


def _lock_of(n: int, template: Path) -> "Lock":
    """A lock of `n` recipes shaped like the repository's tiny ones (its entries copied, each copy's steps keyed
    apart by a param of its own): real preimages, toolchains and output lists, ten steps a recipe."""
    from qbuild.core.hashing import digest_json
    from qbuild.planning.lock import Lock, read

    base = read(template)
    recipes, nodes = {}, {}
    for i in range(n):
        name = sorted(base.recipes)[i % len(base.recipes)]
        entry = base.recipes[name]
        roles = {}
        for role, nid in entry.nodes.items():
            node = base.nodes[nid]
            pre = {**node.preimage, "params": {**node.preimage.get("params", {}), "bench_copy": i}}
            roles[role] = f"{nid}-{i}"
            nodes[roles[role]] = node.model_copy(update={"preimage": pre, "key": digest_json(pre)})
        recipes[f"{name}-{i}"] = entry.model_copy(update={"nodes": roles})
    return Lock(recipes=recipes, nodes=nodes)


def bench_lock(args) -> dict:
    """The lockfile's cost at 100 recipes (about 1000 steps): reading it (parse, schema, consistency), merging one
    recipe's entry into it, and writing it (under the flock: read again, merge, canonical JSON, atomic rename), against `qbuild plan --all --json` of 100
    recipes (plan_scale, when it ran first) and against json.loads + json.dumps of the same file."""
    from qbuild.planning.lock import Lock, merge, read, write

    work = Path(args.work) / "lock"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    lock = _lock_of(100, REPO / "artifacts.lock")
    path = work / "artifacts.lock"
    path.write_text(lock.dumps())
    name = sorted(lock.recipes)[0]
    one = Lock(recipes={name: lock.recipes[name]},
               nodes={nid: lock.nodes[nid] for nid in lock.recipes[name].nodes.values()})
    changed = one.model_copy(update={"recipes": {name: one.recipes[name].model_copy(
        update={"verify_failure": None, "recipe": "recipes/moved.yaml"})}})

    def median(fn, repeat: int = 7) -> float:
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    states = itertools.cycle([changed, one])     # each write changes the file
    read(path)     # pydantic builds its validators on first use: once per command, counted apart
    out = {"recipes": len(lock.recipes), "nodes": len(lock.nodes), "bytes": path.stat().st_size,
           "read_s": median(lambda: read(path)), "merge_s": median(lambda: merge(lock, changed)),
           "write_s": median(lambda: write(path, next(states)))}
    out["read_merge_write_s"] = out["read_s"] + out["merge_s"] + out["write_s"]
    text = path.read_text()
    out["json_roundtrip_s"] = median(lambda: json.dumps(json.loads(text), indent=2, sort_keys=True))
    out["ratio_vs_json_roundtrip"] = out["read_merge_write_s"] / out["json_roundtrip_s"]
    plan_s = getattr(args, "plan_n100_s", None)
    if plan_s:
        out["plan_n100_s"] = plan_s
        out["ratio_vs_plan_n100"] = out["read_merge_write_s"] / plan_s
    return out


def _tiny_workspace(root: Path) -> tuple[Path, dict]:
    """The tiny recipes of recipes/tiny (three families, 28 steps) in ./recipes, their checkpoints written and
    everything built into the workspace's store once; returns (cwd, env)."""
    from qbuild.model.tinymodel import write_tiny_checkpoint

    (root / "recipes").mkdir(exist_ok=True)
    shutil.copytree(REPO / "recipes" / "bases", root / "bases", dirs_exist_ok=True)
    for f in sorted((REPO / "recipes" / "tiny").glob("*.yaml")):
        (root / "recipes" / f.name).write_text(f.read_text().replace("../../.qbuild/tiny/", f"{root / 'tiny'}/"))
    for fam in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        if not (root / "tiny" / fam).exists():
            write_tiny_checkpoint(root / "tiny" / fam, fam)
    env = bench_env(QBUILD_STORE=str(root / "store"), XDG_CACHE_HOME=str(root / "cache"))
    subprocess.run([QBUILD, "compile", "--all", "-j", "2"], check=True, cwd=root, env=env, capture_output=True)
    return root, env


def _dvc_pipeline(root: Path, plan_doc: dict) -> Path:
    """A DVC pipeline with the same stages and files as the qbuild plan: one stage per node, same deps."""
    d = root / "dvc"
    if d.exists():
        shutil.rmtree(d)
    d.mkdir()
    stages = {}
    names = {n["id"]: f"{n['kind']}_{n['id'][:8]}" for n in plan_doc["nodes"]}
    for n in plan_doc["nodes"]:
        name = names[n["id"]]
        deps = [f"out/{names[dep]}.bin" for dep in n["deps"].values()] or ["src.bin"]
        stages[name] = {"cmd": f"mkdir -p out && cat {' '.join(deps)} > out/{name}.bin && echo {name} >> out/{name}.bin",
                        "deps": deps, "outs": [f"out/{name}.bin"]}
    (d / "src.bin").write_bytes(os.urandom(1 << 20))
    import yaml

    (d / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}))
    return d


def _dvc_bin(root: Path) -> Path:
    venv = REPO / "bench" / ".dvc-venv"
    if not (venv / "bin" / "dvc").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "dvc>=3,<4"], check=True)
    return venv / "bin" / "dvc"


def bench_planning(args) -> dict:
    """`qbuild plan --all` and a no-op `qbuild compile --all` (everything built) of the tiny recipes, against
    `python -c pass` and against `dvc status` / `dvc repro` of a DVC pipeline with the same stages."""
    root = Path(args.work) / "planning"
    root.mkdir(parents=True, exist_ok=True)
    cwd, env = _tiny_workspace(root)
    plan, plan_json, noop = [QBUILD, "plan", "--all"], [QBUILD, "plan", "--all", "--json"], [QBUILD, "compile", "--all"]
    for cmd in (plan, plan_json, noop):
        warm_up(cmd, env=env, cwd=cwd)
    # The floor: the same libraries (typer, pydantic, PyYAML, rich) reading one recipe and printing a line of it.
    floor = [sys.executable, str(REPO / "bench" / "floor.py"), str(next((cwd / "recipes").glob("*.yaml")))]
    warm_up(floor, env=env, cwd=cwd)
    out = {}
    for name, cmd in (("python_pass", [sys.executable, "-c", "pass"]), ("stack_floor", floor), ("plan", plan),
                      ("plan_json", plan_json), ("noop_compile", noop)):
        out[f"{name}_s"], out[f"{name}_cpu_s"] = timed_wall_cpu(cmd, env=env, cwd=cwd)
    for name in ("stack_floor", "plan", "plan_json", "noop_compile"):
        out[f"{name}_ratio_vs_python"] = out[f"{name}_s"] / out["python_pass_s"]
        out[f"{name}_cpu_ratio_vs_python"] = out[f"{name}_cpu_s"] / out["python_pass_cpu_s"]
    for name in ("plan", "plan_json", "noop_compile"):
        out[f"{name}_ratio_vs_floor"] = out[f"{name}_s"] / out["stack_floor_s"]
    plan_doc = json.loads(subprocess.run(plan_json, env=env, cwd=cwd, check=True, capture_output=True,
                                         text=True).stdout)
    out["stages"] = len(plan_doc["nodes"])
    try:
        dvc = _dvc_bin(root)
    except subprocess.CalledProcessError as e:
        out["dvc"] = f"could not install dvc: {e}"
        return out
    d = _dvc_pipeline(root, plan_doc)
    subprocess.run(["git", "init", "-q"], cwd=d, check=True)
    subprocess.run([str(dvc), "init", "-q"], cwd=d, check=True)
    subprocess.run([str(dvc), "repro", "-q"], cwd=d, check=True, capture_output=True)
    out["dvc_repro_noop_s"], out["dvc_repro_noop_cpu_s"] = timed_wall_cpu([str(dvc), "repro", "-q"], cwd=d, repeat=5)
    out["dvc_status_s"], out["dvc_status_cpu_s"] = timed_wall_cpu([str(dvc), "status", "-q"], cwd=d, repeat=5)
    for name in ("plan", "noop_compile"):
        for dvc_cmd in ("dvc_status", "dvc_repro_noop"):
            versus = dvc_cmd.removesuffix("_noop")
            out[f"{name}_speedup_vs_{versus}"] = out[f"{dvc_cmd}_s"] / out[f"{name}_s"]
            out[f"{name}_cpu_speedup_vs_{versus}"] = out[f"{dvc_cmd}_cpu_s"] / out[f"{name}_cpu_s"]
    return out


def _big_file(path: Path, size: int) -> Path:
    if not path.exists() or path.stat().st_size != size:
        with open(path, "wb") as f:
            chunk = os.urandom(64 << 20)
            for _ in range(size // len(chunk)):
                f.write(chunk)
    return path


def bench_hashing(args) -> dict:
    from qbuild.core.hashing import StatCache, digest_file

    size = int(args.size_gb * (1 << 30))
    f = _big_file(Path(args.work) / "hash.bin", size)
    subprocess.run(["cat", str(f)], stdout=subprocess.DEVNULL, check=True)  # page cache warm for everyone
    t = time.perf_counter()
    digest_file(f)
    ours = time.perf_counter() - t
    sha = timed(["sha256sum", str(f)], repeat=1)
    out = {"bytes": size, "qbuild_blake3_s": ours, "sha256sum_s": sha, "speedup_vs_sha256sum": sha / ours}
    if shutil.which("b3sum"):
        b3 = timed(["b3sum", str(f)], repeat=1)
        out.update({"b3sum_s": b3, "ratio_vs_b3sum": ours / b3})
    # A checkpoint is older than the stat cache's racy window (files modified in the last minute are always hashed).
    old = time.time_ns() - 3600 * 10**9
    os.utime(f, ns=(old, old))
    cache = StatCache(Path(args.work) / "stat.sqlite")
    cache.digest(f)
    t = time.perf_counter()
    cache.digest(f)
    out["rehash_unchanged_s"] = time.perf_counter() - t
    out["rehash_unchanged_ratio"] = out["rehash_unchanged_s"] / ours
    return out


def bench_restore(args) -> dict:
    from qbuild.store.local import LocalStore

    size = int(args.size_gb * (1 << 30))
    work = Path(args.work) / "restore"
    shutil.rmtree(work, ignore_errors=True)
    bundle = work / "bundle"
    (bundle / "weights").mkdir(parents=True)
    for r in range(4):
        _big_file(bundle / "weights" / f"tp{r}_sharded_checkpoint.safetensors", size // 4)
    store = LocalStore(work / "store")
    staged = work / "staged"
    shutil.copytree(bundle, staged)
    outputs = store.ingest_tree(staged)
    t = time.perf_counter()
    store.materialize(outputs, work / "restored")
    ours = time.perf_counter() - t
    t = time.perf_counter()
    subprocess.run(["cp", "-r", str(bundle), str(work / "copied")], check=True)
    cp = time.perf_counter() - t
    shutil.rmtree(work, ignore_errors=True)
    return {"bytes": size, "qbuild_materialize_s": ours, "cp_r_s": cp, "speedup_vs_cp": cp / ours}


def bench_scheduling(args) -> dict:
    from qbuild.execution.engine import BuildOptions, build
    from qbuild.execution.executors.local import LocalExecutor
    from qbuild.planning.dag import Plan
    from qbuild.store.local import LocalStore
    from qbuild.store.spec import StoreSpec
    from tests.engine_actions import Sleep, add

    n, j, d = 8, 2, 1.0
    work = Path(tempfile.mkdtemp(dir=args.work))
    nodes = {}
    for i in range(n):
        add(nodes, Sleep, f"n{i}", {"name": f"n{i}", "log": str(work / "log"), "seconds": d}, recipe="bench")
    opts = BuildOptions(jobs=j)
    t = time.perf_counter()
    res = build(Plan(nodes, {}), LocalStore(work / "store"), StoreSpec(str(work / "store")),
                lambda: LocalExecutor(j), opts)
    took = time.perf_counter() - t
    ideal = math.ceil(n / j) * d
    assert res.ok
    return {"nodes": n, "jobs": j, "node_s": d, "wall_s": took, "ideal_s": ideal, "ratio_to_ideal": took / ideal}


def bench_convert(args) -> dict:
    script = REPO / "bench" / "bench_convert.py"
    if not script.exists():
        return {"skipped": "bench/bench_convert.py not present"}
    out = Path(args.out) / "convert.json"
    # Two decoder layers of the real 35B-A3B shapes plus embeddings are ~5.2 GB: above the 4 GB the target names.
    subprocess.run([sys.executable, str(script), "--layers", "2", "--dir", str(Path(args.work) / "convert"),
                    "--out", str(out)], check=True)
    return json.loads(out.read_text())


def bench_longctx(args) -> dict:
    """Chunked prefill against one transformers forward of the same prompt, warm against cold time to the first
    token, and the prefix cache's peak against its budget (bench/bench_longctx.py), for a bundle of each CPU backend:
    AOTInductor's compiled graphs, and torch.export's graphs run op by op (where dispatching each of a piece's few
    hundred operations costs about as much as the tiny model's arithmetic)."""
    results = {}
    for backend in ("inductor", "export"):
        out = Path(args.out) / f"longctx-{backend}.json"
        subprocess.run([sys.executable, str(REPO / "bench" / "bench_longctx.py"), "--backend", backend, "--dir",
                        str(Path(args.work) / f"longctx-{backend}"), "--out", str(out)], check=True)
        results[backend] = json.loads(out.read_text())
    return results


def bench_plan_bytes(args) -> dict:
    """What `qbuild plan` says a build of each shipped recipe writes beyond its source checkpoint, against the model's
    size (offline: the shipped configs; docs/bytes.md)."""
    proc = subprocess.run([QBUILD, "plan", "--all", "--json", "--lock", str(Path(args.work) / "no.lock")], cwd=REPO,
                          env=bench_env(), check=True, capture_output=True, text=True)
    return {name: entry["bytes"] for name, entry in json.loads(proc.stdout)["recipes"].items()}


BENCHES = {"planning": bench_planning, "plan_scale": bench_plan_scale, "lock": bench_lock, "hashing": bench_hashing,
           "restore": bench_restore, "scheduling": bench_scheduling, "convert": bench_convert,
           "longctx": bench_longctx, "plan_bytes": bench_plan_bytes}


# The targets: (benchmark, figure, comparison, bound, what it says); a figure without a bound is reported beside them.
GOALS = [
    ("planning", "plan_ratio_vs_python", "<=", 6.0, "plan --all, x python -c pass"),
    ("planning", "noop_compile_ratio_vs_python", "<=", 6.0, "no-op compile --all, x python -c pass"),
    ("planning", "plan_speedup_vs_dvc_status", ">=", 5.0, "plan --all, times faster than dvc status"),
    ("planning", "noop_compile_speedup_vs_dvc_repro", ">=", 5.0, "no-op compile --all, times faster than dvc repro"),
    ("plan_scale", ("n100", "plan_s"), "<", 2.0, "plan --all --json of 100 recipes, seconds"),
    ("lock", "ratio_vs_plan_n100", None, None, "lockfile read + merge + write, 100 recipes, x their plan"),
    ("lock", "ratio_vs_json_roundtrip", None, None, "the same, x json.loads + json.dumps of the file"),
    ("longctx", ("inductor", "chunked_vs_whole_forward"), "<=", 1.5,
     "chunked prefill (AOTInductor), x one transformers forward"),
    ("longctx", ("inductor", "warm_speedup_exact_repeat"), ">=", 10.0, "exact repeat (AOTInductor), cold / warm TTFT"),
    ("longctx", ("export", "chunked_vs_whole_forward"), None, None, "chunked prefill (torch.export), x the same"),
    ("longctx", ("export", "warm_speedup_exact_repeat"), None, None, "exact repeat (torch.export), cold / warm TTFT"),
    ("convert", "written_over_model", "<=", 1.02, "convert+shard: bytes written beyond the checkpoint, x model"),
    ("convert", "published_over_model", "<=", 1.02, "convert+shard: bytes a publish uploads, x model"),
    ("convert", "convert_shard_over_cp", "<=", 1.1, "convert+shard wall time, x cp of the model's bytes"),
    ("convert", "peak_rss_growth_over_largest_tensor", "<=", 2.0, "convert+shard peak RSS, x the largest tensor"),
    ("plan_bytes", ("35b-a3b-tp8", "ratio"), "<=", 1.02, "35b-a3b-tp8: bytes its plan will write, x model"),
]


def print_goals(results: dict) -> None:
    print("== goals")
    for bench, figure, op, bound, what in GOALS:
        value = results.get(bench, {})
        for part in (figure if isinstance(figure, tuple) else (figure,)):
            value = value.get(part) if isinstance(value, dict) else None
        if not isinstance(value, (int, float)):
            print(f"   {what:62s} not measured")
            continue
        if op is None:
            print(f"   {what:62s} {value:7.2f} (reported)")
            continue
        met = value <= bound if op == "<=" else value < bound if op == "<" else value >= bound
        print(f"   {what:62s} {value:7.2f} (goal {op} {bound:g}) {'met' if met else 'MISSED'}")
    floor = results.get("planning", {}).get("stack_floor_ratio_vs_python")
    if isinstance(floor, float):
        print(f"   {'(floor: typer+pydantic+yaml+rich doing nothing, x python -c pass)':62s} {floor:7.2f}")


def _flat(figures: dict, prefix: str = "") -> dict:
    """Nested figures (one dict per backend or recipe) as "outer.inner" keys, for the printed table."""
    out = {}
    for k, v in figures.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(BENCHES))
    ap.add_argument("--size-gb", type=float, default=2.0, help="bytes for hashing / restore (GiB)")
    ap.add_argument("--work", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = ap.parse_args()
    args.work = args.work or tempfile.mkdtemp(prefix="qbuild-bench-")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.only.split(","):
        print(f"== {name}", flush=True)
        try:
            results[name] = BENCHES[name](args)
        except Exception as e:  # one failing benchmark must not hide the others' numbers
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        for k, v in _flat(results[name]).items():
            print(f"   {k:28s} {v:.4f}" if isinstance(v, float) else f"   {k:28s} {v}")
    print_goals(results)
    (Path(args.out) / "summary.json").write_text(json.dumps(results, indent=2, sort_keys=True))
    print(f"wrote {Path(args.out) / 'summary.json'}")
    failed = [name for name, figures in results.items() if "error" in figures]
    if failed:
        sys.exit(f"benchmarks that raised: {', '.join(failed)}")


if __name__ == "__main__":
    main()
