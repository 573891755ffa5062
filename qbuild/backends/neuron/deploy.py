"""Running and serving a neuron bundle: a verify run on this host's NeuronCores (under their lock), and serving a bundle
with vLLM's Neuron plugin (the command line made of the bundle's own record, and the process that runs it)."""

from __future__ import annotations

import importlib.util
import json
import os
from contextlib import contextmanager
from pathlib import Path

from qbuild.backends.base import ServeOptions
from qbuild.backends.neuron.driver import QBUILD_RECORD, require_sdk, run_sdk, verify_request
from qbuild.backends.neuron.package import VLLM_DIR, VLLM_PLUGIN, VLLM_SERVE
from qbuild.backends.neuron.params import NeuronTextCompile
from qbuild.core.errors import BuildError, InfraError, UserError
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


# --- serving a bundle with vLLM (docs/vllm.md) ---------------------------------------------------------------------

# The modules the server imports: vLLM's OpenAI server (vllm-neuron README.md L70 @ a5ef7c8, and the Coder-Next
# launcher, vllm/start_vllm_server.sh L44 @ 753c7f5, start it so), the Neuron plugin, and NxDI under it.
VLLM_ENTRY = "vllm.entrypoints.openai.api_server"
VLLM_PACKAGES = (("vllm", "vllm"), ("vllm_neuron", "vllm-neuron"),
                 ("neuronx_distributed_inference", "neuronx-distributed-inference"))
READY_POLL_S = 1.0


def serve_command(bundle: Path, manifest: dict, name: str, host: str, port: int, python: str) -> dict:
    """The environment and command line that serve `bundle` with vLLM's Neuron plugin, made of the bundle's own
    record (vllm/serve.json and the plugin the package step wrote), never of the recipe.

    - NEURON_COMPILED_ARTIFACTS makes the plugin load this compiled directory instead of compiling again
      (neuronx_distributed_model_loader.py L196-199, L214-218 @ a5ef7c8); what vLLM passes as overrides is then
      ignored (L221-226), so every flag below restates what the compile fixed.
    - PYTHONPATH: the bundle's vllm/ (the plugin that registers the model, qbuild.backends.neuron.vllm_plugin) and
      the port's import root; VLLM_PLUGINS names the Neuron platform plugin and the bundle's.
    - --max-model-len: the largest context-encoding bucket (or the largest token-generation bucket where that is
      smaller). NxDI refuses a longer prompt at request time (models/model_wrapper.py L770-777 @ 4bcdc54), and vLLM
      has no separate prompt limit, so this length bounds prompt and answer together.
    - --no-enable-prefix-caching and --no-enable-chunked-prefill: qbuild compiles a contiguous KV cache (no block
      layout); without prefix caching the plugin sets block_size = max_model_len, which is that layout (platform.py
      L203-207 @ a5ef7c8), so no --block-size is passed. The Coder-Next launcher does the same
      (vllm/start_vllm_server.sh L51-52 @ 753c7f5).
    - --num-gpu-blocks-override = max-num-seqs: the plugin asks for ceil(max_model_len / block_size) * max_num_seqs
      blocks (README.md L117 @ a5ef7c8), one per sequence with that block size.
    - --tensor-parallel-size: the compiled tensor-parallel degree; --dtype: the compiled dtype (as the Qwen3.6-27B
      launcher passes it, vllm/start_vllm_server.sh L652 @ 03db3ef).
    VLLM_NEURON_FRAMEWORK is not set: nothing in vllm-neuron @ a5ef7c8 reads it.
    """
    try:
        serve = json.loads((bundle / VLLM_SERVE).read_text())
        plugin = json.loads((bundle / VLLM_DIR / "qbuild_vllm_plugin.json").read_text())
    except FileNotFoundError as e:
        raise UserError(f"{e.filename}: missing; this neuron bundle was packaged without vLLM's glue (by an older "
                        "qbuild): build it again") from None
    pythonpath = [bundle / VLLM_DIR, (bundle / VLLM_DIR / plugin["port_dir"]).resolve()]
    env = {**serve["env"], "NEURON_COMPILED_ARTIFACTS": str(bundle), "VLLM_PLUGINS": f"neuron,{VLLM_PLUGIN}",
           "PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath)}
    batch = str(serve["max_num_seqs"])
    command = [python, "-m", VLLM_ENTRY, "--model", str(bundle), "--served-model-name", name,
               "--host", host, "--port", str(port),
               "--tensor-parallel-size", str(serve["tensor_parallel_size"]),
               "--max-model-len", str(serve["max_model_len"]), "--max-num-seqs", batch,
               "--num-gpu-blocks-override", batch, "--dtype", serve["dtype"],
               "--no-enable-prefix-caching", "--no-enable-chunked-prefill"]
    host_in_url = f"[{host}]" if ":" in host else host
    return {"server": "vllm", "backend": manifest["backend"], "bundle": str(bundle), "model": name,
            "url": f"http://{host_in_url}:{port}/v1", "max_model_len": serve["max_model_len"], "env": env,
            "command": command}


def require_vllm() -> None:
    """InfraError naming the first package of the server that does not import here."""
    for module, dist in VLLM_PACKAGES:
        if importlib.util.find_spec(module) is None:
            raise InfraError(f"serving a neuron bundle needs vLLM with the Neuron plugin and the Neuron SDK in this "
                             f"interpreter; {dist} (`import {module}`) is not installed here. `qbuild serve --dry-run` "
                             "prints the command for a host that has them")


def free_port(host: str) -> int:
    """A port nothing listens on now, for --port 0: vLLM is told a port, so one is chosen before it starts."""
    import socket

    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def serve(bundle: Path, manifest: dict, options: ServeOptions) -> int:
    """Run vLLM's OpenAI server on the bundle in a child process, in a session of its own, so that Ctrl-C and
    SIGTERM reach qbuild, which hands each on to it. The URL is announced once /v1/models answers. Returns 0 when
    vLLM ended after such a signal; InfraError when it ended by itself."""
    import signal
    import subprocess
    import sys
    import threading
    import urllib.request

    require_vllm()
    port = options.port or free_port(options.host)
    doc = serve_command(bundle, manifest, options.name, options.host, port, sys.executable)
    env = dict(os.environ, **doc["env"])
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join((doc["env"]["PYTHONPATH"], os.environ["PYTHONPATH"]))
    options.log(f"starting vLLM on {bundle} (max model length {doc['max_model_len']})")
    child = subprocess.Popen(doc["command"], env=env, start_new_session=True)
    stopping = threading.Event()

    def forward(signum, frame) -> None:
        stopping.set()
        child.send_signal(signum)

    def announce() -> None:
        while child.poll() is None and not stopping.is_set():
            try:
                with urllib.request.urlopen(doc["url"] + "/models", timeout=READY_POLL_S):
                    options.on_ready(doc["url"])
                    return
            except OSError:
                stopping.wait(READY_POLL_S)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        threading.Thread(target=announce, daemon=True).start()
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stopping.is_set():
        return 0
    raise InfraError(f"vLLM exited with code {code} before it was stopped; its output is above")
