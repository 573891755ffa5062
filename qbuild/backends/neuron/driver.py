"""The neuron backend's compiles through the Neuron SDK: the SDK and toolchain checks, the work directories and
their locks, the store's Neuron compile cache (qbuild.backends.neuron.compile_cache), and the driver that runs each
SDK operation in a fresh interpreter (qbuild.backends.neuron.sdk_worker) with a hermetic environment
(qbuild.backends.neuron.worker_env).

- `compile_text` runs ONE NxDI `compile()` for a recipe: NxDI always builds both submodels with every CTE and TKG
  bucket into one `model.pt` (application_base.py); per-bucket reuse is the Neuron compile cache's job.
- `compile_vision` traces the port's `CPUVisionModel` with the real vision weights, one bucket per node
  (contrib/models/Qwen3.5-35B-A3B/test/integration/compile_vision_encoder.py @ 4bcdc54).
Where the SDK does not import, the real paths fail with one line naming the missing package.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import sys
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from qbuild.backends.neuron import compile_cache, long_context
from qbuild.backends.neuron.config import inference_kwargs, neuron_config
from qbuild.backends.neuron.params import NeuronCompile, NeuronTextCompile, NeuronVisionCompile
from qbuild.backends.neuron.ports import LINEAGES
from qbuild.backends.neuron.worker_env import worker_env
from qbuild.core import jsonio
from qbuild.core.errors import BuildError, InfraError
from qbuild.recipe.params import to_json
from qbuild.store.local import LocalStore

REQUIRED_PACKAGES = (("neuronx_distributed_inference", "neuronx-distributed-inference"),
                     ("neuronx_distributed", "neuronx-distributed"),
                     ("torch_neuronx", "torch-neuronx"))
QBUILD_RECORD = "qbuild-neuron.json"   # qbuild's own record; NxDI's neuron_config.json is never touched
WORK_DIR = "neuron-work"               # under the user's cache directory (qbuild.core.userdir.cache_dir)


def require_sdk() -> None:
    """Raise one line naming the first Neuron SDK package that does not import here."""
    for module, dist in REQUIRED_PACKAGES:
        if importlib.util.find_spec(module) is None:
            raise BuildError(f"backend neuron: the Neuron SDK is not installed here ({dist} / `import {module}` "
                             "failed); build on a Neuron host, or pass --backend inductor for a CPU proof")


def _matches(installed: str, pin: str) -> bool:
    # Wheels carry a local suffix (0.10.18399+ed62453e: NxDI setup.py get_version @ c63afe0); a pin may name a
    # prefix of the release (2.25.3371 for 2.25.3371.0).
    public = installed.split("+", 1)[0]
    return public == pin or public.startswith(pin + ".")


def check_toolchain(pins: dict) -> None:
    """Raise one line where an installed SDK package differs from the recipe's pin (keys are made from the pins)."""
    for dist, pin in sorted(pins.items()):
        try:
            installed = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            raise BuildError(f"backend neuron: {dist} is not installed here; the recipe pins {dist} {pin}") from None
        if not _matches(installed, pin):
            raise BuildError(f"backend neuron: {dist} {installed} is installed, the recipe pins {pin} (toolchain."
                             f"{dist.replace('-', '_')}); use the pinned SDK or change the pin")


def work_root() -> Path:
    """Where the compile work directories live: $QBUILD_NEURON_WORKDIR, else a folder of this user's cache directory;
    made 0700 and refused where another user could write in it (trace() wipes and rewrites what it finds there)."""
    from qbuild.core.userdir import cache_dir, private_dir

    root = Path(os.environ.get("QBUILD_NEURON_WORKDIR") or cache_dir(WORK_DIR))
    try:
        return private_dir(root)
    except (OSError, ValueError) as e:
        raise InfraError(f"backend neuron: the compile work directory {root}: {e}; set QBUILD_NEURON_WORKDIR to a "
                         "directory of your own") from None


def work_dir(params: NeuronCompile) -> Path:
    """BASE_COMPILE_WORK_DIR of a compile: the same absolute path on every run of an architecture by this user.

    trace() wipes it (model_builder.py @ fbac349), so concurrent compiles each need their own; and NxD hashes a
    `--logfile=<absolute work dir>/...` flag into every NEFF's compile-cache key, so a path that changed with the
    buckets would make every bucket miss. The folder is therefore named by the params without the bucket lists,
    and held under a file lock while a compile uses it. Hosts share NEFFs through a remote only where the work
    directory's path is the same (QBUILD_NEURON_WORKDIR set alike).
    """
    from qbuild.core.hashing import digest_json

    stable = {k: v for k, v in to_json(params).items() if k not in ("cte_buckets", "tkg_buckets")}
    return work_root() / f"{params.graph}-{digest_json(stable)[:16]}"


def cache_group(params: NeuronCompile, wd: Path) -> tuple[str, str, str]:
    """(toolchain, target, group) of a compile's folder of the store's compile cache: the recipe's neuronx-cc pin, the
    target, and the work directory (only compiles in one work directory can share a NEFF: its path is in the key)."""
    from qbuild.core.hashing import digest_bytes

    return (params.toolchain["neuronx-cc"], params.compiler.target,
            f"{params.graph}-{digest_bytes(str(wd).encode())[:16]}")


@contextmanager
def locked(path: Path):
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        yield path


def run_sdk(op: str, request: dict, env: dict, cwd: Path, log) -> dict:
    """Run one SDK operation in a fresh interpreter (qbuild.backends.neuron.sdk_worker), so that the environment
    NxD reads at import (NEURON_LOGICAL_NC_CONFIG, BASE_COMPILE_WORK_DIR, ...) and the port on sys.path are this node's
    alone: `env` over the few host variables worker_env allows, nothing else of the host."""
    import subprocess

    # Imported (it imports nothing of the SDK at module level) rather than named by a string, so that the worker's
    # code is in the key of every node that runs it (qbuild.planning.closures follows imports, never strings).
    from qbuild.backends.neuron import sdk_worker

    cwd.mkdir(parents=True, exist_ok=True)
    req = cwd / f"{op}-request.json"
    res = cwd / f"{op}-result.json"
    req.write_text(jsonio.dumps(request, indent=1, sort_keys=True))
    proc = subprocess.run([sys.executable, "-m", sdk_worker.__name__, op, str(req), str(res)],
                          cwd=cwd, env=worker_env(env, cwd, runtime=op == "verify"), capture_output=True, text=True)
    for line in (proc.stdout + proc.stderr).splitlines()[-200:]:
        log(line)
    if proc.returncode != 0:
        last = next((line for line in reversed(proc.stderr.splitlines()) if line.strip()), "no output")
        raise BuildError(f"backend neuron: {op} failed: {last.removeprefix('error: ')}")
    return json.loads(res.read_text())


@contextmanager
def compile_dirs(params: NeuronCompile, store, log, progress=None):
    """(work dir, compile cache folder) of a compile, both held for it: the work dir under its lock, the store's
    cache folder through qbuild.backends.neuron.compile_cache.using (pruned, and synchronised with the remote, if any,
    its transfers reported to `progress`)."""
    if store is None:
        raise BuildError("backend neuron: no store to keep the Neuron compile cache in")
    local = LocalStore(Path(store.local))
    with locked(work_dir(params)) as wd, \
            compile_cache.using(local, store.remote, store.push, *cache_group(params, wd), log, progress) as cache:
        yield wd, cache


def compile_text(params: NeuronTextCompile, port: Path, out: Path, scratch: Path, store, log, progress=None) -> dict:
    """ONE NxDI compile of a recipe's text model: `out` becomes NxDI's compiled directory (model.pt and NxDI's own
    neuron_config.json), plus metaneff/ (each NEFF's expected weights) and qbuild-neuron.json. `store` is the
    StoreSpec the build writes to (its compile cache)."""
    require_sdk()
    check_toolchain(params.toolchain)
    if params.block_kv is not None:
        long_context.require_serving_patch(port)
    cfg = neuron_config(params)
    model_dir = scratch / "hf"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(jsonio.dumps(inference_kwargs(params), indent=1, sort_keys=True))
    with compile_dirs(params, store, log, progress) as (wd, cache):
        env = {**cfg["env"], "BASE_COMPILE_WORK_DIR": f"{wd}/", "NEURON_COMPILE_CACHE_URL": str(cache)}
        run_sdk("text", text_request(params, cfg, port, model_dir, out, wd), env, scratch, log)
    write_record(out, {"params": to_json(params), "config": cfg})
    log(f"neuron: compiled {cfg['neffs']} NEFFs into model.pt ({cfg['app_class']})")
    return cfg


def compile_vision(params: NeuronVisionCompile, port: Path, weights: Path, out: Path, scratch: Path, store,
                   log, progress=None) -> dict:
    """Trace the port's vision encoder at one patch bucket with the real weights inlined: CPUVisionModel on one core
    -> vision_encoder_<b>.pt, or, with vision tp > 1, NeuronQwen35VisionModel over tp cores -> bucket_<b>/tp_<r>.pt
    (config.vision_config)."""
    require_sdk()
    check_toolchain(params.toolchain)
    cfg = neuron_config(params)
    with compile_dirs(params, store, log, progress) as (wd, cache):
        run_sdk("vision" if params.tp == 1 else "vision_tp", vision_request(params, cfg, port, weights, out, wd),
                {**cfg["env"], "NEURON_COMPILE_CACHE_URL": str(cache),
                 "NEURON_PLATFORM_TARGET_OVERRIDE": params.compiler.target}, scratch, log)
    write_record(out, {"params": to_json(params), "config": cfg}, name=f"qbuild-vision-{params.bucket}.json")
    log(f"neuron: traced the vision encoder at bucket {params.bucket}" +
        (f" over {params.tp} ranks" if params.tp > 1 else ""))
    return cfg


# The requests of qbuild.backends.neuron.sdk_worker (its functions name the fields they read): JSON, because the SDK
# side runs in a fresh interpreter; each is made here from the typed params and the NxDI configuration made from them.

def text_request(params: NeuronTextCompile, cfg: dict, port: Path, model_dir: Path, out: Path, wd: Path) -> dict:
    lineage = LINEAGES[params.lineage]
    return {"config": cfg, "kwargs": inference_kwargs(params), "port": str(lineage.module_dir(port)),
            "model_dir": str(model_dir), "out": str(out), "work_dir": str(wd)}


def vision_request(params: NeuronVisionCompile, cfg: dict, port: Path, weights: Path, out: Path, wd: Path) -> dict:
    lineage = LINEAGES[params.lineage]
    return {"config": cfg, "vision": asdict(params.vision), "dtype": params.dtype, "module": lineage.vision_module,
            "port": str(lineage.module_dir(port)), "weights": str(weights), "out": str(out / cfg["file"]),
            "work_dir": str(wd)}


def verify_request(params: NeuronTextCompile, bundle: Path, port: Path, prompts: list[list[int]], new_tokens: int,
                   logits: Path) -> dict:
    lineage = LINEAGES[params.lineage]
    return {"port": str(lineage.module_dir(port)), "module": lineage.text_module, "app_class": lineage.app_class,
            "bundle": str(bundle), "prompts": prompts, "new_tokens": new_tokens,
            "pad_token_id": params.pad_token_id or 0, "logits": str(logits),
            "text_prompt_dummy": lineage.text_prompt_dummy}


def write_record(out: Path, doc: dict, name: str = QBUILD_RECORD) -> None:
    (out / name).write_text(jsonio.dumps(doc, indent=1, sort_keys=True) + "\n")


# --- checking shards against what the compiled model expects -------------------------------------------------------

def expected_weights(compiled: Path) -> dict[str, tuple[int, ...]] | None:
    """{checkpoint key: per-rank shape} of the compiled model's INPUT_WEIGHT inputs, read from the metaneff.pb files
    the compile kept (torch_neuronx.proto.metaneff_pb2.MetaNeff; NxD trace/hlo_utils.py get_input_order @ fbac349).
    None where torch_neuronx is not installed (the check runs on hosts with the SDK)."""
    if importlib.util.find_spec("torch_neuronx") is None:
        return None
    from torch_neuronx.proto import metaneff_pb2

    expected: dict[str, tuple[int, ...]] = {}
    for path in sorted((compiled / "metaneff").rglob("*.pb")):
        meta = metaneff_pb2.MetaNeff()
        meta.ParseFromString(path.read_bytes())
        for tensor in meta.input_tensors:
            if tensor.type == metaneff_pb2.MetaTensor.Type.INPUT_WEIGHT:
                expected[tensor.checkpoint_key.decode()] = tuple(tensor.shape)
    return expected


def check_shards(expected: dict[str, tuple[int, ...]], shard: Path) -> None:
    """Raise one line naming the first weight the compiled model expects that a rank's shard lacks or shapes
    differently (every rank holds the same names and per-rank shapes)."""
    from qbuild.model.convert.safetensors_header import read_header

    header = read_header(shard, shard.name)
    extra = sorted(set(header) - set(expected))
    if extra:
        raise BuildError(f"{shard.name}: {extra[0]}: the shard holds it and the compiled model takes no such weight")
    for name, shape in sorted(expected.items()):
        entry = header.get(name)
        if entry is None:
            raise BuildError(f"{shard.name}: {name}: the compiled model expects it and the shard has no such tensor")
        if tuple(entry.shape) != shape:
            raise BuildError(f"{shard.name}: {name}: shape {list(entry.shape)}, the compiled model expects "
                             f"{list(shape)}")
