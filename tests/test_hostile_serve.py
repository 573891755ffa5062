"""The hostile corpus of `qbuild serve` (a CPU bundle: qbuild's own server): what a client, or a network, can send that
must not hurt the server, each answered with OpenAI's error object and never a traceback.

The servers are real `qbuild serve` processes on conftest's tiny Qwen3.5 (test_serve.py's project: sequence length
48, so a request body may hold 64 KiB + 32 * 48 bytes). Where a test must act while a request is at one exact point
(being tokenized, generating its first token, waiting for its turn), tests/serve_points.py holds the runtime there,
in the server process, and records what the runtime did: no test waits a fixed time.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import openai
import pytest

from tests.conftest import REPO, qbuild, wait_until
from tests.test_serve import NAME, Server, start

STARTUP = REPO / "tests" / "startup"
KEY = "qbuild-test-key-7f3a9c"         # the module server's API key, given as QBUILD_API_KEY
LIMIT = 65536 + 32 * 48               # the request body limit of a bundle with sequence length 48
WAIT_S = 60                           # how long a test waits for the server to reach a point it must reach

pytestmark = pytest.mark.xdist_group("hostile-serve")


# --- servers -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def project(tmp_path_factory, dense_project) -> Path:
    return Path(shutil.copytree(dense_project, tmp_path_factory.mktemp("hostile-serve") / "project", symlinks=True))


def instrumented(points: Path, **env: str) -> dict:
    """The environment of a server with tests/serve_points.py installed, writing into `points`."""
    return {"PYTHONPATH": f"{STARTUP}{os.pathsep}{REPO}", "QBUILD_SERVE_POINTS": str(points), **env}


def stopped_cleanly(s: Server, key: str | None = None) -> str:
    """Stop the server with Ctrl-C; it exits 0 with no traceback, and neither output holds the key."""
    try:
        code, err = s.stop(signal.SIGINT)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    assert code == 0, err
    assert "Traceback" not in err and "Error" not in err, err
    if key is not None:
        assert key not in err and key not in s.out.read_text()
    return err


@pytest.fixture(scope="module")
def points(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("points")


@pytest.fixture(scope="module")
def server(project, points):
    """The locked recipe served on 127.0.0.1 with an API key from the environment, instrumented."""
    s = start(NAME, project, env=instrumented(points, QBUILD_API_KEY=KEY))
    yield s
    err = stopped_cleanly(s, KEY)
    assert "warning" not in err


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=WAIT_S)


def address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return ("127.0.0.1" if parts.hostname == "0.0.0.0" else parts.hostname), parts.port


def connect(url: str) -> socket.socket:
    sock = socket.create_connection(address(url), timeout=WAIT_S)
    return sock


def head(method: str, path: str, *extra: str, key: str | None = KEY) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: test", "Content-Type: application/json", *extra]
    if key is not None:
        lines.append(f"Authorization: Bearer {key}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """The status, headers and body of the response that comes on `sock`."""
    resp = http.client.HTTPResponse(sock)
    resp.begin()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()


def request(url: str, method: str, path: str, body: bytes = b"", *extra: str, key: str | None = KEY):
    """One request on a new connection: (status, headers, body)."""
    with connect(url) as sock:
        sock.sendall(head(method, path, f"Content-Length: {len(body)}", *extra, key=key) + body)
        return response(sock)


def assert_error_object(body: bytes, kind: str = "invalid_request_error") -> dict:
    """OpenAI's error object, exactly its four fields; returns it."""
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == kind, error
    return error


def records(points: Path, name: str) -> list[dict]:
    path = points / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def generation_of(points: Path, tag: str) -> dict | None:
    found = [r for r in records(points, "generations.jsonl") if tag in r["prompt"]]
    return found[0] if found else None


# --- malformed requests ------------------------------------------------------------------------------------------

BAD_BODIES = {
    # (route, body, the field named)
    "lone surrogate in a prompt": ("/completions", b'{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 2}', None),
    "lone low surrogate in a chat": ("/chat/completions",
                                     b'{"model": "%s", "messages": [{"role": "user", "content": "\\udc00"}]}', None),
    "JSON nested 30000 deep": ("/completions", b'{"model": "%s", "prompt": ' + b"[" * 30000 + b"]" * 30000 + b"}",
                               None),
    "max_tokens: true": ("/completions", b'{"model": "%s", "prompt": "Hi", "max_tokens": true}', "max_tokens"),
    "prompt: [true, false]": ("/completions", b'{"model": "%s", "prompt": [true, false], "max_tokens": 2}', "prompt"),
    "stream_options without stream": ("/completions", b'{"model": "%s", "prompt": "Hi", "max_tokens": 2, '
                                                      b'"stream_options": {"include_usage": true}}', "stream_options"),
    "stream_options with stream false": ("/chat/completions", b'{"model": "%s", "stream": false, '
                                         b'"messages": [{"role": "user", "content": "Hi"}], '
                                         b'"stream_options": {"include_usage": false}}', "stream_options"),
    "stream: 1": ("/completions", b'{"model": "%s", "prompt": "Hi", "stream": 1}', "stream"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_a_malformed_request_is_a_400_error_object(server, case):
    route, body, param = BAD_BODIES[case]
    body = body.replace(b"%s", NAME.encode())
    assert len(body) < LIMIT
    status, _, answer = request(server.url, "POST", "/v1" + route, body)
    assert status == 400, answer
    error = assert_error_object(answer)
    assert error["param"] == param
    if param is None:
        assert error["message"].startswith("the request body is not JSON: "), error


@pytest.mark.parametrize("body", [b'{"model": "m", "prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
                                  b'{"model": "m", "prompt": "\\ud800"}', b'{"model": "m", "prompt": "\\udfff x"}',
                                  b'{"model": "m", "prompt": "\\ud800\\u0041"}'],
                         ids=["200000 deep", "lone high surrogate", "lone low surrogate", "high surrogate, then A"])
def test_the_parser_refuses_200000_deep_json_and_lone_surrogates(body):
    """200,000 levels exceed this bundle's body limit (a 413 first); a bundle with a longer sequence takes the body,
    and the parser refuses it without recursing (pydantic-core's JSON parser has its own depth limit)."""
    from qbuild.backends.openai_server.serve_requests import CompletionRequest, RequestError, parse

    with pytest.raises(RequestError) as err:
        parse(CompletionRequest, body)
    assert err.value.status == 400 and str(err.value).startswith("the request body is not JSON: ")
    # A surrogate pair is a character, not an error.
    assert parse(CompletionRequest, b'{"model": "m", "prompt": "\\ud83d\\ude00"}').prompt == "\N{GRINNING FACE}"


@pytest.fixture(scope="module")
def templated(project, tmp_path_factory):
    """A pulled bundle whose tokenizer has a chat template that refuses a message "refuse me" (as templates check that
    roles alternate, with raise_exception), served on every interface without an API key."""
    from qbuild.model.bundle import read_manifest, write_manifest

    root = tmp_path_factory.mktemp("templated")
    bundle = root / "templated"
    qbuild("pull", NAME, "--to", str(bundle), cwd=project, env={"QBUILD_STORE": str(project / "store")}, check=True)
    config = json.loads((bundle / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{% if m.content == 'refuse me' %}"
                               "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
                               "{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    (bundle / "tokenizer_config.json").write_text(json.dumps(config))
    write_manifest(bundle, {k: v for k, v in read_manifest(bundle).items() if k not in ("format", "files")})
    s = start(str(bundle), root, "--host", "0.0.0.0")
    yield s
    err = stopped_cleanly(s)
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: --host 0.0.0.0 takes requests from other machines and no --api-key is set: anyone "
                        "who can reach it can use the model; set QBUILD_API_KEY (or --api-key)"]


@pytest.mark.slow
def test_a_chat_template_that_raises_is_a_400_with_its_message(templated):
    c = openai.OpenAI(base_url=templated.url.replace("0.0.0.0", "127.0.0.1"), api_key="unused", max_retries=0)
    reply = c.chat.completions.create(model="templated", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert reply.usage.completion_tokens >= 1   # the template renders other messages
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model="templated", messages=[{"role": "user", "content": "refuse me"}],
                                      max_tokens=2, stream=stream)
        assert err.value.body["param"] == "messages"
        assert err.value.body["message"] == ("messages: the model's chat template refused them: Conversation roles "
                                             "must alternate user/assistant")


# --- big bodies --------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_body_limit_is_exact_and_listed(server, client):
    (model,) = client.models.list().data
    assert model.model_extra["max_request_bytes"] == LIMIT
    body = json.dumps({"model": NAME, "prompt": "Hello", "max_tokens": 1}).encode()
    fits = body + b" " * (LIMIT - len(body))    # JSON may end in white space
    status, _, answer = request(server.url, "POST", "/v1/completions", fits)
    assert status == 200, answer
    status, _, answer = request(server.url, "POST", "/v1/completions", fits + b" ")
    assert status == 413
    error = assert_error_object(answer)
    assert error["code"] == "request_too_large" and f"at most {LIMIT} bytes" in error["message"]


@pytest.mark.slow
def test_a_body_declared_over_the_limit_is_refused_before_it_is_sent(server):
    """Its Content-Length is enough: the 413 comes while the client has sent none of the body."""
    with connect(server.url) as sock:
        sock.sendall(head("POST", "/v1/completions", "Content-Length: 10000000"))
        status, _, answer = response(sock)
    assert status == 413 and assert_error_object(answer)["code"] == "request_too_large"


@pytest.mark.slow
def test_a_chunked_body_is_refused_once_it_passes_the_limit(server):
    """Without a Content-Length the body is read until it passes the limit, and no further: the 413 comes while the
    body has not ended."""
    with connect(server.url) as sock:
        sock.sendall(head("POST", "/v1/completions", "Transfer-Encoding: chunked"))
        piece = b"x" * 4096
        for _ in range(LIMIT // len(piece) + 1):
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        status, _, answer = response(sock)   # the terminating chunk was never sent
    assert status == 413 and assert_error_object(answer)["code"] == "request_too_large"


@pytest.mark.slow
def test_a_10_mb_prompt_is_413_at_once_and_costs_no_memory(server, client):
    """Before: the server tokenized it on the event loop (every route frozen 10-15 s) and its memory grew from 0.4 to
    1.8 GB, to refuse it as too long in the end."""
    import psutil

    proc = psutil.Process(server.proc.pid)
    before, peak, done = proc.memory_info().rss, [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            done.wait(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model=NAME, prompt="the quick brown fox " * 500_000, max_tokens=2)
    finally:
        done.set()
        watcher.join()
    assert err.value.status_code == 413 and err.value.body["code"] == "request_too_large"
    assert peak[0] - before < 64 << 20
    assert client.models.list().data[0].id == NAME


# --- the event loop stays free -------------------------------------------------------------------------------------

@pytest.mark.slow
def test_models_answers_while_a_prompt_is_being_tokenized(server, client, points):
    """A prompt is tokenized on a worker thread: held there, /v1/models still answers."""
    tag = "tok1"
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(client.completions.create, model=NAME, prompt=f"HOLD-ENCODE:{tag} the fox", max_tokens=2)
        try:
            wait_until(lambda: (points / f"encoding-{tag}").exists(), WAIT_S, "the prompt to be tokenized")
            assert client.models.list().data[0].id == NAME
            assert not held.done()
        finally:
            (points / f"release-{tag}").write_text("")
        assert held.result().usage.completion_tokens >= 1


# --- clients that go away ------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_stops_its_generation_and_the_queue_goes_on(server, client, points, stream):
    """The held generation made its first token; its client goes (a streamed chat after its first chunk); the server
    stops it there, instead of making the other 15, and the request queued behind it is answered. (A stream was
    stopped so before too, as Starlette cancels a stream whose client goes; a non-streamed answer ran to its end.)"""
    tag = f"gone{int(stream)}"
    body = {"model": NAME, "messages": [{"role": "user", "content": f"HOLD:{tag}"}], "max_tokens": 16,
            "stream": stream}
    sock = connect(server.url)
    data = json.dumps(body).encode()
    sock.sendall(head("POST", "/v1/chat/completions", f"Content-Length: {len(data)}") + data)
    if stream:
        assert sock.recv(1 << 16).startswith(b"HTTP/1.1 200")   # the status line and the first chunk
    wait_until(lambda: (points / f"held-{tag}").exists(), WAIT_S, "the first token")
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(client.completions.create, model=NAME, prompt="after it", max_tokens=3)
        sock.close()
        record = wait_until(lambda: generation_of(points, tag), WAIT_S, "the held generation to end")
        assert record["max_new"] == 16 and record["tokens"] == 1
        assert queued.result().usage.completion_tokens >= 1


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_a_queued_request_whose_client_went_away_never_runs(server, client, points, stream):
    """The queued request's client goes while a generation runs (the server has seen it go before the running one's
    client goes too): its generation never starts, and the next request is answered. Before, it ran in its turn, to
    its end where not streamed, to its first token where streamed."""
    ahead_tag, queued_tag = f"ahead{int(stream)}", f"queued{int(stream)}"
    ahead = connect(server.url)
    data = json.dumps({"model": NAME, "prompt": f"HOLD:{ahead_tag} go on", "max_tokens": 16, "stream": stream}).encode()
    ahead.sendall(head("POST", "/v1/completions", f"Content-Length: {len(data)}") + data)
    wait_until(lambda: (points / f"held-{ahead_tag}").exists(), WAIT_S, "the first token")

    queued = connect(server.url)
    data = json.dumps({"model": NAME, "prompt": f"{queued_tag} waits", "max_tokens": 4, "stream": stream}).encode()
    queued.sendall(head("POST", "/v1/completions", f"Content-Length: {len(data)}") + data)
    wait_until(lambda: any(queued_tag in r["text"] for r in records(points, "encoded.jsonl")), WAIT_S,
               "the queued request to be tokenized")
    port = queued.getsockname()[1]
    queued.close()
    wait_until(lambda: (points / f"lost-{port}").exists(), WAIT_S, "the server to see the queued client go")
    ahead.close()
    assert wait_until(lambda: generation_of(points, ahead_tag), WAIT_S, "the held generation to end")["tokens"] == 1
    assert client.completions.create(model=NAME, prompt="and then", max_tokens=2).usage.completion_tokens >= 1
    assert generation_of(points, queued_tag) is None


# --- the API key -------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key", f"Basic {KEY}", f"Bearer {KEY}x", "Bearer"])
def test_every_route_needs_the_api_key(server, authorization):
    chat = json.dumps({"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}).encode()
    completion = json.dumps({"model": NAME, "prompt": "Hi", "max_tokens": 1}).encode()
    extra = () if authorization is None else (f"Authorization: {authorization}",)
    for method, path, body in [("GET", "/v1/models", b""), ("POST", "/v1/completions", completion),
                               ("POST", "/v1/chat/completions", chat), ("GET", "/elsewhere", b"")]:
        status, headers, answer = request(server.url, method, path, body, *extra, key=None)
        assert status == 401 and headers["www-authenticate"] == "Bearer"
        assert assert_error_object(answer)["code"] == "invalid_api_key"
        assert KEY not in answer.decode() and "wrong-key" not in answer.decode()
    assert request(server.url, "GET", "/v1/models")[0] == 200


@pytest.mark.slow
def test_a_request_without_the_key_is_refused_before_its_body_is_read(server):
    with connect(server.url) as sock:
        sock.sendall(head("POST", "/v1/completions", "Content-Length: 10000000", key=None))
        status, _, answer = response(sock)
    assert status == 401 and assert_error_object(answer)["code"] == "invalid_api_key"


@pytest.mark.parametrize("key", ["", "two words", "caf\u00e9", "tab\there"])
def test_an_api_key_no_client_could_send_is_refused(tmp_path, key):
    from qbuild.model.bundle import write_manifest

    write_manifest(tmp_path, {"family": "qwen3_5", "backend": "export", "tp": 1, "ep": 1, "batch_size": 1,
                              "seq_len": 48, "dtype": "float32", "buckets": {"cte": [32], "tkg": [48], "vision": []},
                              "graphs": {}})
    proc = qbuild("serve", str(tmp_path), "--api-key", key)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == ("error: --api-key (or QBUILD_API_KEY): a key is one or more printable ASCII "
                                   "characters without spaces")
    proc = qbuild("serve", str(tmp_path), "--dry-run", "--json", env={"QBUILD_API_KEY": KEY})
    assert proc.returncode == 0 and KEY not in proc.stdout + proc.stderr


# --- stopping ----------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_stop_signal_with_queued_requests_ends_each_cleanly(project, tmp_path):
    """One generation runs (held after its first token), six requests wait their turn, then Ctrl-C: the six get a 503
    at once (a streamed one: an error event), the running one after the grace, and the server exits 0 without a
    traceback. Before: uvicorn cancelled them after its grace and printed a CancelledError traceback for each."""
    points = tmp_path / "points"
    points.mkdir()
    key = "stop-key-31ab"
    (tmp_path / "run").mkdir()
    s = start(NAME, tmp_path / "run", "--host", "0.0.0.0", "--api-key", key, cwd=project,
              env=instrumented(points, QBUILD_STORE=str(project / "store")))
    try:
        c = openai.OpenAI(base_url=s.url.replace("0.0.0.0", "127.0.0.1"), api_key=key, max_retries=0,
                          timeout=WAIT_S)

        def ask(i: int):
            try:
                if i == 0:
                    return c.completions.create(model=NAME, prompt="HOLD:running go on", max_tokens=16)
                kind = c.chat.completions if i % 2 else c.completions
                args = {"messages": [{"role": "user", "content": f"waiting{i}"}]} if i % 2 else \
                    {"prompt": f"waiting{i}"}
                return list(kind.create(model=NAME, max_tokens=4, stream=True, **args)) if i % 3 == 0 else \
                    kind.create(model=NAME, max_tokens=4, **args)
            except openai.APIError as e:   # a status, or an error event of a stream
                return e

        with ThreadPoolExecutor(7) as pool:
            running = pool.submit(ask, 0)
            wait_until(lambda: (points / "held-running").exists(), WAIT_S, "the first token")
            waiting = [pool.submit(ask, i) for i in range(1, 7)]
            wait_until(lambda: all(any(f"waiting{i}" in r["text"] for r in records(points, "encoded.jsonl"))
                                   for i in range(1, 7)), WAIT_S, "the six requests to be tokenized")
            s.interrupt(signal.SIGINT)
            answers = [f.result() for f in waiting]
            cut = running.result()
    finally:
        err = stopped_cleanly(s, key)
    for i, answer in zip(range(1, 7), answers):
        assert isinstance(answer, openai.APIError), answer
        assert answer.message.startswith("the server is shutting down") or \
            answer.body["message"].startswith("the server is shutting down"), answer
        if i % 3:   # not streamed: a 503 (a streamed one's status went out before; the error is an event)
            assert isinstance(answer, openai.APIStatusError) and answer.status_code == 503, answer
    assert isinstance(cut, openai.APIStatusError) and cut.status_code == 503
    assert cut.body["message"] == "the server stopped before the answer was complete"
    assert "warning" not in err
    assert not re.search(r"CancelledError|ERROR", err)


@pytest.mark.slow
def test_a_generation_that_outlives_the_stop_ends_its_stream_quietly(project, tmp_path):
    """A generation that does not end when the grace runs out (held here; a long prefill in life) is cancelled by
    uvicorn 30 s later: its stream ends there, without `data: [DONE]`, and the server exits 0 without a traceback once
    the generation thread is done."""
    points = tmp_path / "points"
    points.mkdir()
    (tmp_path / "run").mkdir()
    s = start(NAME, tmp_path / "run", cwd=project, env=instrumented(points, QBUILD_STORE=str(project / "store")))
    try:
        c = openai.OpenAI(base_url=s.url, api_key="unused", max_retries=0, timeout=WAIT_S)
        with ThreadPoolExecutor(1) as pool:
            stream = pool.submit(lambda: list(c.chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": "HOLD-DEAF:deaf1"}], max_tokens=8, stream=True)))
            wait_until(lambda: (points / "held-deaf1").exists(), WAIT_S, "the first token")
            s.interrupt(signal.SIGINT)
            chunks = stream.result()
        (points / "release-deaf1").write_text("")
    finally:
        err = stopped_cleanly(s)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(chunk.choices[0].finish_reason is None for chunk in chunks)   # cut short, not finished
    assert generation_of(points, "deaf1")["tokens"] <= 2   # stopped at its next token once released
    assert "Cancel 1 running task(s)" in err   # uvicorn's one line about it
