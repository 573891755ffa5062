"""The CPU backends (export, inductor): one class, parameterised by name, that plans, compiles, packages and runs a
recipe's graphs on this host's CPUs.

Each graph (a submodel at one bucket) is its own compile node, with no weights at all: <graph>-<bucket>.pt2 (a
torch.export program or an AOTInductor package; weights are graph inputs) and <graph>-<bucket>.json (its call
signature). Timings go to the log, never into outputs, so the same key gives byte-identical artifacts on any machine.
"""

from __future__ import annotations

from pathlib import Path

from qbuild.backends.base import PromptRun
from qbuild.backends.cpu.params import CpuCompile, CpuTextCompile, CpuVisionCompile, graph_file
from qbuild.core import jsonio
from qbuild.core.dtypes import DTYPE_BYTES
from qbuild.core.errors import BuildError
from qbuild.core.units import GIB
from qbuild.model.arch import Arch
from qbuild.model.chunking import EXTEND, LongContext, PrefixCacheSpec, extend_buckets
from qbuild.model.ranks import RankLayout
from qbuild.planning.backend import BackendPlan, Sizes
from qbuild.planning.step import Context, PlannedNode
from qbuild.recipe import checks
from qbuild.recipe.params import PackageParams, ShardParams
from qbuild.recipe.schema import LoadedRecipe

# The file format each backend's graphs are written in; the runtime loads a graph by it (qbuild.model.runtime).
_FORMATS = {"export": "exported-program", "inductor": "aoti-package"}
# An AOTInductor package holds a shared library compiled for this host (machine, libc, Python, the CPU's vector
# unit); a torch.export program is a graph any platform's torch runs.
_NATIVE = {"export": False, "inductor": True}


def long_context(loaded: LoadedRecipe) -> LongContext | None:
    """The recipe's chunked prefill and prefix cache, defaults resolved (None: neither)."""
    t = loaded.recipe.text
    if t.chunk_size is None:
        return None
    cache = t.prefix_cache
    spec = cache and PrefixCacheSpec(cache.block_size, t.num_blocks, t.checkpoint_interval, cache.checkpoint_slots)
    return LongContext(t.chunk_size, spec)


def text_graphs(loaded: LoadedRecipe) -> list[tuple[str, int]]:
    """(graph, bucket) of every text graph: a cte graph per prompt bucket, a tkg graph per KV bucket, and with
    chunked prefill an extend graph per KV bucket a later prefill piece runs in (qbuild.model.chunking)."""
    t = loaded.recipe.text
    graphs = [("cte", b) for b in t.cte_buckets] + [("tkg", b) for b in t.token_buckets]
    plan = long_context(loaded)
    if plan is not None:
        graphs += [(EXTEND, b) for b in extend_buckets(plan.step, t.token_buckets)]
    return graphs


def compile_params(loaded: LoadedRecipe, arch: Arch, graph: str, bucket: int) -> CpuCompile:
    """The allow-listed inputs of one CPU-compiled graph: architecture, parallelism, shapes and backend.

    Weight values never enter (a compile serves every fine-tune of an architecture). The text graphs do not
    depend on the vision encoder and the vision graphs do not depend on the text model or on tp. An extend graph
    depends on the piece it prefills, not on the prefix cache's sizes (the host keeps that cache).
    """
    r = loaded.recipe
    if graph == "vision":
        return CpuVisionCompile(graph, bucket, r.backend, r.dtype, arch.vision, r.vision.tp)
    chunk = long_context(loaded).step if graph == EXTEND else None
    return CpuTextCompile(graph, bucket, r.backend, r.dtype, arch.text_model(), r.parallel.tp, r.parallel.ep,
                          r.text.batch_size, r.text.seq_len, r.fp8, checks.moe_backend(loaded, arch), r.fused_qkv,
                          chunk)


# A graph's example inputs are allocated, held by the exported program (torch.export keeps them) and written out
# again by torch.export.save: a vision compile at 8192 patch tokens peaked at 3.5 times its float32 attention mask
# above the interpreter's own memory. tests/test_recipe_errors.py holds the estimate within a factor of the measured
# peak.
_INPUT_COPIES = 4
# Tracing the chunked DeltaNet prefill unrolls one loop iteration per chunk of the bucket: the traced graph grows with
# the bucket, about 10 KiB per token and DeltaNet layer measured on a tiny model.
_TRACE_BYTES_PER_TOKEN_LAYER = 16 << 10


def compile_peak_bytes(loaded: LoadedRecipe, arch: Arch, graph: str, bucket: int, sizes: Sizes) -> int:
    """Estimated peak memory of compiling one graph: the interpreter, the weights (the model's and the zeros
    passed as example weights) and what grows with the bucket, its example inputs (a vision bucket's
    (1, 1, S, S) attention mask, a token-generation bucket's KV cache) and the traced graph."""
    r = loaded.recipe
    d = DTYPE_BYTES[r.dtype]
    if graph == "vision":
        v = arch.vision
        inputs = bucket * bucket * d + bucket * (v.hidden_size * d + 2 * v.head_dim * 4)
        return GIB + sizes.vision + _INPUT_COPIES * inputs
    batch, tp = r.text.batch_size, r.parallel.tp
    n_delta = arch.num_layers - arch.num_attn_layers
    kv_cache = 2 * arch.num_attn_layers * tp * batch * bucket * arch.per_rank(tp).kv_dim * d
    if graph == "cte":
        inputs = batch * bucket * (arch.hidden_size * d + 3 * 8)   # embeddings (or ids) and mRoPE positions
        traced = bucket * n_delta * _TRACE_BYTES_PER_TOKEN_LAYER
    elif graph == EXTEND:   # a piece's tokens and its attention scores over the KV bucket, and the cache
        chunk = long_context(loaded).step
        inputs = batch * chunk * (arch.hidden_size * d + 3 * 8 + arch.num_heads * bucket * 4) + kv_cache
        traced = chunk * n_delta * _TRACE_BYTES_PER_TOKEN_LAYER
    else:
        inputs, traced = kv_cache, 0
    return GIB + sizes.weights + _INPUT_COPIES * inputs + traced


class CpuBackend:
    def __init__(self, name: str):
        self.name = name

    # --- planning ------------------------------------------------------------------------------------------------

    def validate(self, loaded: LoadedRecipe, arch: Arch) -> None:
        """Every recipe the schema and the architecture checks accept builds on the CPU, chunked prefill and the prefix
        cache included (qbuild's runtime keeps that cache on the host)."""

    def plan(self, loaded: LoadedRecipe, arch: Arch, env, sizes: Sizes) -> BackendPlan:
        r = loaded.recipe
        shard = ShardParams("cpu", RankLayout.split(r.parallel.tp, r.parallel.ep), r.fused_qkv, r.dtype)
        graphs = text_graphs(loaded) + [("vision", b) for b in (r.vision.buckets if r.vision else [])]
        compiles = tuple(
            PlannedNode(f"compile {graph}-{bucket}", "compile", f"compile {graph}-{bucket} ({self.name})",
                        compile_params(loaded, arch, graph, bucket), {}, 64 << 20,
                        compile_peak_bytes(loaded, arch, graph, bucket, sizes))
            for graph, bucket in graphs)
        package = PackageParams(arch.family, self.name, r.parallel.tp, r.parallel.ep, r.parallel.tp,
                                r.text.batch_size, r.text.seq_len, tuple(r.text.cte_buckets),
                                tuple(r.text.token_buckets), tuple(r.vision.buckets if r.vision else ()), r.dtype,
                                long_context=long_context(loaded))
        return BackendPlan((), shard, compiles, package)

    def explain_reuse(self, old: dict, new) -> str | None:
        return None

    def portable(self, kind: str) -> bool:
        """Compiled graphs and the bundle holding them are native exactly when the graphs are."""
        return not _NATIVE[self.name]

    def describe_compile(self, params) -> dict:
        return {}

    def port_info(self, loaded: LoadedRecipe, arch: Arch) -> dict | None:
        return None

    def side_caches(self) -> tuple:
        """torch.export and AOTInductor keep nothing between compiles that a build relies on."""
        return ()

    def host_lacks(self, resources: dict[str, int]) -> str | None:
        """A CPU step asks for no device: every host runs it."""
        return None

    # --- building ------------------------------------------------------------------------------------------------

    def compile(self, ctx: Context) -> None:
        from qbuild.backends.cpu.export import export_graph
        from qbuild.model.runtime import exported

        p = ctx.params
        name = f"{p.graph}-{p.bucket}"
        traced = export_graph(p)
        signature = dict(traced.signature, backend=p.backend, format=_FORMATS[self.name])
        target = ctx.out / graph_file(p.graph, p.bucket)
        if self.name == "inductor":
            from qbuild.backends.cpu.inductor import package

            ctx.log(f"{name}: AOTInductor {package(traced.program, target, ctx.scratch):.1f}s")
        else:
            exported.save(traced.program, target)
        (ctx.out / f"{name}.json").write_text(jsonio.dumps(signature, indent=1, sort_keys=True))
        ctx.log(f"{name}: exported in {traced.seconds:.1f}s")

    def package(self, ctx: Context) -> dict[str, str]:
        """One graph per bucket under graphs/, with its signature."""
        from qbuild.core.files import link_tree

        p: PackageParams = ctx.params
        graphs = {}
        for name, tree in sorted(ctx.inputs.items()):
            if name.startswith("compile:"):
                graph = name.removeprefix("compile:")
                link_tree(tree, ctx.out / "graphs")
                graphs[graph] = f"graphs/{graph}.pt2"
        extend = extend_buckets(p.long_context.step, list(p.tkg_buckets)) if p.long_context else []
        expected = {f"cte-{b}" for b in p.cte_buckets} | {f"tkg-{b}" for b in p.tkg_buckets} | \
            {f"vision-{b}" for b in p.vision_buckets} | {f"{EXTEND}-{b}" for b in extend}
        if set(graphs) != expected:
            raise ValueError(f"package got graphs {sorted(graphs)}, planned {sorted(expected)}")
        return graphs

    def recognises(self, manifest: dict) -> bool:
        """One of this backend's bundles: its graphs are under graphs/ (CpuBackend.package)."""
        graphs = manifest.get("graphs", {})
        return manifest.get("backend") == self.name and isinstance(graphs, dict) and \
            all(isinstance(p, str) and p.startswith("graphs/") for p in graphs.values())

    def runtime(self, bundle: Path, manifest: dict, verify_digests: bool = True, shown_as: str | None = None):
        """qbuild's own runtime (qbuild.model.runtime)."""
        from qbuild.model.runtime import Runtime

        return Runtime.load(bundle, verify_digests=verify_digests, shown_as=shown_as)

    def run_prompts(self, ctx: Context, reference: dict, ref_dir: Path) -> list[PromptRun]:
        """Every prompt, image prompts included, through qbuild's runtime."""
        from qbuild.model.runtime import Runtime

        runtime = Runtime.load(ctx.inputs["bundle"])
        runs = []
        for i, record in enumerate(reference["prompts"]):
            image = ref_dir / "image.png" if record["image"] else None
            text_ids = record["ids"]
            if image is not None:  # the runtime puts the image tokens in front itself
                text_ids = record["ids"][record["ids"].index(runtime.config["vision_end_token_id"]) + 1:]
            # The prefix cache off: verify compares the logits of every prompt position, and the tokens are the same.
            gen = runtime.generate(text_ids, len(record["greedy"]), image=image, stop_at_eos=False, use_cache=False)
            if gen.prompt_ids != record["ids"]:
                raise BuildError(f"verify: prompt {i}: the runtime built prompt ids {gen.prompt_ids[:12]}..., the "
                                 f"reference {record['ids'][:12]}...")
            runs.append(PromptRun(i, record, gen.prefill_logits, gen.token_ids, last_only=False))
        return runs
