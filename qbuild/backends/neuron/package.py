"""A neuron bundle: NxDI's compiled directory as the port's class loads it, with the port's source beside it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from qbuild.backends.neuron import driver, long_context, nxdi_tree
from qbuild.planning.step import Context
from qbuild.backends.neuron.params import NeuronPackageParams
from qbuild.backends.neuron.ports import LINEAGES
from qbuild.backends.neuron.releases import serving_stack
from qbuild.core import jsonio
from qbuild.core.errors import BuildError
from qbuild.model.fp8 import policy as fp8_policy
from qbuild.model.tiling import TILES, largest_patches
from qbuild.core.files import atomic_write, link_or_copy, link_tree, staged


def package(ctx: Context) -> dict[str, str]:
    """NxDI's compiled directory: model.pt and NxDI's neuron_config.json from the text compile, weights/ from the
    shard step, vision_encoder_<bucket>.pt per vision bucket (the names NxDI's load() and the port's
    NeuronQwen35VisionModelWrapper.load_compiled() read: application_base.py @ ef2731e, modeling_qwen35_vision.py
    @ 4bcdc54), and what vLLM's Neuron plugin needs to serve it (`vllm_glue`). On a host with the SDK, every shard
    is checked against the weights the compiled model takes."""
    p: NeuronPackageParams = ctx.params
    text = ctx.inputs["compile:text"]
    for name in ("model.pt", "neuron_config.json", driver.QBUILD_RECORD):
        link_or_copy(text / name, ctx.out / name)
    # The port's source travels with the bundle: serving hosts import the app class from it (bundle/port/).
    link_tree(ctx.inputs["port"], ctx.out / "port")
    vllm_glue(ctx.out, p, json.loads((text / driver.QBUILD_RECORD).read_text()))
    graphs = {"text": "model.pt", **package_vision(ctx, p)}
    shards = sorted((ctx.out / "weights").glob("tp*_sharded_checkpoint.safetensors"))
    if len(shards) != p.ranks:
        raise ValueError(f"package got {len(shards)} shards, planned {p.ranks} ranks")
    expected = driver.expected_weights(text)
    if p.block_kv is not None:
        _add_checkpoint_banks(ctx, p, shards)
    if fp8_policy(p.fp8).quantizes:
        _reloadable_kv_quant_config(ctx.out / "neuron_config.json")
    if expected is not None:
        for shard in shards:
            driver.check_shards(expected, shard)
    return graphs


# --- the vision encoders and what the port does with them (docs/vision.md) -----------------------------------------

VISION_RECORD = "qbuild-vision.json"


def package_vision(ctx: Context, p: NeuronPackageParams) -> dict[str, str]:
    """Each vision bucket's traced encoder where the port's load_compiled(<bundle>) finds it (a vision_encoder_<b>.pt,
    or a bucket_<b>/ of one tp_<r>.pt per rank: config.vision_config), and qbuild-vision.json: what the port will do
    with them. Returns {graph: path in the bundle}."""
    if not p.vision_buckets:
        return {}
    graphs, configs = {}, {}
    for b in p.vision_buckets:
        compiled = ctx.inputs[f"compile:vision-{b}"]
        cfg = json.loads((compiled / f"qbuild-vision-{b}.json").read_text())["config"]
        source = compiled / cfg["file"]
        if source.is_dir():
            link_tree(source, ctx.out / cfg["file"])
        else:
            link_or_copy(source, ctx.out / cfg["file"])
        graphs[f"vision-{b}"], configs[b] = cfg["file"], cfg
    (ctx.out / VISION_RECORD).write_text(jsonio.dumps(vision_record(configs), indent=1, sort_keys=True) + "\n")
    host_weights(ctx.out)
    return graphs


VISION_HOST = "vision/host"     # the port's load_vision_weights_from_hf(<bundle>/vision/host) reads it
# The vision encoder's host-side tensors as the HF checkpoint names them, which is how the port's wrapper finds them
# (load_vision_weights_from_hf, contrib/models/Qwen3.5-2B/src/modeling_qwen35_vision.py:531-555 @ 4bcdc54), from
# their converted names (qbuild/model/convert/vision.py).
HOST_TENSORS = {"patch_embed.proj.weight": "model.visual.patch_embed.proj.weight",
                "patch_embed.proj.bias": "model.visual.patch_embed.proj.bias",
                "pos_embed.weight": "model.visual.pos_embed.weight"}


def host_weights(out: Path) -> None:
    """vision/host/model.safetensors: the patch and position embeddings the port's wrapper runs on the host, under the
    HF names it reads. It globs every *.safetensors of the directory it is given and copies only those three keys,
    loading nothing and saying nothing where they are absent (L531-555), so the bundle carries them in a directory of
    their own rather than send the serving host to the HF checkpoint (docs/vision.md section 8)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(out / "vision" / "model.safetensors")
    missing = sorted(set(HOST_TENSORS) - set(tensors))
    if missing:
        raise BuildError(f"vision/model.safetensors: no {missing[0]}, which the port's vision wrapper runs on the host")
    (out / VISION_HOST).mkdir(parents=True)
    save_file({hf: tensors[name].contiguous() for name, hf in HOST_TENSORS.items()},
              out / VISION_HOST / "model.safetensors")


def vision_record(configs: dict[int, dict]) -> dict:
    """qbuild-vision.json: the vision buckets, how each was traced and where it lies, and the image sizes the port's
    wrapper takes through them (NeuronQwen35VisionModelWrapper.forward, modeling_qwen35_vision.py:771-806 @ 4bcdc54;
    qbuild.model.tiling): an image of more patch tokens than the largest bucket runs as 2x2 tiles through the smallest
    bucket that holds a tile, up to four times the largest bucket."""
    buckets = sorted(configs)
    return {"buckets": buckets,
            "encoders": {str(b): {k: configs[b][k] for k in ("file", "trace", "model_class", "compiler_args")} |
                         {"tp": configs[b].get("tp_degree", 1)} for b in buckets},
            "tiling": {"tiles": [TILES, TILES], "above_patches": buckets[-1], "max_patches": largest_patches(buckets),
                       "tile_bucket": "the smallest bucket of at least patches / 4"},
            "env": configs[buckets[0]]["env"]}


# --- what vLLM's Neuron plugin needs (docs/vllm.md) ------------------------------------------------------------

VLLM_DIR = "vllm"                       # goes on PYTHONPATH: the plugin module and its distribution metadata
VLLM_SERVE = "vllm/serve.json"          # the bundle's own facts the vLLM command line is made of
VLLM_PLUGIN = "qbuild_bundle"           # the entry point's name, which VLLM_PLUGINS must list
_PLUGIN_MODULE = "qbuild_vllm_plugin"
_PLUGIN_DIST = "qbuild_bundle_vllm_plugin-1.dist-info"


def vllm_glue(out: Path, p: NeuronPackageParams, record: dict) -> None:
    """A flattened config.json, the vLLM plugin that registers the bundle's model (qbuild.backends.neuron.vllm_plugin)
    and vllm/serve.json, all from this bundle's own params and compile record, so that serving never reads the recipe
    and a bundle copied to another host serves the same way. Paths inside are relative to the bundle."""
    config = json.loads((out / "config.json").read_text())
    # config.json is a hardlink to the converted checkpoint's blob: atomic_write replaces the link, never the blob.
    atomic_write(out / "config.json", (jsonio.dumps(flat_config(config), indent=2, sort_keys=True) + "\n").encode())
    lineage = LINEAGES[p.lineage]
    architecture = (config.get("architectures") or [None])[0]
    model, task = nxdi_registry_key(architecture)
    text = config.get("text_config")
    spec = {"model_type": config["model_type"], "text_model_type": text.get("model_type") if isinstance(text, dict)
            else None, "architecture": architecture, "nxdi_model": model, "nxdi_task": task,
            "module": lineage.text_module, "app_class": lineage.app_class,
            "port_dir": Path("..", lineage.module_dir(Path("port"))).as_posix(), **serving_patch(out, p)}
    glue = out / VLLM_DIR
    (glue / _PLUGIN_DIST).mkdir(parents=True)
    # Imported (it has no effect until vLLM calls register()) rather than read by path, so that its source is in
    # this step's key like any code the step runs (qbuild.planning.closures).
    from qbuild.backends.neuron import vllm_plugin

    (glue / f"{_PLUGIN_MODULE}.py").write_bytes(Path(vllm_plugin.__file__).read_bytes())
    (glue / f"{_PLUGIN_MODULE}.json").write_text(jsonio.dumps(spec, indent=1, sort_keys=True) + "\n")
    (glue / _PLUGIN_DIST / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {_PLUGIN_DIST.split('-')[0]}\nVersion: 1\n")
    (glue / _PLUGIN_DIST / "entry_points.txt").write_text(
        f"[vllm.general_plugins]\n{VLLM_PLUGIN} = {_PLUGIN_MODULE}:register\n")
    serve = {**serve_record(p, record), "nxdi_tree": nxdi_tree_record(out, p)}
    (out / VLLM_SERVE).write_text(jsonio.dumps(serve, indent=1, sort_keys=True) + "\n")
    tokenizer_for_every_stack(out)


def serving_patch(out: Path, p: NeuronPackageParams) -> dict:
    """The plugin spec's "serving_patch": the port's own vLLM patch that a long-context bundle is served with
    (qbuild.backends.neuron.long_context), relative to vllm/, and the function that installs it; None otherwise."""
    if p.block_kv is None:
        return {"serving_patch": None}
    long_context.require_serving_patch(out / "port")
    return {"serving_patch": {"file": Path("..", "port", long_context.SERVING_PATCH).as_posix(),
                              "install": long_context.SERVING_PATCH_HOOK}}


def serve_record(p: NeuronPackageParams, record: dict) -> dict:
    """vllm/serve.json: the bundle's own facts the vLLM command is made of (qbuild.backends.neuron.deploy.vllm_args),
    and the serving stack of the SDK release it was compiled with (releases.SERVING: the one the recipe names).

    - max_prompt_length: the compiled max_context_length (config.py _text_neuron_config): the largest
      context-encoding bucket, or with chunked prefill the KV length (long_context.max_context_length). vllm-neuron
      0.5 refuses a longer prompt with a 400 when
      additional_config.max_prompt_length is set (platform.py L314-316, platform_overrides.py L78-109 @ 3afb0a9), and
      its runner requires that value to equal the compiled max_context_length (neuronx_distributed_model_runner.py
      L604-694).
    - max_model_len: the largest token-generation bucket, the longest sequence a decode step has a graph for.
    - continuous_batching: False, as compiled (config.py); deploy refuses to serve a batch above 1 without it.
    - sampling: on the device with the compiled top_k (the compile's on_device_sampling_config), or on the host;
      vllm-neuron takes the compiled model's tokens in the first case (docs/vllm.md section 12).
    - long_context: the chunk, the block KV layout and whether vLLM serves prefix caching (long_context.serve_fields),
      or None."""
    releases_, stack = serving_stack(record["params"]["toolchain"], p.sdk)
    return {"max_model_len": max(p.tkg_buckets),
            "max_prompt_length": long_context.max_context_length(p.cte_buckets, p.tkg_buckets, p.block_kv),
            "tensor_parallel_size": p.tp, "max_num_seqs": p.batch_size, "continuous_batching": False,
            "dtype": p.dtype, "lineage": p.lineage, "env": record["config"]["env"],
            "sampling": sampling_record(record["config"]["neuron_config"]),
            "stack": {"releases": releases_, "vllm": stack.vllm, "vllm_neuron": stack.vllm_neuron},
            **long_context.serve_fields(p)}


def sampling_record(neuron_config: dict) -> dict:
    """How the compiled model picks each token: {"on_device": true, "top_k": k} where the compile's NeuronConfig has
    an on_device_sampling_config (config.py), else {"on_device": false}."""
    sampling = neuron_config.get("on_device_sampling_config")
    return {"on_device": False} if sampling is None else {"on_device": True, "top_k": sampling["top_k"]}


def nxdi_tree_record(out: Path, p: NeuronPackageParams) -> dict | None:
    """vllm/serve.json's "nxdi_tree": where the recipe installs NxDI from source, that tree (the port's repository and
    commit, the package under src/, its version) and what the bundle's port imports from NxDI, which `qbuild serve`
    checks the host's NxDI (or --nxdi-tree) for (qbuild.backends.neuron.nxdi_tree); None otherwise."""
    tree = p.nxdi_tree
    if tree is None:
        return None
    lineage = LINEAGES[p.lineage]
    module = lineage.module_dir(out / "port") / (lineage.text_module.replace(".", "/") + ".py")
    return {"git": tree.git, "rev": tree.rev, "src": "src", "version": tree.version,
            "imports": nxdi_tree.port_imports(module)}


# tokenizer_config.json classes that transformers 5 writes and 4.x cannot resolve, and what 4.x reads the same
# tokenizer.json with. vLLM 0.16's stack has transformers 4.x (>= 4.56, < 5: its METADATA); 4.57.6's AutoTokenizer
# resolves `tokenizer_class` by name and raises "Tokenizer class ... does not exist" for an unknown one
# (models/auto/tokenization_auto.py L1092, L1144-1156), while PreTrainedTokenizerFast is always known (L807-809) and
# reads tokenizer.json. transformers 5 reads PreTrainedTokenizerFast as its TokenizersBackend.
_TOKENIZER_CLASSES_4X = {"TokenizersBackend": "PreTrainedTokenizerFast"}


def tokenizer_for_every_stack(out: Path) -> None:
    """Rewrite the bundle's tokenizer_config.json so that transformers 4.x and 5 both read its tokenizer.json."""
    path = out / "tokenizer_config.json"
    if not path.is_file() or not (out / "tokenizer.json").is_file():
        return
    config = json.loads(path.read_text())
    replacement = _TOKENIZER_CLASSES_4X.get(config.get("tokenizer_class"))
    if replacement is not None:
        # A hardlink to the converted checkpoint's blob: atomic_write replaces the link, never the blob.
        atomic_write(path, (jsonio.dumps({**config, "tokenizer_class": replacement}, indent=2, sort_keys=True)
                            + "\n").encode())


def flat_config(config: dict) -> dict:
    """`config` with its text model's fields also at the top level, as the ports' own loaders lay them out
    (Qwen35InferenceConfig.from_pretrained, contrib/models/Qwen3.5-35B-A3B/src/modeling_qwen35.py L2193-2213 @ 4bcdc54;
    vllm/hf_qwen35_config.py L24-35, PR 173 @ 03db3ef).

    vllm-neuron reads num_key_value_heads and head_dim from the top level (_get_model_configs,
    neuronx_distributed_model_loader.py L895-917 @ 3afb0a9) and builds the port's InferenceConfig from this file
    through NxDI's load_pretrained_config (L187-191),
    which keeps text_config nested (utils/hf_adapter.py L69-76 @ ef2731e), so validate_config would find the text
    fields missing (models/config.py L905-910 @ c63afe0). text_config stays for the readers that want it, and a field
    the top level has keeps its value. A flat config (Coder-Next's) comes back unchanged."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        return config
    flat = dict(config)
    for key, value in text.items():
        if key not in ("architectures", "model_type"):
            flat.setdefault(key, value)
    rope = text.get("rope_parameters") or {}
    for key in ("rope_theta", "partial_rotary_factor"):
        if key not in flat and key in rope:
            flat[key] = rope[key]
    if "intermediate_size" not in flat and "moe_intermediate_size" in text:
        flat["intermediate_size"] = text["moe_intermediate_size"]
    return flat


def nxdi_registry_key(architecture: str | None) -> tuple[str, str]:
    """The MODEL_TYPES entry (model, task) vllm-neuron looks the app class up under for a config's architecture
    (_get_neuron_model_cls, neuronx_distributed_model_loader.py L925-982 @ 3afb0a9): the part before "For" in lower
    case, and the rest in kebab case, ConditionalGeneration read as CausalLM. (Its renames, gptoss, qwen3moe, qwen2vl,
    qwen3vl and Llava, L961-974, touch none of the families qbuild builds.)"""
    if not architecture or "For" not in architecture:
        raise BuildError(f"config.json: architecture {architecture!r} has no \"For\"; vllm-neuron cannot look a model "
                         "class up for it")
    model, task = architecture.split("For", 1)
    task = "CausalLM" if task == "ConditionalGeneration" else task
    return model.lower(), re.sub("([a-z0-9])([A-Z])", r"\1-\2", re.sub("(.)([A-Z][a-z]+)", r"\1-\2", task)).lower()


def _add_checkpoint_banks(ctx: Context, p: NeuronPackageParams, shards: list[Path]) -> None:
    """The zero `hybrid_gdn_checkpoint_cache.*` banks a long-context compile takes as weights, which NxD's sharding
    never writes: the port's compile script adds them to every shard after compile (_ensure_hybrid_checkpoint_weights,
    contrib/models/Qwen3.6-27B/test/integration/qwen36_27b_compile_fp8.py L135-212 @ 03db3ef). The model has them only
    with the hybrid APC manager (contrib/models/Qwen3.6-27B/src/modeling_qwen35.py L5618-5626), which every
    long-context compile has (qbuild.backends.neuron.long_context), with max_gdn_checkpoint_slots slots each
    (HybridGDNCheckpointCache, L4075-4140); the package's shard check then holds them to the compiled model's list."""
    from qbuild.model.arch import arch_from_config
    from qbuild.backends.neuron.layout.hybrid import gdn_checkpoint_banks

    arch = arch_from_config(json.loads((ctx.inputs["converted"] / "config.json").read_text()))
    banks = gdn_checkpoint_banks(arch, p.tp, p.dtype, slots=p.block_kv.checkpoint_slots)
    for shard in shards:
        _add_tensors(shard, banks)


def _reloadable_kv_quant_config(config_path: Path) -> None:
    """What the Qwen3.6-27B FP8 port does to neuron_config.json after compile (_sanitize_reloadable_neuron_config,
    qwen36_27b_compile_fp8.py L87-105 @ 03db3ef): NxDI serialises the QuantizationType defaults of kv_quant_config as
    nested objects that KVQuantizationConfig cannot read back, so a direct-cast config is written as just that."""
    config = json.loads(config_path.read_text())
    nc = config.get("neuron_config", config)
    kv = nc.get("kv_quant_config")
    if isinstance(kv, dict) and kv.get("direct_cast", True):
        nc["kv_quant_config"] = {"direct_cast": True}
        atomic_write(config_path, (jsonio.dumps(config, indent=2, sort_keys=True) + "\n").encode())


def _add_tensors(shard: Path, extra: dict) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(shard)
    tensors.update({k: v.clone() for k, v in extra.items()})
    with staged(shard) as tmp:   # replaces the hardlink, never the store's blob behind it
        save_file(tensors, tmp)
