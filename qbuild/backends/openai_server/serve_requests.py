"""What a request to qbuild's OpenAI-compatible server may hold (qbuild.backends.openai_server.serve), and OpenAI's
error object for what it may not.

A body is parsed and validated in one step by pydantic in strict mode (`model_validate_json(..., strict=True)`), so
the JSON text itself is the input and nothing is coerced:
- a boolean is not an integer (`max_tokens: true`, `prompt: [true, false]`), a string is not a number;
- a string with a lone surrogate escape (`"\\ud800"`) is not valid JSON (it names no character) and is refused
  while parsing, before a tokenizer could choke on it;
- nesting deeper than the parser's recursion limit (pydantic-core's JSON parser: a few hundred levels, far more than
  any request needs) is refused without recursing any further.
Each refusal is a 400 naming the field where there is one, never the value (a value may be megabytes long).
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse


class RequestError(Exception):
    """A request this server refuses: an HTTP status and OpenAI's error object."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.kind, self.code = param, status, kind, code

    def doc(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.doc(), status_code=self.status, headers=headers)


def shutting_down() -> RequestError:
    return RequestError("the server is shutting down; send the request again once it is back", status=503,
                        kind="server_error")


_STRICT = ConfigDict(extra="forbid", strict=True)   # unknown fields are refused, so nothing is ignored silently


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _Request(BaseModel):
    """The fields both routes take."""

    model_config = _STRICT
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
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = _STRICT
    url: str            # a data:image/...;base64 URL, or http(s) where the server allows it (serve_images)
    detail: Literal["auto"] | None = None   # the runtime takes every image at its checkpoint's own resolution


class ImagePart(BaseModel):
    model_config = _STRICT
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None

    def images(self) -> list[tuple[int, ImagePart]]:
        """(index in content, part) of each image part."""
        parts = [] if isinstance(self.content, str) else self.content
        return [(j, part) for j, part in enumerate(parts) if isinstance(part, ImagePart)]


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


def parse(model: type[_Request], body: bytes) -> _Request:
    """The request `body` holds, validated; RequestError (400) naming the first field that is wrong."""
    try:
        req = model.model_validate_json(body, strict=True)
    except ValidationError as e:
        raise _refusal(e.errors(include_url=False, include_input=False, include_context=False)) from None
    for field, (allowed, why) in _GREEDY.items():
        if field in type(req).model_fields and getattr(req, field) not in allowed:
            raise RequestError(f"{field}: {why}", field)
    if req.stream_options is not None and not req.stream:
        raise RequestError("stream_options: only allowed when stream is true", "stream_options")
    return req


_PARTS = "list[tagged-union[TextPart,ImagePart]]"   # pydantic's name of the content-parts branch of `content`


def _refusal(errors: list[dict]) -> RequestError:
    """pydantic's first error as OpenAI's: the JSON parser's own message where the body is not JSON, otherwise the
    field's path and what is wrong with it. Where `content` is a list of parts, the error of that list is the one
    meant (not that it is no string), named by the part's index."""
    err = next((e for e in errors if _PARTS in e["loc"]), errors[0])
    if err["type"] == "json_invalid":
        return RequestError(f"the request body is not JSON: {err['msg'].removeprefix('Invalid JSON: ')}")
    if err["type"] == "model_type":
        return RequestError("the request body must be a JSON object")
    loc = _clean(err["loc"])
    field = ".".join(str(p) for p in loc)
    param = str(loc[0]) if loc else None
    if err["type"] == "extra_forbidden":
        return RequestError(f"{field}: not supported by qbuild's server", param)
    if err["type"] == "union_tag_invalid":
        return RequestError(f"{field}: a content part of this type is not supported; qbuild's server takes `text` and "
                            "`image_url` parts", param)
    if err["type"] == "union_tag_not_found":
        return RequestError(f"{field}: a content part needs a `type`: `text` or `image_url`", param)
    return RequestError(f"{field}: {err['msg']}", param)


def _clean(loc: tuple) -> list:
    """A pydantic error location without its union branch labels: `content`'s branch name and, after a part's index,
    the part's `type` tag."""
    out, i = [], 0
    while i < len(loc):
        if loc[i] == _PARTS:
            out.extend(loc[i + 1:i + 2])   # the part's index; the branch name before it and the tag after it go
            i += 3
            continue
        out.append(loc[i])
        i += 1
    return out
