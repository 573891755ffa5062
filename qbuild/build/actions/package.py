"""package: converted configs + tokenizer, per-rank shards and every compiled graph -> one deployable bundle.

Files are hardlinked from the (immutable) inputs, so packaging copies nothing; the bundle's layout and manifest
are described in qbuild/store/bundle.py. A neuron bundle is NxDI's compiled directory as the port's class loads it.
"""

from __future__ import annotations

import json
from pathlib import Path

from qbuild.core import jsonio
from qbuild.build.actions import RunContext
from qbuild.store.bundle import write_manifest
from qbuild.recipe.params import NeuronPackageParams, PackageParams, parse_package
from qbuild.store.files import atomic_write, link_or_copy, staged


def _link_tree(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> None:
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if path.is_file() and rel.parts[0] not in skip:
            link_or_copy(path, dst / rel)


def _meta(p: PackageParams, graphs: dict) -> dict:
    meta = {"family": p.family, "backend": p.backend, "tp": p.tp, "ep": p.ep,
            "batch_size": p.batch_size, "seq_len": p.seq_len, "dtype": p.dtype,
            "buckets": {"cte": list(p.cte_buckets), "tkg": list(p.tkg_buckets), "vision": list(p.vision_buckets)},
            "graphs": dict(sorted(graphs.items()))}
    if isinstance(p, NeuronPackageParams):
        meta.update(lineage=p.lineage, ranks=p.ranks)
    return meta


def run(ctx: RunContext) -> None:
    p = parse_package(ctx.params)
    # The unsharded text weights stay out: a bundle ships the per-rank shards.
    _link_tree(ctx.inputs["converted"], ctx.out, skip=("text",))
    _link_tree(ctx.inputs["shard"], ctx.out)
    graphs = _neuron(ctx, p) if isinstance(p, NeuronPackageParams) else _cpu(ctx, p)
    doc = write_manifest(ctx.out, _meta(p, graphs))
    ctx.log(f"bundle: {len(doc['files'])} files, {sum(f['size'] for f in doc['files'].values())} bytes")


def _cpu(ctx: RunContext, p: PackageParams) -> dict:
    graphs = {}
    for name, tree in sorted(ctx.inputs.items()):
        if name.startswith("compile:"):
            graph = name.removeprefix("compile:")
            _link_tree(tree, ctx.out / "graphs")
            graphs[graph] = f"graphs/{graph}.pt2"
    expected = {f"cte-{b}" for b in p.cte_buckets} | {f"tkg-{b}" for b in p.tkg_buckets} | \
        {f"vision-{b}" for b in p.vision_buckets}
    if set(graphs) != expected:
        raise ValueError(f"package got graphs {sorted(graphs)}, planned {sorted(expected)}")
    return graphs


def _neuron(ctx: RunContext, p: NeuronPackageParams) -> dict:
    """NxDI's compiled directory: model.pt and NxDI's neuron_config.json from the text compile, weights/ from the
    shard step, vision_encoder_<bucket>.pt per vision bucket (the names NxDI's load() and the port's
    NeuronQwen35VisionModelWrapper.load_compiled() read: application_base.py @ ef2731e, modeling_qwen35_vision.py
    @ 4bcdc54). On a host with the SDK, every shard is checked against the weights the compiled model takes."""
    from qbuild.backends import neuron

    text = ctx.inputs["compile:text"]
    for name in ("model.pt", "neuron_config.json", neuron.QBUILD_RECORD):
        link_or_copy(text / name, ctx.out / name)
    # The port's source travels with the bundle: serving hosts import the app class from it (bundle/port/).
    _link_tree(ctx.inputs["port"], ctx.out / "port")
    graphs = {"text": "model.pt"}
    for b in p.vision_buckets:
        name = neuron.vision_file(b)
        link_or_copy(ctx.inputs[f"compile:vision-{b}"] / name, ctx.out / name)
        graphs[f"vision-{b}"] = name
    shards = sorted((ctx.out / "weights").glob("tp*_sharded_checkpoint.safetensors"))
    if len(shards) != p.ranks:
        raise ValueError(f"package got {len(shards)} shards, planned {p.ranks} ranks")
    expected = neuron.expected_weights(text)
    if p.fp8 != "none":
        _fp8_port_steps(ctx, p, shards, expected)
    if expected is not None:
        for shard in shards:
            neuron.check_shards(expected, shard)
    return graphs


def _fp8_port_steps(ctx: RunContext, p: NeuronPackageParams, shards: list[Path],
                    expected: dict[str, tuple[int, ...]] | None) -> None:
    """What the Qwen3.6-27B FP8 port does after compile (PR 173 @ 03db3ef, qwen36_27b_compile_fp8.py): zero
    `hybrid_gdn_checkpoint_cache.*` banks in every shard, and a reloadable kv_quant_config.

    The banks are weights of the compiled model only when its config sets use_hybrid_apc_manager
    (contrib/models/Qwen3.6-27B/src/modeling_qwen35.py:5620-5626 @ 03db3ef), so only the banks that the compiled model
    takes (`expected`, its metaneff) are added; without the SDK to read that, all of them, as the port's script adds
    them."""
    from qbuild.model.arch import arch_from_config
    from qbuild.model.convert.hybrid import gdn_checkpoint_banks

    arch = arch_from_config(json.loads((ctx.inputs["converted"] / "config.json").read_text()))
    banks = gdn_checkpoint_banks(arch, p.tp, p.dtype)
    if expected is not None:
        banks = {name: t for name, t in banks.items() if name in expected}
    if banks:
        for shard in shards:
            _add_tensors(shard, banks)
    config_path = ctx.out / "neuron_config.json"
    config = json.loads(config_path.read_text())
    nc = config.get("neuron_config", config)
    kv = nc.get("kv_quant_config")
    # NxDI serialises the QuantizationType defaults as nested objects that KVQuantizationConfig cannot read back.
    if isinstance(kv, dict) and kv.get("direct_cast", True):
        nc["kv_quant_config"] = {"direct_cast": True}
        atomic_write(config_path, (jsonio.dumps(config, indent=2, sort_keys=True) + "\n").encode())


def _add_tensors(shard: Path, extra: dict) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(shard)
    tensors.update({k: v.clone() for k, v in extra.items()})
    with staged(shard) as tmp:   # replaces the hardlink, never the store's blob behind it
        save_file(tensors, tmp)
