"""A neuron bundle: NxDI's compiled directory as the port's class loads it, with the port's source beside it."""

from __future__ import annotations

import json
from pathlib import Path

from qbuild.backends.base import StepContext
from qbuild.backends.neuron import driver
from qbuild.backends.neuron.config import vision_file
from qbuild.backends.neuron.params import NeuronPackageParams
from qbuild.core import jsonio
from qbuild.model.fp8 import policy as fp8_policy
from qbuild.store.files import atomic_write, link_or_copy, link_tree, staged


def package(ctx: StepContext) -> dict[str, str]:
    """NxDI's compiled directory: model.pt and NxDI's neuron_config.json from the text compile, weights/ from the
    shard step, vision_encoder_<bucket>.pt per vision bucket (the names NxDI's load() and the port's
    NeuronQwen35VisionModelWrapper.load_compiled() read: application_base.py @ ef2731e, modeling_qwen35_vision.py
    @ 4bcdc54). On a host with the SDK, every shard is checked against the weights the compiled model takes."""
    p: NeuronPackageParams = ctx.params
    text = ctx.inputs["compile:text"]
    for name in ("model.pt", "neuron_config.json", driver.QBUILD_RECORD):
        link_or_copy(text / name, ctx.out / name)
    # The port's source travels with the bundle: serving hosts import the app class from it (bundle/port/).
    link_tree(ctx.inputs["port"], ctx.out / "port")
    graphs = {"text": "model.pt"}
    for b in p.vision_buckets:
        name = vision_file(b)
        link_or_copy(ctx.inputs[f"compile:vision-{b}"] / name, ctx.out / name)
        graphs[f"vision-{b}"] = name
    shards = sorted((ctx.out / "weights").glob("tp*_sharded_checkpoint.safetensors"))
    if len(shards) != p.ranks:
        raise ValueError(f"package got {len(shards)} shards, planned {p.ranks} ranks")
    expected = driver.expected_weights(text)
    if fp8_policy(p.fp8).quantises:
        _fp8_port_steps(ctx, p, shards, expected)
    if expected is not None:
        for shard in shards:
            driver.check_shards(expected, shard)
    return graphs


def _fp8_port_steps(ctx: StepContext, p: NeuronPackageParams, shards: list[Path],
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
