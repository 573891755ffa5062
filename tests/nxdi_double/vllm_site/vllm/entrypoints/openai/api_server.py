"""`python -m vllm.entrypoints.openai.api_server` of vLLM 0.16.0 (L519-531) with vllm-neuron 0.5 as the platform.

What the double does, in vLLM's order: parse the command line (exactly the flags below, each of vLLM 0.16.0's
arg_utils.py / cli_args.py: an unknown one ends it with argparse's exit 2), load the general plugins (arg_utils.py
L612-614), read the HF config with AutoConfig and no trust_remote_code unless asked (transformers_utils/config.py
L155-188), let the platform update the configuration (vllm_neuron/platform.py L290-387), start the engine core in a
process of the multiprocessing method VLLM_WORKER_MULTIPROC_METHOD names, the configuration its argument (v1/engine/
utils.py L99-128), which loads the general plugins again (v1/engine/core.py L91-93) and the model (the loader
double) and, for a block KV layout, the runner's block table over vLLM's blocks (the runner double's BlockTable),
then serve HTTP until SIGINT or SIGTERM (exit 0). A failed engine start exits 1. The engine core stays up and runs
one model step per request the server takes.

It answers GET /v1/models, and POST /v1/completions only with what vLLM refuses first: a prompt longer than
max_prompt_length (platform_overrides.py L96-109 @ 3afb0a9, a 400) or not shorter than max_model_len (a 400); any
other prompt is run through the engine core as one prefill step (the runner's execute_model), and answered 501 since
the double cannot generate, or 500 with the step's error, as vLLM answers a request whose engine step raised.
POST /v1/chat/completions with an image part answers as vLLM 0.16 does for an architecture whose registered class is
not multimodal: a 400, "<model> is not a multimodal model" (multimodal/registry.py:232-233, from the chat parser's
item tracker, entrypoints/chat_utils.py:501-541; the ValueError becomes a 400 in
entrypoints/openai/engine/serving.py:640-662); any other chat request is checked and run as a completion of its
messages' text (the double applies no chat template).
/v1 needs the API key where one is set (api_server.py L239-240: --api-key, else VLLM_API_KEY).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import sys
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm.entrypoints.openai.api_server", allow_abbrev=False)
    p.add_argument("model_tag", nargs="?")
    p.add_argument("--model", required=True)
    p.add_argument("--served-model-name", nargs="+")
    p.add_argument("--host")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--num-gpu-blocks-override", type=int)
    # BlockSize = Literal[1, 8, 16, 32, 64, 128, 256] (config/cache.py L22) -> argparse choices (arg_utils.py
    # L164-178, L290-291); MambaCacheMode and MambaDType likewise (config/cache.py L33-34).
    p.add_argument("--block-size", type=int, choices=[1, 8, 16, 32, 64, 128, 256])
    p.add_argument("--mamba-cache-mode", choices=["align", "all", "none"], default="none")
    p.add_argument("--mamba-ssm-cache-dtype", choices=["auto", "float16", "float32"], default="auto")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--additional-config", type=json.loads, default={})
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--generation-config")
    # Frontend flags (entrypoints/openai/cli_args.py L99, L107, L158, L164; arg_utils.py L507 reasoning_parser).
    p.add_argument("--api-key", nargs="+")
    p.add_argument("--chat-template")
    p.add_argument("--enable-auto-tool-choice", action="store_true")
    p.add_argument("--tool-call-parser")
    p.add_argument("--reasoning-parser")
    return p


def engine_core(vllm_config, conn) -> None:
    """The engine-core process: plugins, then the model and its KV cache; reports ("ready", facts) or ("failed",
    traceback), then runs one model step per prompt length it is sent (None ends it)."""
    try:
        from neuronx_distributed_inference._double import record
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        from vllm_neuron.worker.neuronx_distributed_model_runner import NeuronxDistributedModelRunner

        runner = NeuronxDistributedModelRunner(vllm_config)
        runner.load_model()
        spec = runner.check_kv_cache_spec()
        table = runner.initialize_kv_cache()
        model, limit = runner.model, runner.max_prompt_length
        hf = type(vllm_config.hf_config)
        record("vllm_engine_core", start_method=multiprocessing.get_start_method(),
               hf_config_cls=f"{hf.__module__}.{hf.__qualname__}", app_cls=type(model).__name__,
               max_prompt_length=limit, max_model_len=vllm_config.max_model_len,
               block_size=vllm_config.block_size, num_gpu_blocks=vllm_config.num_gpu_blocks_override,
               chunked_prefill=vllm_config.enable_chunked_prefill, prefix_caching=vllm_config.enable_prefix_caching,
               max_num_batched_tokens=vllm_config.max_num_batched_tokens, kv_cache_layers=sorted(spec),
               mamba_cache_mode=vllm_config.mamba_cache_mode, generation_config=vllm_config.generation_config,
               block_owners=None if table is None else {str(b): who for b, who in sorted(table.owner.items())
                                                        if not who.startswith("vLLM's block ")},
               cache_blocks=None if table is None else table.blocks,
               neuron_config=runner.neuron_config, additional_config=vllm_config.additional_config)
        conn.send(("ready", limit))
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        return
    while (tokens := conn.recv()) is not None:
        try:
            runner.execute_model(tokens)
            record("vllm_engine_step", prompt_tokens=tokens, ok=True)
            conn.send(("ok", None))
        except Exception as e:
            record("vllm_engine_step", prompt_tokens=tokens, ok=False, error=str(e))
            conn.send(("failed", f"{type(e).__name__}: {e}"))


class Engine:
    """The front process's handle on the engine-core process: one step at a time."""

    def __init__(self, config) -> None:
        import threading

        context = multiprocessing.get_context(os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "fork"))
        self.conn, child = context.Pipe()
        self.proc = context.Process(target=engine_core, name="EngineCore_DP0",
                                    kwargs={"vllm_config": config, "conn": child})
        self.proc.start()          # with spawn, the kwargs are pickled here
        child.close()
        self.lock = threading.Lock()
        try:
            status, detail = self.conn.recv()
        except EOFError:
            status, detail = "failed", f"the engine core process died (exit code {self.proc.join() or self.proc.exitcode})"
        if status != "ready":
            self.proc.join()
            sys.stderr.write(f"{detail}\nRuntimeError: Engine core initialization failed. See root cause above.\n")
            sys.exit(1)

    def step(self, prompt_tokens: int) -> str | None:
        """None where the model step ran, else its error."""
        with self.lock:
            self.conn.send(prompt_tokens)
            status, detail = self.conn.recv()
        return None if status == "ok" else detail

    def stop(self) -> None:
        self.conn.send(None)
        self.proc.join()


def load_tokenizer(model: str):
    """AutoTokenizer as transformers 4.57 resolves it: an unknown tokenizer_class raises (vllm/__init__.py)."""
    from pathlib import Path

    from transformers import AutoTokenizer
    from vllm import TRANSFORMERS_4_UNKNOWN_TOKENIZERS

    config = Path(model) / "tokenizer_config.json"
    name = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    if name in TRANSFORMERS_4_UNKNOWN_TOKENIZERS:
        raise ValueError(f"Tokenizer class {name} does not exist or is not currently imported.")
    return AutoTokenizer.from_pretrained(model)


def chat_text(body: dict) -> str | None:
    """The text of a chat request's messages, or None where one carries an image part."""
    texts = []
    for message in body.get("messages", []):
        content = message.get("content")
        if isinstance(content, list):
            if any(part.get("type") in ("image_url", "image", "image_pil") for part in content):
                return None
            texts += [part.get("text", "") for part in content]
        else:
            texts.append(str(content or ""))
    return "\n".join(texts)


def prompt_answer(n: int, config, engine: Engine) -> tuple[int, dict]:
    """(status, body) of a prompt of n tokens: what vLLM refuses first, else one engine step."""
    if config.max_prompt_length is not None and n > config.max_prompt_length:
        message = (f"This model's maximum prompt length is {config.max_prompt_length} tokens. However, your "
                   f"request has {n} prompt tokens. Please reduce the length of the prompt.")
        return 400, {"error": {"message": message, "type": "BadRequestError", "code": 400}}
    if n >= config.max_model_len:
        return 400, {"error": {"message": f"This model's maximum context length is {config.max_model_len} tokens.",
                               "code": 400}}
    error = engine.step(n)
    if error is not None:
        return 500, {"error": {"message": error, "type": "InternalServerError", "code": 500}}
    return 501, {"error": "the vLLM contract double does not generate"}


def serve_http(args, config, engine: Engine) -> None:
    from vllm.model_executor.models import ModelRegistry

    tokenizer = load_tokenizer(args.model)
    names = args.served_model_name or [args.model]
    keys = [k for k in (args.api_key or [os.environ.get("VLLM_API_KEY")]) if k]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:
            pass

        def reply(self, code: int, doc: dict) -> None:
            body = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def authorised(self) -> bool:
            if keys and self.headers.get("Authorization") not in [f"Bearer {k}" for k in keys]:
                self.reply(401, {"error": "Unauthorized"})
                return False
            return True

        def do_GET(self) -> None:
            if not self.authorised():
                return
            if self.path == "/v1/models":
                self.reply(200, {"object": "list", "data": [{"id": n, "object": "model",
                                                             "max_model_len": config.max_model_len} for n in names]})
            else:
                self.reply(404, {"error": "not found"})

        def do_POST(self) -> None:
            if not self.authorised():
                return
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path == "/v1/chat/completions":
                from neuronx_distributed_inference._double import record

                record("vllm_chat_request", chat_template_kwargs=body.get("chat_template_kwargs"))
                text = chat_text(body)
                architecture = (getattr(config.hf_config, "architectures", None) or [None])[0]
                if text is None and not ModelRegistry.is_multimodal(architecture):
                    return self.reply(400, {"error": {"message": f"{args.model} is not a multimodal model",
                                                      "type": "BadRequestError", "param": None, "code": 400}})
                if text is None:
                    return self.reply(501, {"error": "the vLLM contract double does not generate"})
                return self.reply(*prompt_answer(len(tokenizer(text)["input_ids"]), config, engine))
            if self.path != "/v1/completions":
                return self.reply(404, {"error": "not found"})
            self.reply(*prompt_answer(len(tokenizer(body.get("prompt", ""))["input_ids"]), config, engine))

    try:
        server = ThreadingHTTPServer((args.host or "0.0.0.0", args.port), Handler)
    except OSError:   # the port is taken: exit as vLLM does, the engine process with it (else exit waits on it)
        engine.stop()
        raise

    def stop(signum, frame) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    server.server_close()
    engine.stop()


def main(argv: list[str]) -> None:
    from transformers import AutoConfig
    from vllm.config import VllmConfig
    from vllm.plugins import load_general_plugins, load_platform

    args = parser().parse_args(argv)
    load_general_plugins()
    platform = load_platform()
    hf_config = AutoConfig.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    config = VllmConfig(model=args.model, hf_config=hf_config, dtype=args.dtype,
                        max_model_len=args.max_model_len or hf_config.max_position_embeddings,
                        tensor_parallel_size=args.tensor_parallel_size, max_num_seqs=args.max_num_seqs or 32,
                        num_gpu_blocks_override=args.num_gpu_blocks_override,
                        enable_prefix_caching=bool(args.enable_prefix_caching),
                        enable_chunked_prefill=bool(args.enable_chunked_prefill),
                        additional_config=args.additional_config, block_size=args.block_size,
                        max_num_batched_tokens=args.max_num_batched_tokens, mamba_cache_mode=args.mamba_cache_mode,
                        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
                        generation_config=args.generation_config or "auto")
    platform.check_and_update_config(config)
    serve_http(args, config, Engine(config))


if __name__ == "__main__":
    main(sys.argv[1:])
