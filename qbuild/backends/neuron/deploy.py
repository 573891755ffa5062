"""Running and serving a neuron bundle: a verify run on this host's NeuronCores (under their lock), and the
instructions that serve a pulled bundle with vLLM's Neuron plugin."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

from qbuild.backends.neuron.driver import QBUILD_RECORD, require_sdk, run_sdk, verify_request
from qbuild.backends.neuron.params import NeuronTextCompile
from qbuild.backends.neuron.ports import LINEAGES
from qbuild.core.errors import BuildError
from qbuild.recipe.params import ParamsError, parse

# --- running a bundle (verify) -------------------------------------------------------------------------------------

def run_bundle(bundle: Path, port: Path, prompts: list[list[int]], new_tokens: int, scratch: Path, log):
    """Load a neuron bundle with its port's class on this host's NeuronCores and generate greedily on each prompt.
    Returns (greedy tokens per prompt, {"prompt<i>": first-step logits (1, V)})."""
    from safetensors.torch import load_file

    require_sdk()
    record = json.loads((bundle / QBUILD_RECORD).read_text())
    try:
        params = parse(NeuronTextCompile, record["params"], "params")
    except ParamsError as e:
        raise BuildError(f"{bundle / QBUILD_RECORD}: does not record the neuron text compile a neuron bundle runs "
                         f"({e})") from None
    logits = scratch / "logits.safetensors"
    with neuron_cores(log):
        res = run_sdk("verify", verify_request(params, bundle, port, prompts, new_tokens, logits),
                       record["config"]["env"], scratch, log)
    return res["greedy"], load_file(logits)


@contextmanager
def neuron_cores(log):
    """Hold this host's NeuronCores for one bundle run. The Neuron runtime gives a process every core of the host
    unless NEURON_RT_VISIBLE_CORES names some, and a core serves one process at a time (Neuron runtime configuration
    guide, awsdocs-neuron.readthedocs-hosted.com/en/latest/neuron-runtime/guides/configuration-guide.html), so a
    second verify of the same build (-j > 1) or of another build would fail as its runtime starts. Where the variable
    is set (Ray sets it for a task that asks for neuron_cores: ray/_private/accelerators/neuron.py
    set_current_process_visible_accelerator_ids, ray 2.60.0) the cores named are this process's own; elsewhere this
    user's runs take turns under one lock."""
    from filelock import FileLock, Timeout

    from qbuild.core.userdir import runtime_dir

    directory = runtime_dir()
    if os.environ.get("NEURON_RT_VISIBLE_CORES") or directory is None:
        yield
        return
    lock = FileLock(os.path.join(directory, "neuron-cores.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log("waiting for the NeuronCores: another bundle run on this host holds them")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()

def until_pad(record: dict, pad: int | None) -> dict:
    """`record` with its greedy tokens cut after the first one that is the bundle's pad id. On a neuron bundle a
    generated pad token is fed back as padding: the main ports zero a decode token's DeltaNet update where the input id
    is the pad id (_qwen36_deltanet_padding_mask, contrib/models/Qwen3.5-35B-A3B/src/modeling_qwen35.py:5108-5166 @
    4bcdc54) and the Coder-Next converter zeroes its embedding row (convert/nxd.py hidden_columns_pad_row_zeroed), so
    the tokens after it follow another input than transformers' did."""
    tokens = record["greedy"]
    if pad is None or pad not in tokens:
        return record
    return {**record, "greedy": tokens[:tokens.index(pad) + 1]}


# --- serving a pulled bundle with vLLM ----------------------------------------------------------------------------

def serve_instructions(bundle: Path, manifest: dict) -> dict:
    """The environment and command line that serve a pulled neuron bundle with vLLM's Neuron plugin.

    vllm-neuron loads a precompiled directory only through NEURON_COMPILED_ARTIFACTS (otherwise it recompiles
    under <model>/neuron-compiled-artifacts: vllm_neuron/worker/neuronx_distributed_model_loader.py @ a5ef7c8, and
    the NxDI vLLM user guide), builds its config from --model's config.json, and finds the model class in NxDI's
    MODEL_TYPES under the lower-cased architecture name before "For" (the Coder-Next port registers itself so:
    vllm/register_model.py, PR 170). The values must match the compiled config: overrides are ignored on load.
    qbuild compiles a contiguous KV cache (no block KV layout): with prefix caching off the plugin sets block_size to
    max_model_len, that layout, and with it on it would page the cache (vllm_neuron/platform.py @ a5ef7c8 L203-210), so
    the command turns prefix caching and chunked prefill off, as the Coder-Next launcher does
    (vllm/start_vllm_server.sh @ 753c7f5).
    """
    record = json.loads((bundle / QBUILD_RECORD).read_text())
    lineage = LINEAGES[record["config"]["lineage"]]
    config = json.loads((bundle / "config.json").read_text())
    arch = (config.get("architectures") or ["?For"])[0]
    model_type = arch.split("For", 1)[0].lower()
    env = {"NEURON_COMPILED_ARTIFACTS": str(bundle), "VLLM_PLUGINS": "neuron",
           "VLLM_NEURON_FRAMEWORK": "neuronx-distributed-inference",
           "PYTHONPATH": str(lineage.module_dir(bundle / "port")), **record["config"]["env"]}
    batch = manifest["batch_size"]
    command = ["vllm", "serve", str(bundle), "--tensor-parallel-size", str(manifest["ranks"]),
               "--max-model-len", str(manifest["seq_len"]), "--max-num-seqs", str(batch),
               "--num-gpu-blocks-override", str(batch), "--no-enable-prefix-caching", "--no-enable-chunked-prefill"]
    register = (f"from neuronx_distributed_inference.utils.constants import MODEL_TYPES; "
                f"from {lineage.text_module} import {lineage.app_class}; "
                f"MODEL_TYPES[{model_type!r}] = {{'causal-lm': {lineage.app_class}}}")
    return {"env": env, "command": command, "register": register}
