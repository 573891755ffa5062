"""qbuild's own OpenAI-compatible server for a CPU bundle (export, inductor): `/v1/models`, `/v1/completions` and
`/v1/chat/completions`, answered by qbuild's runtime (qbuild.model.runtime), on Starlette and uvicorn.

What the runtime can do decides what the server accepts (qbuild.backends.openai_server.serve_requests holds the request schema):
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
- A request body may hold at most max_body_bytes(seq_len) bytes; a larger one is a 413, refused at once where its
  Content-Length says so, otherwise as soon as that many bytes came, never read any further (docs/serve.md).
- One runtime serves every request, one generation at a time: concurrent requests queue in arrival order and each
  gets the tokens it would get alone. A request is parsed, tokenized and checked on a worker thread, its generation
  runs on another, so the event loop only moves bytes and every route keeps answering while a long prompt is
  tokenized or an answer generated.
- A client that goes away (its connection closes) ends its generation at the next token, or before it starts; the
  next request in the queue goes on.
- A chat request is rendered with the bundle tokenizer's chat template when it has one (a template that raises is a
  400 with its message); otherwise each message becomes a line "<role>: <content>" and the prompt ends with
  "assistant:".
- With an API key, every request needs `Authorization: Bearer <key>`; without one it is a 401, before its body is read.
- A VL bundle takes one image per chat request, as an OpenAI `image_url` content part of a user message: a
  `data:image/...;base64,` URL, or an http(s) URL only with --allow-image-urls (qbuild.backends.openai_server.serve_images:
  fetched on the event loop within a deadline in all, a few at once, so a slow URL holds up no other request, and
  dropped when its client goes). The image goes where its part stands in the message (the chat template's image
  marker, expanded to the image's tokens as transformers' processor expands it), passes `qbuild run --image`'s
  limits, and runs through the vision graphs as `run` runs it, tiled where it is larger than the largest bucket.
  Anything else in its place is a 400 naming the part. The body limit grows by one image's base64 size; the text of
  the messages keeps the text limit.

`stream: true` answers in server-sent events in OpenAI's chunk format, closed by `data: [DONE]`; the text of the
chunks, concatenated, is the non-streamed answer. Ctrl-C (SIGINT) and SIGTERM stop the server: requests still waiting
for their turn get a 503 at once, the generation running may finish within SHUTDOWN_GRACE_S (then it ends with a 503,
or an error event in its stream), and the server exits 0.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import signal
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from qbuild.backends.base import ServeOptions
from qbuild.backends.openai_server.serve_images import (Fetcher, FetchesBusy, ImageSourceError, base64_size, data_url_bytes,
                                              is_remote)
from qbuild.backends.openai_server.serve_requests import (ChatMessage, ChatRequest, CompletionRequest, ImagePart, RequestError,
                                                StreamOptions, parse, shutting_down)
from qbuild.core.errors import UserError
from qbuild.model.runtime.images import MAX_IMAGE_BYTES

COMPLETION_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions
SHUTDOWN_GRACE_S = 5                 # an answer still being generated when a stop signal comes may finish this long
# uvicorn cancels what still runs this long after the grace: a generation cut at the grace stops at its next token,
# which a prefill in progress delays. A request cancelled so ends without a traceback (Guard).
STOP_MARGIN_S = 25
# The request body limit (docs/serve.md): room for the JSON around a prompt, plus a generous bound on the bytes one
# token of the bundle's sequence length takes in JSON (text averages 3-5 bytes a token, \u-escaped CJK about 9, a
# token id with its comma at most 8).
BODY_OVERHEAD_BYTES = 64 << 10
BODY_BYTES_PER_TOKEN = 32
# What one image adds to a VL bundle's limit: the largest image qbuild reads, base64-encoded, with room for a JSON
# encoder that escapes its "/" characters (1 in 64 of base64's alphabet) and for the part around it.
IMAGE_BODY_BYTES = base64_size(MAX_IMAGE_BYTES) * 33 // 32 + (4 << 10)


def max_body_bytes(seq_len: int, vision: bool = False) -> int:
    """The largest request body a server of a bundle with sequence length `seq_len` reads: the text limit, and one
    image's worth more where the bundle takes images."""
    return BODY_OVERHEAD_BYTES + BODY_BYTES_PER_TOKEN * seq_len + (IMAGE_BODY_BYTES if vision else 0)


# --- generating ------------------------------------------------------------------------------------------------

class ClientGone(Exception):
    """The client of a request closed its connection before the answer was complete."""


@dataclass
class ImageRef:
    """The one image part of a chat request, checked for where it may stand, before its bytes are had."""

    label: str        # how refusals name it: messages.<i>.content.<j>
    url: str
    remote: bool      # an http(s) URL to fetch, else a data: URL


@dataclass
class Prepared:
    """A request checked and tokenized: what to generate for it."""

    req: CompletionRequest | ChatRequest
    ids: list[int]
    max_new: int
    image: object = None   # the image the prompt's image tokens stand for (runtime.prepare_image), if any


class QueuedGeneration:
    """One generation. It runs on the generation thread in its turn, and ends early, at its next token or before it
    starts, once stopped: its client went away ("client") or the server stops ("shutdown")."""

    def __init__(self, ids: list[int], max_new: int, on_token: Callable[[int], None] | None = None, image=None):
        self.ids, self.max_new, self.on_token, self.image = ids, max_new, on_token, image
        self.started = False
        self.stopped: str | None = None
        self._lock = threading.Lock()   # orders `started` against a stop of a generation that has not started

    def stop(self, why: str) -> None:
        with self._lock:
            self.stopped = self.stopped or why

    def stop_waiting(self, why: str) -> bool:
        """Stop the generation if it has not started (it never will then); whether it had not."""
        with self._lock:
            if not self.started:
                self.stopped = self.stopped or why
            return not self.started

    def run(self, runtime):
        with self._lock:
            if self.stopped:
                return None
            self.started = True

        def step(token: int) -> bool:
            if self.on_token is not None:
                self.on_token(token)
            return self.stopped is not None

        return runtime.generate(self.ids, self.max_new, prepared=self.image, on_token=step)


class Client:
    """Whether the client of a request is still there, watched from when its body has been read until `close()`:
    once its connection closes, `gone` is set and the generation it waits for is stopped, in that same step of the event
    loop, before anything else the loop has to do."""

    def __init__(self, request: Request):
        self.gone = asyncio.Event()
        self._queued: QueuedGeneration | None = None
        self._watch = asyncio.ensure_future(self._wait(request.receive))

    async def _wait(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone.set()
        if self._queued is not None:
            self._queued.stop("client")

    def watch(self, queued: QueuedGeneration) -> None:
        self._queued = queued
        if self.gone.is_set():
            queued.stop("client")

    def close(self) -> None:
        self._watch.cancel()


class Generator:
    """The one runtime of a server, the two threads that work on it and the turns requests take there.

    Requests are prepared (parsed, tokenized, checked) on one thread and generated on another, each in arrival order.
    One at a time on each also bounds what requests can cost together: one tokenization (of a body within the limit)
    and one generation. An image URL is fetched on the event loop between two turns on the preparing thread (parsed,
    then prepared with the image's bytes), so a slow URL holds up neither thread."""

    def __init__(self, runtime, name: str, allow_image_urls: bool = False):
        self.runtime, self.name, self.allow_image_urls = runtime, name, allow_image_urls
        self.fetcher = Fetcher() if allow_image_urls else None
        self.text_limit = max_body_bytes(runtime.tkg[-1])
        self.created = int(time.time())
        self.eos = runtime.eos_ids()
        self._preparing = ThreadPoolExecutor(1, thread_name_prefix="qbuild-prepare")
        self._generating = ThreadPoolExecutor(1, thread_name_prefix="qbuild-generate")
        self._queued: set[QueuedGeneration] = set()
        self.stopping = asyncio.Event()

    # --- preparing (on the prepare thread) ---------------------------------------------------------------------
    async def prepare(self, route: type[CompletionRequest] | type[ChatRequest], body: bytes,
                      client: Client) -> Prepared:
        loop = asyncio.get_running_loop()
        if route is CompletionRequest:
            return await loop.run_in_executor(self._preparing, self._prepare_completion, body)
        req, image = await loop.run_in_executor(self._preparing, self._parse_chat, body)
        fetched = await self._fetch_for(client, image) if image is not None and image.remote else None
        return await loop.run_in_executor(self._preparing, self._prepare_chat, req, image, fetched)

    async def _fetch_for(self, client: Client, image: ImageRef) -> bytes:
        """The fetch of `image`'s URL for `client`, ended where the client goes away (ClientGone) or the server stops
        (a 503) first: a fetch nobody waits for would hold its place among the few the server makes at once until
        its deadline."""
        fetch = asyncio.ensure_future(self._fetch(image))
        watches = {asyncio.ensure_future(client.gone.wait()): "client",
                   asyncio.ensure_future(self.stopping.wait()): "stop"}
        try:
            done, _ = await asyncio.wait({fetch, *watches}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (fetch, *watches):
                task.cancel()
        if fetch in done:
            return fetch.result()
        await asyncio.gather(fetch, return_exceptions=True)   # its connection closed, its place free
        if any(watches.get(w) == "client" for w in done):
            raise ClientGone()
        raise shutting_down()

    async def _fetch(self, image: ImageRef) -> bytes:
        """An image URL's bytes, on the event loop; a 400 naming the part where they cannot be had, a 503 where the
        server fetches as many URLs as it may."""
        try:
            return await self.fetcher.fetch(image.url)
        except FetchesBusy as e:
            raise RequestError(f"{image.label}.image_url.url: {e}", "messages", status=503,
                               kind="server_error") from None
        except ImageSourceError as e:
            raise RequestError(f"{image.label}.image_url.url: {e}", "messages") from None

    def _prepare_completion(self, body: bytes) -> Prepared:
        req = parse(CompletionRequest, body)
        self._check_model(req)
        ids = self.prompt_ids(req.prompt)
        self.check_image_tokens(ids, None, "prompt")
        return Prepared(req, ids, self.new_tokens(len(ids), req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS,
                                                  "max_tokens"))

    def _parse_chat(self, body: bytes) -> tuple[ChatRequest, ImageRef | None]:
        """A chat request parsed and checked, and its image part, if any, checked for where it stands."""
        req = parse(ChatRequest, body)
        self._check_model(req)
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            raise RequestError("max_tokens and max_completion_tokens: give one of them", "max_tokens")
        self._check_text_size(req.messages)
        return req, self.chat_image(req.messages)

    def _prepare_chat(self, req: ChatRequest, ref: ImageRef | None, fetched: bytes | None) -> Prepared:
        """A parsed chat request tokenized, with its image (a data: URL's, or the bytes fetched for its URL)."""
        image = self.image(ref, fetched) if ref is not None else None
        ids = self.chat_ids(req.messages)
        if image is not None:
            try:
                ids = self.runtime.place_image(ids, image)
            except UserError as e:
                raise RequestError(f"messages: {e}", "messages") from None
        self.check_image_tokens(ids, image, "messages")
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        return Prepared(req, ids, self.new_tokens(len(ids), requested, None, param), image)

    def _check_text_size(self, messages: list[ChatMessage]) -> None:
        """A 413 where the messages' text is larger than a text-only request may be: an image's allowance in the body
        limit is for the image."""
        size = sum(len(m.role) + len(m.content.encode() if isinstance(m.content, str) else
                                     b"".join(p.text.encode() for p in m.content if not isinstance(p, ImagePart)))
                   for m in messages)
        if size > self.text_limit:
            raise RequestError(f"the messages' text is {size} bytes, more than this server takes: at most "
                               f"{self.text_limit} bytes for this bundle", status=413, code="request_too_large")

    def chat_image(self, messages: list[ChatMessage]) -> ImageRef | None:
        """The one image part of a chat request, or None; a 400 naming the part where it cannot stand where it does,
        or names no image this server takes."""
        parts = [(i, j, part, m.role) for i, m in enumerate(messages) for j, part in m.images()]
        if not parts:
            return None
        (_, _, part, role), label = parts[0], f"messages.{parts[0][0]}.content.{parts[0][1]}"
        if len(parts) > 1:
            raise RequestError(f"messages.{parts[1][0]}.content.{parts[1][1]}: one image per request ({label} is the "
                               "first)", "messages")
        if self.runtime.vision is None:
            raise RequestError(f"{label}: this model takes no images (its bundle has no vision encoder)", "messages")
        if role != "user":
            raise RequestError(f"{label}: an image goes in a user message, not a {role} message", "messages")
        try:
            return ImageRef(label, part.image_url.url, is_remote(part.image_url.url, self.allow_image_urls))
        except ImageSourceError as e:
            raise RequestError(f"{label}.image_url.url: {e}", "messages") from None

    def image(self, ref: ImageRef, fetched: bytes | None):
        """An image part's bytes (`fetched` for a URL) read and cut into patches (runtime.prepare_image); a 400 naming
        the part where it cannot be taken."""
        try:
            data = fetched if ref.remote else data_url_bytes(ref.url)
            return self.runtime.prepare_image(data, label=f"{ref.label}.image_url")
        except ImageSourceError as e:
            raise RequestError(f"{ref.label}.image_url.url: {e}", "messages") from None
        except UserError as e:   # the image's own limits, or no bucket that takes it; the message names the part
            raise RequestError(str(e), "messages") from None

    def check_image_tokens(self, ids: list[int], image, param: str) -> None:
        """A 400 where the prompt holds image tokens no image stands for (typed into its text)."""
        try:
            self.runtime.check_image_tokens(ids, image)
        except UserError as e:
            raise RequestError(f"{param}: {e}", param) from None

    def _check_model(self, req: CompletionRequest | ChatRequest) -> None:
        if req.model != self.name:
            raise RequestError(f"the model `{req.model}` does not exist; this server serves `{self.name}`",
                               "model", status=404, kind="not_found_error")

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
        """The chat rendered and tokenized; an image part becomes the model's image marker (<|vision_start|>
        <|image_pad|> <|vision_end|>), which the chat template writes for an image part where it has one."""
        from jinja2 import TemplateError

        tokenizer = self.runtime.tokenizer
        template = bool(getattr(tokenizer, "chat_template", None))
        turns = [{"role": m.role, "content": self._content(m, template)} for m in messages]
        if template:
            try:
                text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
            except TemplateError as e:   # the template's own check of the messages (raise_exception), or its fault
                raise RequestError(f"messages: the model's chat template refused them: {e}", "messages") from None
        else:
            text = "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant:"
        return self.runtime.encode(text)

    def _content(self, message: ChatMessage, template: bool) -> str | list[dict]:
        """A message's content for the chat template (its parts, where it holds an image), or as text."""
        if isinstance(message.content, str):
            return message.content
        if not message.images():
            return "".join(p.text for p in message.content)
        if template:
            return [{"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text}
                    for p in message.content]
        marker = "".join(self.runtime.tokenizer.convert_ids_to_tokens(self.runtime.image_marker()))
        return "".join(marker if isinstance(p, ImagePart) else p.text for p in message.content)

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

    # --- generating (on the generate thread) -------------------------------------------------------------------
    async def generate(self, queued: QueuedGeneration, client: Client):
        """`queued`'s generation, in its turn. ClientGone where its client went away first (the client stopped it:
        it ends at its next token, or never starts); a 503 where the server stopped before its turn came or before it
        finished."""
        future = asyncio.wrap_future(self._generating.submit(queued.run, self.runtime))
        client.watch(queued)
        self._queued.add(queued)
        watches = {asyncio.ensure_future(client.gone.wait()): "client",
                   asyncio.ensure_future(self.stopping.wait()): "stop"}
        try:
            pending: set = {future, *watches}
            while future in pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if any(watches.get(w) == "client" for w in done) and not queued.started:
                    raise ClientGone()
                if any(watches.get(w) == "stop" for w in done) and queued.stop_waiting("shutdown"):
                    raise shutting_down()
            generation = future.result()
        finally:
            self._queued.discard(queued)
            for watch in watches:
                watch.cancel()
        if queued.stopped == "client":
            raise ClientGone()
        if queued.stopped == "shutdown":
            raise RequestError("the server stopped before the answer was complete", status=503, kind="server_error")
        return generation

    def stop(self) -> None:
        """The server stops: requests waiting for their turn get a 503 at once; the generation running may go on for
        SHUTDOWN_GRACE_S, then ends at its next token."""
        self.stopping.set()
        asyncio.get_running_loop().call_later(SHUTDOWN_GRACE_S, self._cut)

    def _cut(self) -> None:
        for queued in list(self._queued):
            queued.stop("shutdown")

    def close(self) -> None:
        self._preparing.shutdown(wait=False, cancel_futures=True)
        self._generating.shutdown(wait=True, cancel_futures=True)

    def finish_reason(self, token_ids: list[int]) -> str:
        return "stop" if token_ids and token_ids[-1] in self.eos else "length"

    def usage(self, prompt: int, generation) -> dict:
        generated = len(generation.token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
                "prompt_tokens_details": {"cached_tokens": generation.cached_tokens}}


class Detokenizer:
    """The text of generated tokens, piece by piece as it becomes final, decoding only the last few tokens each time
    (vLLM's incremental detokenization): a text that ends in an incomplete character (a byte-level token may be half
    of one) waits for the next token."""

    def __init__(self, tokenizer):
        self.tokenizer, self.tokens = tokenizer, []
        self.prefix = self.read = 0   # tokens[prefix:read]: context already sent; tokens[read:]: not yet sent

    def add(self, token: int) -> str:
        self.tokens.append(token)
        before = self.tokenizer.decode(self.tokens[self.prefix:self.read], skip_special_tokens=True)
        text = self.tokenizer.decode(self.tokens[self.prefix:], skip_special_tokens=True)
        if len(text) <= len(before) or not text.startswith(before) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.tokens)
        return text[len(before):]


# --- the routes ------------------------------------------------------------------------------------------------

async def read_body(request: Request, limit: int, image: bool = False) -> bytes:
    """The request's body, or a 413 once it proves longer than `limit` bytes (`image`: the limit holds an image's
    allowance): its Content-Length says so before anything is read, or the bytes that came did; nothing more is
    read."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit, image)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit, image)
        chunks.append(chunk)
    return b"".join(chunks)


def too_large(limit: int, image: bool = False) -> RequestError:
    image = f" plus {IMAGE_BODY_BYTES} for an image" if image else ""
    return RequestError(f"the request body is larger than this server takes: at most {limit} bytes for this bundle "
                        f"({BODY_OVERHEAD_BYTES} plus {BODY_BYTES_PER_TOKEN} for each token of its sequence "
                        f"length{image})", status=413, code="request_too_large")


def _sse(doc: Any) -> str:
    return f"data: {json.dumps(doc, ensure_ascii=False)}\n\n"


class Api:
    """The routes, over one Generator."""

    def __init__(self, generator: Generator):
        self.gen = generator
        self.limit = max_body_bytes(generator.runtime.tkg[-1], vision=generator.runtime.vision is not None)

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/models", self.models, methods=["GET"]),
                                 Route("/v1/completions", self.completions, methods=["POST"]),
                                 Route("/v1/chat/completions", self.chat, methods=["POST"])],
                         exception_handlers={Exception: _internal_error})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    def _model_card(self) -> dict:
        rt = self.gen.runtime
        return {"id": self.gen.name, "object": "model", "created": self.gen.created, "owned_by": "qbuild",
                "max_model_len": rt.tkg[-1], "max_prompt_tokens": rt.max_prompt_tokens,
                "max_request_bytes": self.limit}

    async def _prepare(self, request: Request, route) -> tuple[Prepared, Client] | Response:
        """The request read, parsed and tokenized, with the watch on its client; or the response refusing it."""
        try:
            body = await read_body(request, self.limit, self.gen.runtime.vision is not None)
        except RequestError as e:   # uvicorn reads what else comes of the body and drops it
            return e.response()
        client = Client(request)
        try:
            return await self.gen.prepare(route, body, client), client
        except RequestError as e:
            client.close()
            return e.response()
        except ClientGone:
            client.close()
            return Response(status_code=499)   # nobody reads it: the connection is closed

    async def completions(self, request: Request) -> Response:
        prepared = await self._prepare(request, CompletionRequest)
        if isinstance(prepared, Response):
            return prepared
        (p, client), rid, created = prepared, f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str, finish: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": self.gen.name,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

        if p.req.stream:
            return self._stream(p, client, None, chunk, rid, created, "text_completion")
        generation = await self._generate(p, client)
        if isinstance(generation, Response):
            return generation
        doc = chunk(generation.text, self.gen.finish_reason(generation.token_ids))
        doc["usage"] = self.gen.usage(len(p.ids), generation)
        return JSONResponse(doc)

    async def chat(self, request: Request) -> Response:
        prepared = await self._prepare(request, ChatRequest)
        if isinstance(prepared, Response):
            return prepared
        (p, client), rid, created = prepared, f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str | None, finish: str | None) -> dict:
            delta = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.gen.name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        if p.req.stream:
            return self._stream(p, client, chunk(None, None), chunk, rid, created, "chat.completion.chunk")
        generation = await self._generate(p, client)
        if isinstance(generation, Response):
            return generation
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": self.gen.name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": generation.text},
                         "logprobs": None, "finish_reason": self.gen.finish_reason(generation.token_ids)}],
            "usage": self.gen.usage(len(p.ids), generation)})

    async def _generate(self, p: Prepared, client: Client):
        """The generation of a non-streamed answer, or the response that ends the request without one."""
        try:
            return await self.gen.generate(QueuedGeneration(p.ids, p.max_new, image=p.image), client)
        except RequestError as e:
            return e.response()
        except ClientGone:
            return Response(status_code=499)   # nobody reads it: the connection is closed
        finally:
            client.close()

    def _stream(self, p: Prepared, client: Client, first: dict | None, chunk: Callable, rid: str, created: int,
                kind: str) -> StreamingResponse:
        """Server-sent events: `first` (if any), a chunk per piece of new text, the finishing chunk, the usage chunk
        where asked for, and `data: [DONE]`. The generation thread hands the text over as it becomes final; a client
        that goes away stops the generation at its next token."""
        options: StreamOptions | None = p.req.stream_options
        include_usage = bool(options and options.include_usage)

        def with_usage(doc: dict) -> dict:
            return {**doc, "usage": None} if include_usage else doc

        async def events():
            loop = asyncio.get_running_loop()
            pieces: asyncio.Queue[str | None] = asyncio.Queue()
            detokenizer = Detokenizer(self.gen.runtime.tokenizer)

            def on_token(token: int) -> None:   # on the generation thread
                if text := detokenizer.add(token):
                    try:
                        loop.call_soon_threadsafe(pieces.put_nowait, text)
                    except RuntimeError:   # the loop is closed: the server stopped while this answer was generated
                        queued.stop("shutdown")

            queued = QueuedGeneration(p.ids, p.max_new, on_token, p.image)
            task = asyncio.ensure_future(self.gen.generate(queued, client))
            task.add_done_callback(lambda _: pieces.put_nowait(None))
            sent = ""
            try:
                if first is not None:
                    yield _sse(with_usage(first))
                while (text := await pieces.get()) is not None:
                    yield _sse(with_usage(chunk(text, None)))
                    sent += text
                try:
                    generation = task.result()
                except ClientGone:
                    return
                except RequestError as e:   # reported in the stream: its status line went out long ago
                    yield _sse(e.doc())
                    return
                except Exception as e:
                    yield _sse({"error": {"message": f"generation failed: {e}", "type": "server_error",
                                          "param": None, "code": None}})
                    return
                rest = generation.text[len(sent):] if generation.text.startswith(sent) else ""
                yield _sse(with_usage(chunk(rest, self.gen.finish_reason(generation.token_ids))))
                if include_usage:
                    yield _sse({"id": rid, "object": kind, "created": created, "model": self.gen.name,
                                "choices": [], "usage": self.gen.usage(len(p.ids), generation)})
                yield "data: [DONE]\n\n"
            finally:   # also where the stream was cancelled (its client went away): its generation stops
                queued.stop("client")
                task.cancel()
                client.close()

        return StreamingResponse(events(), media_type="text/event-stream")


async def _internal_error(request: Request, exc: Exception) -> Response:
    """A fault of the server itself (the traceback goes to stderr): OpenAI's error object, status 500."""
    return RequestError(f"internal error: {type(exc).__name__}: {exc}", status=500, kind="server_error").response()


class Guard:
    """In front of the routes: the API key, where one is set, checked before anything of a request is read; and a
    request that uvicorn cancels while the server stops ends quietly: a 503 where nothing was sent yet, else the end of
    its stream."""

    def __init__(self, app, api_key: str | None, stopping: asyncio.Event):
        self.app, self.stopping = app, stopping
        self._key = api_key.encode() if api_key is not None else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self._key is not None and not self._authorized(scope["headers"]):
            refusal = RequestError("a valid API key is required: send the header `Authorization: Bearer <key>` with "
                                   "the key the server was started with", status=401, code="invalid_api_key")
            await refusal.response(headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        sent: set[str] = set()   # "start", "end": how much of the response went out

        async def tracked(message) -> None:   # marked first: uvicorn writes a message before it waits for the socket
            if message["type"] == "http.response.start":
                sent.add("start")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                sent.add("end")
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            if not self.stopping.is_set():
                raise
            if "start" not in sent:
                await shutting_down().response()(scope, receive, send)
            elif "end" not in sent:   # a stream cut short: it ends here, without `data: [DONE]`
                await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        values = [v for k, v in headers if k == b"authorization"]
        if len(values) != 1:
            return False
        scheme, _, token = values[0].strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)


# --- running ---------------------------------------------------------------------------------------------------

class _Server(uvicorn.Server):
    """uvicorn's server, which tells the generator first when it stops, so that queued requests end at once."""

    def __init__(self, config: uvicorn.Config, generator: Generator):
        super().__init__(config)
        self.generator = generator

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.generator.stop()
        await super().shutdown(sockets)
        if self.generator.fetcher is not None:   # the requests that used it have ended
            await self.generator.fetcher.close()


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (any free port for 0). Clients may connect from now on: their connections wait
    in the backlog until the server takes them."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UserError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    family, _, _, _, address = infos[0]
    # Named as TCP (socket.create_server leaves the protocol 0): asyncio turns Nagle's algorithm off (TCP_NODELAY) only
    # on connections it knows for TCP by their socket's protocol, and with it on, an answer's body waits for the
    # client's delayed ACK of its headers, 40 ms on Linux, on every request after a connection's first.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        if os.name == "posix":   # as create_server: a port in TIME_WAIT from an earlier server may be taken again
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
        return sock
    except OSError as e:
        sock.close()
        raise UserError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror})") from None


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def serve(runtime, options: ServeOptions) -> int:
    """Answer requests on host:port until SIGINT or SIGTERM, then finish (within SHUTDOWN_GRACE_S) and return 0."""
    generator = Generator(runtime, options.name, options.allow_image_urls)
    app = Guard(Api(generator).app(), options.api_key, generator.stopping)
    sock = listen(options.host, options.port)
    server = _Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                    timeout_graceful_shutdown=SHUTDOWN_GRACE_S + STOP_MARGIN_S), generator)

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
        generator.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
