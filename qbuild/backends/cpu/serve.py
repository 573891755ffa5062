"""qbuild's own OpenAI-compatible server for a CPU bundle (export, inductor): `/v1/models`, `/v1/completions` and
`/v1/chat/completions`, answered by qbuild's runtime (qbuild.model.runtime), on Starlette and uvicorn.

What the runtime can do decides what the server accepts:
- Decoding is greedy. `temperature` may be 0 or left out, `top_p` 1, `n` and `best_of` 1, the penalties 0; `seed` is
  accepted and changes nothing. Any other value, `stop` sequences, `logprobs`, `echo`, `suffix`, `logit_bias` and
  fields this server does not know are a 400 naming the field, never silently ignored.
- Generation ends at `max_tokens` or after the end-of-sequence token (the bundle's generation_config and tokenizer
  name it). Without `max_tokens`, a completion stops after 16 tokens (OpenAI's default for this route) and a chat
  reply after as many as the cache holds.
- One prompt per request. A prompt longer than the bundle allows (its largest context-encoding bucket, or with
  chunked prefill its KV cache), or a prompt plus `max_tokens` beyond its KV cache, is a 400 with the runtime's own
  message, checked before anything is generated, so a stream is never cut short by it.
- `usage.prompt_tokens_details.cached_tokens` counts the prompt tokens the runtime's prefix cache answered, as
  OpenAI's usage does.
- One runtime serves every request, one generation at a time (a lock): concurrent requests queue and each gets the
  tokens it would get alone.
- A chat request is rendered with the bundle tokenizer's chat template when it has one; otherwise each message
  becomes a line "<role>: <content>" and the prompt ends with "assistant:".

`stream: true` answers in server-sent events in OpenAI's chunk format, closed by `data: [DONE]`; the text of the
chunks, concatenated, is the non-streamed answer. Ctrl-C (SIGINT) and SIGTERM stop the server; it exits 0.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time
import uuid
from typing import Any, Callable, Literal

import uvicorn
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from qbuild.backends.base import ServeOptions
from qbuild.core.errors import UserError

COMPLETION_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions
SHUTDOWN_GRACE_S = 5                 # an answer still being generated when a stop signal comes may finish this long


# --- requests --------------------------------------------------------------------------------------------------

class RequestError(Exception):
    """A request this server refuses: an HTTP status and OpenAI's error object."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": str(self), "type": self.kind, "param": self.param, "code": None}},
                            status_code=self.status)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Request(BaseModel):
    """The fields both routes take. Unknown fields are refused (extra="forbid"), so nothing is ignored silently."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None


# field -> (the values the greedy runtime can honour, what to say otherwise)
_GREEDY = {
    "temperature": ((None, 0), "qbuild's runtime decodes greedily: temperature must be 0 or left out"),
    "top_p": ((None, 1), "qbuild's runtime decodes greedily: top_p must be 1 or left out"),
    "n": ((None, 1), "one completion per request"),
    "best_of": ((None, 1), "one completion per request"),
    "presence_penalty": ((None, 0), "penalties are not supported: the runtime decodes greedily"),
    "frequency_penalty": ((None, 0), "penalties are not supported: the runtime decodes greedily"),
    "logit_bias": ((None, {}), "logit_bias is not supported: the runtime decodes greedily"),
    "stop": ((None, [], ""), "stop sequences are not supported: generation ends at max_tokens or the end-of-sequence "
                             "token"),
    "logprobs": ((None, False, 0), "logprobs are not supported"),
    "top_logprobs": ((None, 0), "logprobs are not supported"),
    "echo": ((False,), "echo is not supported"),
    "suffix": ((None, ""), "suffix (insertion) is not supported"),
}


def _parse(model: type[BaseModel], body: bytes) -> BaseModel:
    try:
        doc = json.loads(body)
    except ValueError as e:
        raise RequestError(f"the request body is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        req = model.model_validate(doc)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            raise RequestError(f"{field}: not supported by qbuild's server", field) from None
        raise RequestError(f"{field}: {err['msg']}", field or None) from None
    for field, (allowed, why) in _GREEDY.items():
        if field in type(req).model_fields and getattr(req, field) not in allowed:
            raise RequestError(f"{field}: {why}", field)
    return req


# --- generating ------------------------------------------------------------------------------------------------

class Generator:
    """The one runtime of a server and the lock that gives it one generation at a time."""

    def __init__(self, runtime, name: str):
        self.runtime, self.name = runtime, name
        self.created = int(time.time())
        self.eos = runtime.eos_ids()
        self._lock = threading.Lock()

    def prompt_ids(self, prompt: str | list[str] | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.runtime.encode(prompt)
        if prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise RequestError("prompt: one prompt per request", "prompt")
            return self.runtime.encode(prompt[0])
        vocab = self.runtime.arch.vocab_size
        bad = [i for i in prompt if not 0 <= i < vocab]
        if bad:
            raise RequestError(f"prompt: token id {bad[0]} is outside this model's vocabulary (0..{vocab - 1})",
                               "prompt")
        return list(prompt)

    def chat_ids(self, messages: list[ChatMessage]) -> list[int]:
        turns = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                  else "".join(p.text for p in m.content)} for m in messages]
        tokenizer = self.runtime.tokenizer
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        else:
            text = "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant:"
        return self.runtime.encode(text)

    def new_tokens(self, n: int, requested: int | None, default: int | None, param: str) -> int:
        """How many tokens to generate after a prompt of `n` tokens: what the request asked for, else `default`
        (None: all the cache holds), within what the bundle's buckets allow, or a 400 naming the limit."""
        if n == 0:
            raise RequestError("the prompt is empty", "prompt")
        try:
            self.runtime.check_prompt(n)
        except UserError as e:   # the runtime's message names the limit: its largest bucket or its KV length
            raise RequestError(str(e), "prompt") from None
        room = self.runtime.max_new_tokens_after(n)
        if room < 1:
            raise RequestError(f"a prompt of {n} tokens fills this bundle's KV cache ({self.runtime.tkg[-1]} slots); "
                               "no token can follow it", "prompt")
        wanted = requested if requested is not None else min(default or room, room)
        try:
            self.runtime.check_lengths(n, wanted)
        except UserError as e:
            raise RequestError(str(e), param) from None
        return wanted

    def run(self, ids: list[int], max_new: int, on_token: Callable[[int], bool] | None = None):
        with self._lock:
            return self.runtime.generate(ids, max_new, on_token=on_token)

    def finish_reason(self, token_ids: list[int]) -> str:
        return "stop" if token_ids and token_ids[-1] in self.eos else "length"

    def usage(self, prompt: int, generation) -> dict:
        generated = len(generation.token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
                "prompt_tokens_details": {"cached_tokens": generation.cached_tokens}}


class _Done:
    def __init__(self, generation):
        self.generation = generation


def _sse(doc: Any) -> str:
    return f"data: {json.dumps(doc, ensure_ascii=False)}\n\n"


class Api:
    """The routes, over one Generator."""

    def __init__(self, generator: Generator):
        self.gen = generator

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/models", self.models, methods=["GET"]),
                                 Route("/v1/completions", self.completions, methods=["POST"]),
                                 Route("/v1/chat/completions", self.chat, methods=["POST"])])

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    def _model_card(self) -> dict:
        rt = self.gen.runtime
        return {"id": self.gen.name, "object": "model", "created": self.gen.created, "owned_by": "qbuild",
                "max_model_len": rt.tkg[-1], "max_prompt_tokens": rt.max_prompt_tokens}

    def _check_model(self, req: _Request) -> None:
        if req.model != self.gen.name:
            raise RequestError(f"the model `{req.model}` does not exist; this server serves `{self.gen.name}`",
                               "model", status=404, kind="not_found_error")

    async def completions(self, request: Request) -> Response:
        try:
            req = _parse(CompletionRequest, await request.body())
            self._check_model(req)
            ids = self.gen.prompt_ids(req.prompt)
            max_new = self.gen.new_tokens(len(ids), req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "max_tokens")
        except RequestError as e:
            return e.response()
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str, finish: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": self.gen.name,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

        if req.stream:
            return self._stream(ids, max_new, None, chunk, rid, created, "text_completion", req.stream_options)
        generation = await asyncio.get_running_loop().run_in_executor(None, self.gen.run, ids, max_new)
        doc = chunk(generation.text, self.gen.finish_reason(generation.token_ids))
        doc["usage"] = self.gen.usage(len(ids), generation)
        return JSONResponse(doc)

    async def chat(self, request: Request) -> Response:
        try:
            req = _parse(ChatRequest, await request.body())
            self._check_model(req)
            if req.max_tokens is not None and req.max_completion_tokens is not None:
                raise RequestError("max_tokens and max_completion_tokens: give one of them", "max_tokens")
            ids = self.gen.chat_ids(req.messages)
            requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            max_new = self.gen.new_tokens(len(ids), requested, None, param)
        except RequestError as e:
            return e.response()
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str | None, finish: str | None) -> dict:
            delta = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.gen.name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        if req.stream:
            return self._stream(ids, max_new, chunk(None, None), chunk, rid, created, "chat.completion.chunk",
                                req.stream_options)
        generation = await asyncio.get_running_loop().run_in_executor(None, self.gen.run, ids, max_new)
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": self.gen.name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": generation.text},
                         "logprobs": None, "finish_reason": self.gen.finish_reason(generation.token_ids)}],
            "usage": self.gen.usage(len(ids), generation)})

    def _stream(self, ids: list[int], max_new: int, first: dict | None, chunk: Callable, rid: str, created: int,
                kind: str, options: StreamOptions | None) -> StreamingResponse:
        """Server-sent events: `first` (if any), a chunk per piece of new text, the finishing chunk, the usage chunk
        where asked for, and `data: [DONE]`. The generation runs in a worker thread and hands each token over; a
        client that goes away stops it at the next token."""
        include_usage = bool(options and options.include_usage)
        tokenizer = self.gen.runtime.tokenizer

        async def events():
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue = asyncio.Queue()
            gone = threading.Event()

            def post(item) -> None:
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, item)
                except RuntimeError:   # the loop is closed: the server stopped while this answer was generated
                    gone.set()

            def on_token(token: int) -> bool:
                post(token)
                return gone.is_set()

            def work() -> None:
                try:
                    post(_Done(self.gen.run(ids, max_new, on_token)))
                except Exception as e:   # reported in the stream: its status line went out long ago
                    post(e)

            def with_usage(doc: dict) -> dict:
                return {**doc, "usage": None} if include_usage else doc

            loop.run_in_executor(None, work)
            tokens: list[int] = []
            sent = ""
            try:
                if first is not None:
                    yield _sse(with_usage(first))
                while not isinstance(item := await queue.get(), _Done):
                    if isinstance(item, Exception):
                        yield _sse({"error": {"message": f"generation failed: {item}", "type": "internal_error",
                                              "param": None, "code": None}})
                        return
                    tokens.append(item)
                    # The text of the tokens so far, less a trailing incomplete character (a byte-level token may
                    # be half of one), is final: later tokens only add to it.
                    text = tokenizer.decode(tokens, skip_special_tokens=True)
                    if len(text) > len(sent) and text.startswith(sent) and not text.endswith("\ufffd"):
                        yield _sse(with_usage(chunk(text[len(sent):], None)))
                        sent = text
                generation = item.generation
                rest = generation.text[len(sent):] if generation.text.startswith(sent) else ""
                yield _sse(with_usage(chunk(rest, self.gen.finish_reason(generation.token_ids))))
                if include_usage:
                    yield _sse({"id": rid, "object": kind, "created": created, "model": self.gen.name,
                                "choices": [], "usage": self.gen.usage(len(ids), generation)})
                yield "data: [DONE]\n\n"
            finally:
                gone.set()

        return StreamingResponse(events(), media_type="text/event-stream")


# --- running ---------------------------------------------------------------------------------------------------

def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (any free port for 0). Clients may connect from now on: their connections wait
    in the backlog until the server takes them."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UserError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    family, _, _, _, address = infos[0]
    try:
        return socket.create_server(address, family=family, backlog=128)
    except OSError as e:
        raise UserError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror})") from None


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def serve(runtime, options: ServeOptions) -> int:
    """Answer requests on host:port until SIGINT or SIGTERM, then finish (within SHUTDOWN_GRACE_S) and return 0."""
    app = Api(Generator(runtime, options.name)).app()
    sock = listen(options.host, options.port)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                           timeout_graceful_shutdown=SHUTDOWN_GRACE_S))

    # While uvicorn serves, its own handlers take SIGINT and SIGTERM and shut it down; afterwards it restores the
    # handlers it found and raises the signal again. These are the handlers it finds: a signal that comes before it
    # starts stops it at once, and the one it raises again ends nothing, so a stopped server returns 0.
    def stop(signum, frame) -> None:
        server.should_exit = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        options.on_ready(url_of(sock))
        server.run(sockets=[sock])
    finally:
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
