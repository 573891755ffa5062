"""Running a neuron bundle: a verify run on this host's NeuronCores (under their lock). Serving one with vLLM is
qbuild.backends.neuron.vllm_serve."""

from __future__ import annotations

import glob
import json
import os
from contextlib import contextmanager
from pathlib import Path

from qbuild.backends.neuron.driver import QBUILD_RECORD, require_sdk, run_sdk, verify_request
from qbuild.backends.neuron.params import NeuronTextCompile
from qbuild.core.errors import BuildError
from qbuild.recipe.params import ParamsError, parse

# --- running a bundle (verify) -------------------------------------------------------------------------------------

def run_bundle(bundle: Path, port: Path, prompts: list[list[int]], new_tokens: int, scratch: Path, log):
    """Load a neuron bundle with its port's class on this host's NeuronCores and generate greedily on each prompt.
    Returns (greedy tokens per prompt, {"prompt<i>": first-step logits (1, V)}, or None for a bundle that samples on
    the device and returns no logits)."""
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
    return res["greedy"], load_file(logits) if res["logits"] else None


def neuron_devices() -> list[str]:
    """The Neuron devices of this host (the driver's /dev/neuron<N> nodes)."""
    return sorted(glob.glob("/dev/neuron[0-9]*"))


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
    4bcdc54) and the Coder-Next converter zeroes its embedding row (layout/nxd.py hidden_columns_pad_row_zeroed), so
    the tokens after it follow another input than transformers' did."""
    tokens = record["greedy"]
    if pad is None or pad not in tokens:
        return record
    return {**record, "greedy": tokens[:tokens.index(pad) + 1]}
