"""Serving a neuron VL bundle with qbuild's own OpenAI server (qbuild.backends.openai_server, the CPU bundles' server)
over the port's VL classes (vl_runtime), which take images: vllm-neuron 0.5 runs no image of these models
(docs/vllm.md section 11). The server runs in a child process, as vLLM does for a text bundle (server_process), with
the environment of the bundle's own record: the compile's environment (LNC, target, the port's switches) set before
NxDI is imported, the port on PYTHONPATH; `--dry-run` prints that command and environment. docs/vision.md section 8.

    python -m qbuild.backends.neuron.vl_serve BUNDLE --name NAME --host HOST --port PORT [--allow-image-urls]

is the child: the API key, where one is set, reaches it as QBUILD_API_KEY, never on its command line, and the child
removes it from the environment its own children inherit once read (its initial environment block, which
/proc/<pid>/environ shows to the same user and root, keeps it for the child's life).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

from qbuild.backends.base import ServeOptions
from qbuild.backends.neuron import vllm_serve
from qbuild.backends.neuron.package import VISION_HOST, VISION_RECORD, VLLM_DIR
from qbuild.backends.neuron.server_process import child_env, free_ports, run_children
from qbuild.backends.neuron.vl_runtime import VL_CLASS, VL_MODULE
from qbuild.backends.openai_server.describe import no_server_args, server_doc
from qbuild.core.errors import InfraError, UserError

ENTRY = "qbuild.backends.neuron.vl_serve"
API_KEY_ENV = "QBUILD_API_KEY"
# Such a bundle was vLLM's before qbuild's server took its images, so arguments after `--` are vLLM's.
VLLM_ARGS_WAY_OUT = "pass --server vllm to serve it with vLLM (text only), which takes them"
# What the child imports: the Neuron SDK the port runs on, and the server's own packages (the `serve` extra).
PACKAGES = (("neuronx_distributed_inference", "neuronx-distributed-inference"),
            ("neuronx_distributed", "neuronx-distributed"), ("torch_neuronx", "torch-neuronx"),
            ("starlette", "starlette"), ("uvicorn", "uvicorn"))


def check_servable(bundle: Path, manifest: dict, serve: dict) -> None:
    """UserError where qbuild's server cannot serve the bundle through the port's VL classes, whatever the host: no
    vision encoders, a batch above 1 (the port's VL generate scatters batch row 0's image only:
    modeling_qwen35_vl.py:443-451 @ 4bcdc54), or a block KV layout (its generate runs NxDI's contiguous cache)."""
    if not manifest.get("buckets", {}).get("vision"):
        raise UserError(f"--server qbuild: {bundle} is a neuron text bundle, which vLLM's Neuron plugin serves; drop "
                        "--server (docs/vllm.md)")
    if serve["max_num_seqs"] != 1:
        raise UserError(f"{bundle / vllm_serve.VLLM_SERVE}: batch size {serve['max_num_seqs']}; the port's VL "
                        "generate takes one prompt at a time (modeling_qwen35_vl.py:443-451 @ 4bcdc54)")
    if serve.get("long_context"):
        raise UserError(f"{bundle / vllm_serve.VLLM_SERVE}: a bundle with chunked prefill is served by vLLM with the "
                        "port's patch; the port's VL generate runs a contiguous KV cache: pass --server vllm")
    host = bundle / VISION_HOST / "model.safetensors"
    if not host.is_file():
        raise UserError(f"{host}: missing; this VL bundle was packaged without the host-side vision weights the "
                        "port's wrapper reads (by an older qbuild): build it again, or pass --server vllm")


def serve_command(bundle: Path, manifest: dict, options: ServeOptions, python: str, port: int | None = None) -> dict:
    """qbuild's server over the port's VL classes: the document `--dry-run` prints (the server, its limits and what it
    takes as an image, as for a CPU bundle; the classes and files it loads; the child's environment and command)."""
    serve, plugin = vllm_serve.read_serve(bundle)
    check_servable(bundle, manifest, serve)
    no_server_args(bundle, "a neuron VL bundle", options.server_args, VLLM_ARGS_WAY_OUT)
    src = vllm_serve.nxdi_tree_src(serve, options.nxdi_tree)
    pythonpath = [(bundle / VLLM_DIR / plugin["port_dir"]).resolve(), *([src] if src else [])]
    env = {**serve["env"], "PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath)}
    if options.api_key:
        env[API_KEY_ENV] = options.api_key
    port = options.port if port is None else port
    command = [python, "-m", ENTRY, str(bundle), "--name", options.name, "--host", options.host, "--port", str(port),
               *(["--allow-image-urls"] if options.allow_image_urls else [])]
    vision = json.loads((bundle / VISION_RECORD).read_text())
    # The largest context-encoding bucket less one token, as the runtime holds prompts to it
    # (vl_runtime.NeuronVLRuntime.max_prompt_tokens; a VL bundle has no chunked prefill).
    doc = server_doc(manifest["backend"], bundle, options.name, options.host, port, serve["max_prompt_length"] - 1,
                     serve["max_model_len"], vision["buckets"], options.allow_image_urls)
    doc["runtime"] = {"classes": f"{VL_MODULE}.{VL_CLASS} over {plugin['module']}.{plugin['app_class']} and "
                                 "src.modeling_qwen35_vision.NeuronQwen35VisionModelWrapper (the port's own)",
                      "text_model": str(bundle), "vision_encoders": {b: e["file"] for b, e in
                                                                     vision["encoders"].items()},
                      "vision_host_weights": str(bundle / VISION_HOST), "tiling": vision["tiling"],
                      "sampling": serve.get("sampling")}
    if serve.get("nxdi_tree"):
        doc["nxdi_tree"] = {"tree": vllm_serve.tree_name(serve["nxdi_tree"]), "on_path": str(src) if src else None}
    return {**doc, "env": env, "command": command}


def printable(doc: dict) -> dict:
    """`doc` with the API key masked."""
    return {**doc, "env": {k: "***" if k == API_KEY_ENV else v for k, v in doc["env"].items()}}


def require_packages() -> None:
    """InfraError naming the first package the child would fail to import here."""
    for module, dist in PACKAGES:
        if importlib.util.find_spec(module) is None:
            raise InfraError(f"serving a neuron VL bundle with qbuild's server needs the Neuron SDK and qbuild's "
                             f"`serve` extra in this interpreter; {dist} (`import {module}`) is not installed here. "
                             "`qbuild serve --dry-run` prints the command for a host that has them")


def serve(bundle: Path, manifest: dict, options: ServeOptions) -> int:
    """Check the host and the bundle, run qbuild's server over the port's VL classes in a child process (a session of
    its own, Ctrl-C and SIGTERM handed on, the URL announced once /v1/models answers: the server listens once the
    bundle is loaded), and check after it stopped that the bundle is as it was."""
    from qbuild.model.bundle import check_files

    serve_doc, _ = vllm_serve.read_serve(bundle)
    check_servable(bundle, manifest, serve_doc)
    no_server_args(bundle, "a neuron VL bundle", options.server_args, VLLM_ARGS_WAY_OUT)
    require_packages()
    vllm_serve.require_nxdi(serve_doc, vllm_serve.nxdi_tree_src(serve_doc, options.nxdi_tree))
    check_files(bundle, manifest, digests=not options.digests_checked)
    vllm_serve.check_load_preconditions(bundle, serve_doc)
    doc = serve_command(bundle, manifest, options, sys.executable, options.port or free_ports(options.host, 1)[0])
    options.log(f"starting qbuild's server on {bundle} through the port's {VL_CLASS} (prompts up to "
                f"{doc['max_prompt_tokens']} tokens, {doc['max_model_len']} in all; one image per chat)")
    return run_children([(doc["command"], child_env(doc["env"]))], [doc["url"]], options, bundle, manifest,
                        ["qbuild's server"])


# --- the child ---------------------------------------------------------------------------------------------------

def main(argv: list[str]) -> int:
    """Load the bundle through the port's VL classes, then answer requests until SIGINT or SIGTERM (exit 0); a
    refusal is one line on stderr, exit 2, an unusable host exit 3."""
    from qbuild.backends.neuron.vl_runtime import NeuronVLRuntime
    from qbuild.backends.openai_server.serve import serve as serve_openai

    parser = argparse.ArgumentParser(prog=f"python -m {ENTRY}")
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--name", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--allow-image-urls", action="store_true")
    args = parser.parse_args(argv)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    # Removed as it is read, before the SDK loads: whatever this process starts would otherwise inherit the key.
    api_key = os.environ.pop(API_KEY_ENV, None) or None
    try:
        options = ServeOptions(name=args.name, host=args.host, port=args.port, log=log, on_ready=lambda url: None,
                               allow_image_urls=args.allow_image_urls, api_key=api_key)
        runtime = NeuronVLRuntime.load(args.bundle)
        return serve_openai(runtime, options)
    except UserError as e:
        log(f"error: {e}")
        return 2
    except InfraError as e:
        log(f"error: {e}")
        return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
