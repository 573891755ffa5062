"""The neuron backend: a recipe built with a public NxDI contrib port, compiled by neuronx-cc and run by NxDI.

Planning (pure, no SDK): the port is a source node every later step takes; the shard step writes NxD's format for the
port's lineage, one file per rank of NxD's world; ONE text compile builds every CTE and TKG bucket (NxDI builds both
submodels in one compile(): docs/nxdi.md section 2) and each vision bucket is its own traced encoder; verifying the
bundle runs it on one host's NeuronCores, one per rank. The toolchain is the recipe's pin, never what is installed, so
every machine plans the same keys.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Callable

from qbuild.backends.base import PromptRun
from qbuild.backends.neuron import compile_cache, config, deploy, long_context, releases, worker_env
from qbuild.backends.neuron.params import (CompilerSettings, NeuronPackageParams, NeuronSampling, NeuronTextCompile,
                                           NeuronVisionCompile, NxdiTree, PortFiles, PortGit, PortMissing)
from qbuild.backends.neuron.ports import FAMILY_LINEAGES, LINEAGES, VL_PORT_ENV, lineage_for, port_dir
from qbuild.core.errors import UserError
from qbuild.core.units import GIB
from qbuild.model.arch import Arch
from qbuild.model.chunking import LongContext, PrefixCacheSpec
from qbuild.model.fp8 import policy as fp8_policy
from qbuild.planning.backend import BackendPlan, SourceEnvironment, Sizes
from qbuild.planning.step import Context, PlannedNode, Source
from qbuild.recipe import checks
from qbuild.recipe.params import ShardParams
from qbuild.recipe.schema import LoadedRecipe

# The resource a step on NeuronCores asks an executor for (Ray's custom resource of that name: docs/ray.md).
NEURON_CORES = "neuron_cores"


def text_compile_params(loaded: LoadedRecipe, arch: Arch) -> NeuronTextCompile:
    """The allow-listed inputs of a recipe's ONE neuron text compile."""
    r = loaded.recipe
    lineage = lineage_for(arch.family, r.port.lineage)
    return NeuronTextCompile(
        graph="text", backend="neuron", lineage=lineage.name, text=arch.text_model(),
        parallel=config.rank_layout(lineage.name, arch.is_moe, r.parallel.tp, r.parallel.ep),
        dtype=r.dtype, fp8=r.fp8, moe_backend=checks.moe_backend(loaded, arch), fused_qkv=r.fused_qkv,
        batch_size=r.text.batch_size, seq_len=r.text.seq_len, cte_buckets=tuple(r.text.cte_buckets),
        tkg_buckets=tuple(r.text.token_buckets), compiler=_compiler(r), toolchain=toolchain(loaded),
        port_env=dict(sorted(r.port.env.items())),
        # The ports' scripts pad with eos where the config names no pad token (run_text_smoke.py @ 4bcdc54).
        pad_token_id=arch.pad_token_id if arch.pad_token_id is not None else arch.eos_token_id,
        # A bundle with vision encoders needs a context-encoding graph that takes the image features.
        vision_inputs=bool(r.vision and r.vision.buckets), block_kv=long_context.block_kv(loaded),
        sampling=NeuronSampling(r.text.sampling.top_k) if r.text.sampling.on_device else None)


def bundle_long_context(loaded: LoadedRecipe) -> LongContext | None:
    """What bundle.json records of the bundle's long-prompt serving: the chunk, and the prefix cache only where vLLM
    serves it (qbuild.backends.neuron.long_context)."""
    t = loaded.recipe.text
    if t.chunk_size is None:
        return None
    cache = t.prefix_cache
    served = long_context.serves_prefix_caching(loaded)
    spec = PrefixCacheSpec(cache.block_size, t.num_blocks, t.checkpoint_interval, cache.checkpoint_slots) \
        if served else None
    return LongContext(t.chunk_size, spec)


def vision_compile_params(loaded: LoadedRecipe, arch: Arch, bucket: int) -> NeuronVisionCompile:
    """One traced vision encoder at one patch bucket (its weights are inlined: the node depends on them)."""
    r = loaded.recipe
    lineage = lineage_for(arch.family, r.port.lineage)
    return NeuronVisionCompile(graph="vision", bucket=bucket, backend="neuron", lineage=lineage.name,
                               vision=arch.vision, dtype=r.dtype, compiler=_compiler(r), toolchain=toolchain(loaded),
                               port_env=dict(sorted(r.port.env.items())), tp=r.vision.tp)


def vision_step(loaded: LoadedRecipe, arch: Arch, bucket: int, sizes: Sizes) -> PlannedNode:
    """The compile node of one vision bucket: one traced encoder, or with vision.tp one per rank, traced in parallel
    processes that each load the whole vision weights before NxD slices them (sdk_worker.tp_vision_model)."""
    params = vision_compile_params(loaded, arch, bucket)
    tp = f", tp{params.tp}" if params.tp > 1 else ""
    return PlannedNode(f"compile vision-{bucket}", "compile", f"compile vision-{bucket} (neuron{tp})", params,
                       {"port": "port", "converted": "convert"}, 64 << 20, params.tp * (4 * sizes.vision + 8 * GIB))


def nxdi_tree(loaded: LoadedRecipe) -> NxdiTree | None:
    """The NxDI tree the bundle's port imports from, where the recipe installs NxDI from source: the port's own
    repository and commit (the Qwen3.6-27B recipe: NxDI PR 173's tree)."""
    r = loaded.recipe
    if "neuronx_distributed_inference" not in r.toolchain.from_source:
        return None
    return NxdiTree(r.port.git, r.port.rev, r.toolchain.neuronx_distributed_inference)


def toolchain(loaded: LoadedRecipe) -> dict[str, str]:
    """The exact SDK versions the recipe's toolchain names (a release, or four versions of one release)."""
    t = loaded.recipe.toolchain
    return releases.resolve(t.sdk, t.pins(), tuple(f.replace("_", "-") for f in t.from_source))


def _compiler(r) -> CompilerSettings:
    return CompilerSettings(target=r.compiler.target, lnc=r.compiler.effective_lnc, flags=tuple(r.compiler.flags))


def port_step(loaded: LoadedRecipe, env: SourceEnvironment) -> PlannedNode:
    """The port node. A git port is identified by (url, rev, subdir) alone: planning reads nothing of it, so it needs
    no checkout and no network. A local port (path or module) is identified by its source files' digests."""
    port = loaded.recipe.port
    if port.git is not None:
        return PlannedNode("port", "port", f"port {PurePosixPath(port.subdir).name} @ {port.rev[:12]}",
                           PortGit(port.git, port.rev, port.subdir.strip("/")), {}, 1 << 20, GIB // 4)
    where = port_dir(loaded)
    written = port.path or port.module
    files = None if where is None else env.port_digests(where)
    if files is None:
        # Planned anyway, so `plan` shows the whole graph; building it fails with one line saying where to put it.
        return PlannedNode("port", "port", f"port {written} (not found)", PortMissing(written), {}, 1 << 20, GIB // 4)
    return PlannedNode("port", "port", f"port {where.name}", PortFiles(files), {}, 1 << 20, GIB // 4,
                       source=Source(path=str(where)))


def ep_refusal(lineage: str, batch_size: int, arch: Arch) -> str:
    """Why no neuron recipe runs expert parallelism, for this batch (docs/nxdi.md section 14).

    NxD's ExpertMLPsV2 decodes by the routed-expert load batch_size x top_k / experts (expert_mlps_v2.py L1470-1483,
    threshold model_utils.py L93 @ fbac349): below 1 it takes selective loading, which raises under an expert-parallel
    group; at 1 or more it takes forward_all_experts_EP. There, context encoding is what stays: the Coder-Next README
    says NxD's ExpertMLPsV2.forward must be patched to take its blockwise path for it under EP (L155 @ 753c7f5, for SDK
    2.30, whose NxD source is unpublished), a patch no public port holds; NxD 2.28 and 2.29 take that EP-aware path
    unpatched for a bucket of tokens x top_k >= max(experts, block size) (expert_mlps_v2.py L1484-1497 @ fbac349 and
    73ab227), which no port ran, so the refusal stays a precaution there. The Coder-Next port's other decode path, NxD's
    fused TKG module, is built only where `moe_fused_nki_kernel_enabled` is set (its enable_moe_fused_nki_kernel,
    modeling_qwen35_moe.py L1105-1116 @ 753c7f5), which neither qbuild nor the port's scripts set; NxD refuses that
    path's selective kernel under EP where it picks the kernel itself (moe_fused_tkg.py L228-231 @ 73ab227), and where
    the flag forces it, calls it without the rank's expert-parallel index (L477-483, L503-504 @ 73ab227; L336-363 @
    fbac349)."""
    load = batch_size * (arch.num_experts_per_tok or 0) / (arch.num_experts or 1)
    if load >= 1:
        return (f"no public code runs expert parallelism here: at batch_size x top_k / experts = {load:.3g} >= 1 "
                "NxD decodes with its all-experts EP path, but no public port ran EP at such a batch, and the "
                "Coder-Next README says context encoding under EP needs NxD's ExpertMLPsV2.forward patched to its "
                "blockwise path (L155, for SDK 2.30, whose NxD is unpublished); NxD 2.28 and 2.29 take that path for "
                "a bucket of tokens x top_k >= max(experts, block size), which nobody ran (docs/nxdi.md section 14); "
                "use ep: 1")
    fused = (", and the port's fused TKG path is off (moe_fused_nki_kernel_enabled, which neither qbuild nor the "
             "port's scripts set) and has no EP selective kernel either") if lineage == "moe" else ""
    return (f"no public code decodes with expert parallelism here: at batch_size x top_k / experts = {load:.3g} < 1 "
            f"NxD's token generation takes selective loading, which it refuses under EP{fused} (docs/nxdi.md section "
            "14); use ep: 1")


class NeuronBackend:
    """`run_bundle` runs a bundle on this host's NeuronCores (deploy.run_bundle); a test passes a double of it."""

    def __init__(self, name: str = "neuron", run_bundle: Callable = deploy.run_bundle):
        self.name = name
        self._run_bundle = run_bundle

    # --- planning ------------------------------------------------------------------------------------------------

    def validate(self, loaded: LoadedRecipe, arch: Arch) -> None:
        """The checks that only a neuron build needs: a port that can serve the recipe, and a pinned toolchain."""
        r = loaded.recipe
        served_by = FAMILY_LINEAGES[arch.family]
        lineage = lineage_for(arch.family, r.port.lineage)
        if lineage.name not in served_by:
            checks.fail(loaded, "port.lineage", f"the {lineage.name} lineage has no port for {arch.family}; use "
                                                f"{' or '.join(served_by)}")
        if r.port.git is None and r.port.path is None and r.port.module is None:
            checks.fail(loaded, "port", "a neuron build runs an NxDI contrib port: set port.git with port.rev (a full "
                                        "commit) and port.subdir (contrib/models/<Port>), or port.path / port.module "
                                        "for a local checkout")
        self._validate_port_env(loaded)
        self._validate_fp8(loaded, arch)
        long_context.validate(loaded, lineage.name)
        if r.vision is not None and lineage.vision_module is None:
            checks.fail(loaded, "vision", f"the {lineage.name}-lineage port has no vision encoder; drop vision or use "
                                          "main")
        if r.vision is not None and r.dtype != "bfloat16":
            # NeuronQwen35VisionModelWrapper casts every encoder input to bfloat16
            # (contrib/models/Qwen3.5-35B-A3B/src/modeling_qwen35_vision.py:790-820 @ 4bcdc54), so an encoder traced in
            # another dtype would be fed inputs it was not traced for.
            checks.fail(loaded, "dtype", f"the port's vision encoder runs in bfloat16; a neuron recipe with vision "
                                         f"builds in bfloat16, not {r.dtype}")
        if r.vision is not None:
            self._validate_vl_switches(loaded, lineage.name)
        if r.text.sampling.on_device and r.text.chunked_prefill is not None:
            # A precaution: the one port that compiles chunked prefill adds vocab_parallel=True to its on-device
            # sampling (contrib/models/Qwen3.6-27B/test/integration/qwen36_27b_compile_fp8.py L931-947 @ 03db3ef), and
            # no sampled token was traced through its chunked context encoding. vllm-neuron's side suggests it works
            # (loader L508-509, runner L302-306 @ 3afb0a9): docs/nxdi.md section 21.
            checks.fail(loaded, "text.sampling.on_device", "on-device sampling with chunked_prefill is a combination "
                                                           "qbuild has not read in the port that builds it; drop one")
        if r.parallel.ep > 1:
            checks.fail(loaded, "parallel.ep", ep_refusal(lineage.name, r.text.batch_size, arch))
        try:
            resolved = toolchain(loaded)
        except releases.ToolchainError as e:
            checks.fail(loaded, f"toolchain.{e.field}", e.msg)
        try:
            served_as, _ = releases.serving_stack(resolved, r.toolchain.sdk)
        except ValueError as e:
            checks.fail(loaded, "toolchain.sdk", str(e))
        if checks.moe_backend(loaded, arch) == "shard_hidden" and \
                any(releases.at_least(name, "2.29") for name in served_as):
            # "The BWMM shard-on-hidden kernel previously used during prefill in Mixture-of-Experts models has been
            # removed" (aws-neuron-sdk release-notes/components/nxd-inference.rst L62 @ a3247f5b8c30, the 2.29.0 notes;
            # L36 @ 539a73c5).
            checks.fail(loaded, "moe_backend", f"shard_hidden: SDK {', '.join(served_as)} has no shard-on-hidden "
                                               "kernel (removed in 2.29.0); use shard_on_intermediate, shard_on_block "
                                               "or torch_blockwise, or an SDK before 2.29")

    @staticmethod
    def _validate_port_env(loaded: LoadedRecipe) -> None:
        """port.env reaches the trace as given and is keyed; what qbuild sets itself (the work dir, the compile cache,
        the target and LNC from `compiler`) it may not replace, nor move the compile cache out of the store through
        the cache flags the Neuron compiler wrapper reads from NEURON_CC_FLAGS (docs/nxdi.md section 10)."""
        env = loaded.recipe.port.env
        for name in sorted(env):
            if name in worker_env.QBUILD_SET:
                checks.fail(loaded, f"port.env.{name}", f"qbuild sets {name} itself ({worker_env.QBUILD_SET[name]})")
        flags = env.get("NEURON_CC_FLAGS", "").split()
        cache_flags = sorted({f.split("=")[0] for f in flags if f.split("=")[0] in worker_env.CACHE_FLAGS})
        if cache_flags:
            checks.fail(loaded, "port.env.NEURON_CC_FLAGS", f"{', '.join(cache_flags)} would take the Neuron compile "
                                                            "cache out of the store; qbuild keeps it there")
        # The compiler arguments never hold an option twice (config.compiler_args): no public source says which
        # value neuronx-cc would take.
        names = [name for name, _ in config.options([t for f in loaded.recipe.compiler.flags for t in f.split()])]
        for name in ("--target", "--lnc"):
            if name in names:
                checks.fail(loaded, "compiler.flags", f"{name} is set by compiler.{name[2:]}, not by a flag")
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            checks.fail(loaded, "compiler.flags", f"{', '.join(repeated)} given more than once")

    @staticmethod
    def _validate_vl_switches(loaded: LoadedRecipe, lineage: str) -> None:
        """A recipe with vision traces context encoding with image features: the port switches its lineage's VL scripts
        set for that (ports.VL_PORT_ENV) must be in port.env, or the bundle answers images with degenerate text."""
        env = loaded.recipe.port.env
        for name, value in VL_PORT_ENV.get(lineage, {}).items():
            if env.get(name) != value:
                got = "it is not set" if name not in env else f"it is {env[name]!r}"
                checks.fail(loaded, f"port.env.{name}",
                            f"a recipe with vision needs {name}: {value!r} (the port's VL scripts set it: the default "
                            f"DeltaNet prefill degenerates on image features; docs/vision.md section 4); {got}")

    @staticmethod
    def _validate_fp8(loaded: LoadedRecipe, arch: Arch) -> None:
        policy = fp8_policy(loaded.recipe.fp8)
        if policy.quantizes_attention:
            checks.fail(loaded, "fp8", f"a neuron build makes the FP8 port's mlp_only configuration (PR 173); "
                                       f"{policy.name} is for the CPU backends")
        if policy.quantizes and arch.is_moe:
            # The FP8 port is dense; NxD reads per-expert scales only as expert_wise_per_channel_symmetric, which no
            # public port configures.
            checks.fail(loaded, "fp8", f"no public NxDI port builds FP8 experts; {arch.family} builds with fp8: none "
                                       "on neuron")

    def plan(self, loaded: LoadedRecipe, arch: Arch, env: SourceEnvironment, sizes: Sizes) -> BackendPlan:
        r = loaded.recipe
        text = text_compile_params(loaded, arch)
        ranks = text.parallel.world
        # One file per rank of NxD's world, in the files NxD writes for the port's lineage (layout/nxd.py).
        shard = ShardParams(LINEAGES[text.lineage].shard_layout, text.parallel, r.fused_qkv, r.dtype)
        neffs = config.neuron_config(text)["neffs"]
        layout = f", block KV {text.block_kv.block_size} x {text.block_kv.num_blocks}" if text.block_kv else ""
        # neuronx-cc runs on any host with the SDK: CPUs and memory, no device.
        compiles = [PlannedNode("compile text", "compile", f"compile text ({neffs} NEFFs, neuron{layout})", text,
                                {"port": "port"}, 64 << 20, 4 * sizes.weights // ranks + 8 * GIB)]
        for b in (r.vision.buckets if r.vision else []):
            compiles.append(vision_step(loaded, arch, b, sizes))
        package = NeuronPackageParams(
            family=arch.family, backend="neuron", tp=r.parallel.tp, ep=r.parallel.ep, ranks=ranks,
            batch_size=r.text.batch_size, seq_len=r.text.seq_len, cte_buckets=tuple(r.text.cte_buckets),
            tkg_buckets=tuple(r.text.token_buckets), vision_buckets=tuple(r.vision.buckets if r.vision else ()),
            dtype=r.dtype, lineage=text.lineage, fp8=r.fp8, block_kv=text.block_kv,
            long_context=bundle_long_context(loaded), sdk=r.toolchain.sdk, nxdi_tree=nxdi_tree(loaded))
        # Verifying a neuron bundle runs it: every rank on a NeuronCore of one host.
        return BackendPlan((port_step(loaded, env),), shard, tuple(compiles), package, {NEURON_CORES: ranks})

    def explain_reuse(self, old: dict, new) -> str | None:
        return config.neff_reuse(old, new)

    def portable(self, kind: str) -> bool:
        """NEFFs run on NeuronCores, not on the host that compiled them, and are keyed by the pinned toolchain and the
        compiler's target (CompilerSettings), so any host builds the same compile and bundle."""
        return True

    def describe_compile(self, params) -> dict:
        cfg = config.neuron_config(params)
        return {"neffs": cfg["neffs"], "neuron_config": cfg}

    def side_caches(self) -> tuple:
        """The Neuron compile cache, kept in the store so compiles reuse each other's NEFFs (compile_cache)."""
        return (compile_cache.CACHE,)

    def host_lacks(self, resources: dict[str, int]) -> str | None:
        """A step on NeuronCores (verifying a bundle) runs where the Neuron driver shows a device (/dev/neuron<N>)."""
        if not resources.get(NEURON_CORES) or deploy.neuron_devices():
            return None
        return (f"runs on {resources[NEURON_CORES]} NeuronCores and this host has no Neuron device; run it on a trn "
                "host")

    def port_info(self, loaded: LoadedRecipe, arch: Arch) -> dict | None:
        """The port a recipe resolves to: lineage, module and class names, and where its source is found."""
        port = loaded.recipe.port
        lineage = lineage_for(arch.family, port.lineage)
        info = {"lineage": lineage.name, "module": lineage.text_module, "app_class": lineage.app_class,
                "config_class": lineage.config_class, "vision_module": lineage.vision_module}
        if port.git is not None:   # fetched when the port node is built; planning never looks
            return {**info, "git": port.git, "rev": port.rev, "subdir": port.subdir, "path": None, "found": None}
        where = port_dir(loaded)
        return {**info, "path": str(where) if where else None, "found": bool(where and where.is_dir())}

    # --- building ------------------------------------------------------------------------------------------------

    def compile(self, ctx: Context) -> None:
        """The text node is NxDI's compiled directory of the whole text model (model.pt with every CTE and TKG bucket,
        NxDI's neuron_config.json, metaneff/); a vision node is one traced encoder, vision_encoder_<bucket>.pt, with
        the vision weights inlined (its input `converted`)."""
        from qbuild.backends.neuron import driver

        p = ctx.params
        transfers = None if ctx.progress is None else ctx.progress.transfers()   # the compile cache's
        if isinstance(p, NeuronVisionCompile):
            driver.compile_vision(p, ctx.inputs["port"], ctx.inputs["converted"] / "vision" / "model.safetensors",
                                  ctx.out, ctx.scratch, ctx.store, ctx.log, transfers)
        else:
            driver.compile_text(p, ctx.inputs["port"], ctx.out, ctx.scratch, ctx.store, ctx.log, transfers)

    def package(self, ctx: Context) -> dict[str, str]:
        from qbuild.backends.neuron.package import package

        return package(ctx)

    def recognises(self, manifest: dict) -> bool:
        """One of this backend's bundles: NxDI's compiled directory, its text model NxDI's model.pt at the top
        (package.py), never under the CPU backends' graphs/."""
        graphs = manifest.get("graphs", {})
        return manifest.get("backend") == self.name and isinstance(graphs, dict) and \
            not any(isinstance(p, str) and p.startswith("graphs/") for p in graphs.values())

    def runtime(self, bundle: Path, manifest: dict, verify_digests: bool = True, shown_as: str | None = None):
        """qbuild's runtime runs CPU graphs only: a neuron bundle runs where NxDI loads it (`qbuild serve` on a trn
        host, or the port's own scripts)."""
        raise UserError(f"{shown_as or bundle}: a neuron bundle runs on a Neuron host through NxDI, not on this "
                        "runtime")

    def run_prompts(self, ctx: Context, reference: dict, ref_dir: Path) -> list[PromptRun]:
        """A neuron bundle runs on this host's NeuronCores through the port's class. NxDI's context encoding returns
        the last position's logits only, so the comparison takes the first generated token's logits against the
        reference's last prompt position; a bundle that samples on the device returns no logits at all, and is
        compared by its tokens (docs/nxdi.md section 21). Greedy tokens compare over every step up to the first
        generated pad token (deploy.until_pad). Image prompts run in the CPU proof of the same recipe."""
        bundle = ctx.inputs["bundle"]
        text = [(i, r) for i, r in enumerate(reference["prompts"]) if not r["image"]]
        n = max(len(r["greedy"]) for _, r in text)
        greedy, logits = self._run_bundle(bundle, ctx.inputs["port"], [r["ids"] for _, r in text], n, ctx.scratch,
                                          ctx.log)
        pad = json.loads((bundle / deploy.QBUILD_RECORD).read_text())["params"]["pad_token_id"]
        runs = []
        for k, (i, record) in enumerate(text):
            record = deploy.until_pad(record, pad)
            runs.append(PromptRun(i, record, logits[f"prompt{k}"] if logits is not None else None,
                                  greedy[k][:len(record["greedy"])], last_only=True))
        return runs
