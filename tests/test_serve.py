"""`qbuild serve` of a CPU bundle: a real server on 127.0.0.1 (`qbuild serve ... --port 0` in a subprocess) on the tiny
Qwen3.5 that conftest builds once per run (dense_project: export backend, CTE bucket 32, TKG bucket 48), queried with
the `openai` client and, where the wire format itself is the point, with plain HTTP.

Its answers are `qbuild run`'s: the same greedy tokens for the same prompt and max_tokens, streamed or not.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from tests.conftest import REPO, qbuild, wait_until

NAME = "tiny-dense"          # conftest's dense_project recipe
CTE, KV = 32, 48             # its largest context-encoding bucket and its KV cache (largest TKG bucket)


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    out: Path
    err: Path
    signalled: bool = False

    def interrupt(self, sig: int = signal.SIGINT) -> None:
        """Ctrl-C (or `sig`) once: a second Ctrl-C while the server stops is a forced stop (uvicorn's), or after it
        returned an interrupt of qbuild (exit 130), so stop() sends none after this."""
        self.signalled = True
        self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60) -> tuple[int, str]:
        if not self.signalled and self.proc.poll() is None:
            self.interrupt(sig)
        code = self.proc.wait(timeout=timeout)
        return code, self.err.read_text()


def start(target: str, root: Path, *args: str, cwd: Path | None = None, env: dict | None = None) -> Server:
    """`qbuild serve TARGET --port 0 --ready-file ...` in a subprocess (with `env` added to its environment), once it
    answers."""
    ready, out, err = root / "url", root / "serve.out", root / "serve.err"
    env = {**os.environ, "PYTHONPATH": str(REPO), "QBUILD_STORE": str(root / "store"), **(env or {})}
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, "-m", "qbuild.cli", "serve", target, "--port", "0",
                                 "--ready-file", str(ready), *args], cwd=cwd or root, env=env, stdout=o, stderr=e)

    def up() -> str | None:
        if proc.poll() is not None:
            raise AssertionError(f"qbuild serve exited {proc.returncode}:\n{err.read_text()}")
        return ready.exists() and ready.read_text().strip()

    url = wait_until(up, 300, "qbuild serve to answer")
    return Server(proc, url, out, err)


@pytest.fixture(scope="module")
def project(tmp_path_factory, dense_project) -> Path:
    return Path(shutil.copytree(dense_project, tmp_path_factory.mktemp("serve") / "project", symlinks=True))


@pytest.fixture(scope="module")
def server(project):
    """The built recipe served by name from its lockfile, as `make demo` serves it; stopped by Ctrl-C (SIGINT), which
    must end it cleanly, as test_a_stop_signal_ends_the_server_with_exit_0 checks for SIGTERM."""
    s = start(NAME, project)
    yield s
    code, err = s.stop(signal.SIGINT)
    assert code == 0, err
    assert "Traceback" not in err and "interrupted" not in err
    assert s.out.read_text().strip() == s.url


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)


def qbuild_run(project: Path, *args: str) -> dict:
    """`qbuild run --json` of the served recipe."""
    proc = qbuild("run", NAME, "--json", *args, cwd=project, env={"QBUILD_STORE": str(project / "store")},
                  check=True)
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def runtime(project, tmp_path_factory):
    """The served bundle, pulled and loaded once in this process: what `qbuild run` does for each call, which costs
    seconds of graph loading each time."""
    from qbuild.model.runtime import Runtime

    bundle = tmp_path_factory.mktemp("serve-oracle") / "bundle"
    qbuild("pull", NAME, "--to", str(bundle), cwd=project, env={"QBUILD_STORE": str(project / "store")}, check=True)
    return Runtime.load(bundle)


def run(runtime, prompt: str | list[int], max_new_tokens: int) -> dict:
    """What `qbuild run --json --prompt ... --max-new-tokens ...` prints (or --prompt-ids for a list): the reference
    every answer is held to."""
    from qbuild.render import generation_json

    ids = prompt if isinstance(prompt, list) else runtime.encode(prompt)
    return generation_json(runtime.generate(ids, max_new_tokens))


def post(url: str, body: dict) -> tuple[int, str]:
    """A POST with plain HTTP: (status, body)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


# The tests on the module's server run on one worker, so it starts once; they need conftest's build: slow.
pytestmark = pytest.mark.xdist_group("serve")


# --- answers -----------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("prompt, max_tokens", [("The quick brown fox", 8), ("Hello", 16), ("1, 2, 3,", 1)])
def test_a_completion_is_qbuild_runs_greedy_output(runtime, client, prompt, max_tokens):
    expected = run(runtime, prompt, max_tokens)
    reply = client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0)
    (choice,) = reply.choices
    assert choice.text == expected["text"]
    assert reply.usage.prompt_tokens == expected["prompt_tokens"]
    assert reply.usage.completion_tokens == len(expected["token_ids"])
    assert reply.usage.total_tokens == expected["prompt_tokens"] + len(expected["token_ids"])
    assert choice.finish_reason == ("length" if len(expected["token_ids"]) == max_tokens else "stop")
    assert reply.model == NAME and reply.object == "text_completion"


@pytest.mark.slow
def test_the_reference_is_what_qbuild_run_prints(project, runtime):
    """The answers above are held to the runtime loaded here: the same tokens `qbuild run` prints for the recipe."""
    cli = qbuild_run(project, "--prompt", "The quick brown fox", "--max-new-tokens", "8")
    ours = run(runtime, "The quick brown fox", 8)
    assert {k: cli[k] for k in ("text", "token_ids", "prompt_tokens", "cte_bucket")} == \
        {k: ours[k] for k in ("text", "token_ids", "prompt_tokens", "cte_bucket")}


@pytest.mark.slow
def test_a_prompt_of_token_ids_and_the_default_length(runtime, client):
    """A prompt may be token ids; without max_tokens a completion stops after 16 tokens, OpenAI's default."""
    expected = run(runtime, [5, 17, 300, 42], 16)
    reply = client.completions.create(model=NAME, prompt=[5, 17, 300, 42])
    assert reply.choices[0].text == expected["text"]
    assert reply.usage.completion_tokens == len(expected["token_ids"])


@pytest.mark.slow
def test_streamed_chunks_concatenate_to_the_same_text(runtime, client, server):
    prompt = "The quick brown fox"
    expected = run(runtime, prompt, 12)
    stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected["text"]
    assert len([c for c in chunks if c.choices]) > 2        # streamed in pieces, not one answer at the end
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected["token_ids"])

    # The wire: server-sent events in OpenAI's chunk format, closed by `data: [DONE]`.
    status, body = post(server.url + "/completions", {"model": NAME, "prompt": prompt, "max_tokens": 12,
                                                       "stream": True})
    assert status == 200
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    docs = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(d["object"] == "text_completion" and d["model"] == NAME for d in docs)
    assert "".join(d["choices"][0]["text"] for d in docs) == expected["text"]
    assert [d["choices"][0]["finish_reason"] for d in docs][-1] in ("stop", "length")


@pytest.mark.slow
def test_every_answer_is_valid_under_openais_own_types(server):
    """Each body and each streamed chunk, as the wire carries it, validates against the openai package's pydantic
    models (the client itself builds them without validation): the server's shapes are OpenAI's."""
    from openai.types import Completion, Model
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    from openai.types.completion_usage import CompletionUsage
    from pydantic import ValidationError

    def stream(route: str, body: dict) -> list[dict]:
        status, text = post(server.url + route, {**body, "stream": True, "stream_options": {"include_usage": True}})
        assert status == 200, text
        return [json.loads(e.removeprefix("data: ")) for e in text.split("\n\n") if e and e != "data: [DONE]"]

    completion = {"model": NAME, "prompt": "The quick brown fox", "max_tokens": 4}
    chat = {"model": NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    status, text = post(server.url + "/completions", completion)
    assert status == 200 and Completion.model_validate_json(text, strict=True).usage.completion_tokens == 4
    status, text = post(server.url + "/chat/completions", chat)
    assert status == 200
    assert ChatCompletion.model_validate_json(text, strict=True).choices[0].message.role == "assistant"
    chunks = stream("/completions", completion)
    for chunk in chunks:
        try:
            Completion.model_validate(chunk, strict=True)
        except ValidationError as e:
            # The type serves streamed completions too, where OpenAI's API sends finish_reason null until the last
            # chunk; it admits none: that one field, null, on a chunk that is not the last with choices, is all.
            assert [(err["loc"], err["input"]) for err in e.errors()] == [(("choices", 0, "finish_reason"), None)]
            assert chunk is not [c for c in chunks if c["choices"]][-1]
    assert CompletionUsage.model_validate(chunks[-1]["usage"], strict=True).completion_tokens == 4
    for chunk in stream("/chat/completions", chat):
        ChatCompletionChunk.model_validate(chunk, strict=True)
    with urllib.request.urlopen(server.url + "/models", timeout=60) as resp:
        models = json.loads(resp.read())
    assert [Model.model_validate(m, strict=True).id for m in models["data"]] == [NAME]


@pytest.mark.slow
def test_chat_without_a_template_is_the_documented_concatenation(runtime, client, small_checkpoints):
    """The tiny tokenizer has no chat template: the messages become "<role>: <content>" lines and "assistant:"."""
    checkpoint = small_checkpoints["qwen3_5"]
    assert "chat_template" not in json.loads((checkpoint / "tokenizer_config.json").read_text())
    assert not list(checkpoint.glob("chat_template*"))
    messages = [{"role": "system", "content": "Be"}, {"role": "user", "content": "Hi"}]
    expected = run(runtime, "system: Be\nuser: Hi\nassistant:", 6)
    reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6)
    (choice,) = reply.choices
    assert choice.message.role == "assistant" and choice.message.content == expected["text"]
    assert reply.usage.prompt_tokens == expected["prompt_tokens"]
    assert reply.object == "chat.completion"

    stream = list(client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=6,
                                                 stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected["text"]
    assert stream[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_concurrent_requests_each_get_their_own_answer(client):
    """One runtime, one generation at a time: requests sent together get what each gets alone."""
    asks = [(f"Request number {i}", 4 + i % 5) for i in range(8)]
    alone = [client.completions.create(model=NAME, prompt=p, max_tokens=n).choices[0].text for p, n in asks]

    def ask(i: int) -> str:
        p, n = asks[i]
        if i % 2:
            chunks = client.completions.create(model=NAME, prompt=p, max_tokens=n, stream=True)
            return "".join(c.choices[0].text for c in chunks if c.choices)
        return client.completions.create(model=NAME, prompt=p, max_tokens=n).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, range(len(asks))))
    assert together == alone


@pytest.mark.slow
def test_models_lists_the_served_bundle(client):
    (model,) = client.models.list().data
    assert model.id == NAME and model.owned_by == "qbuild"
    assert model.model_extra["max_model_len"] == KV and model.model_extra["max_prompt_tokens"] == CTE


# --- refusals ----------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_prompt_beyond_the_largest_bucket_is_400_with_the_runtime_message(client, server):
    ids = list(range(1, CTE + 2))
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=NAME, prompt=ids, max_tokens=1, stream=stream)
        assert err.value.status_code == 400
        message = err.value.body["message"]
        assert f"the prompt has {CTE + 1} tokens, more than the largest context-encoding bucket {CTE}" in message
        assert err.value.body["param"] == "prompt"
    # The refusal is an error status, not a stream that starts and breaks off.
    status, body = post(server.url + "/completions", {"model": NAME, "prompt": ids, "stream": True})
    assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"


@pytest.mark.slow
def test_max_tokens_beyond_the_cache_is_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=NAME, prompt=[1, 2, 3, 4], max_tokens=KV)
    assert f"largest token-generation bucket is {KV}" in err.value.body["message"]
    assert err.value.body["param"] == "max_tokens"
    # The most that fits is answered.
    fits = client.completions.create(model=NAME, prompt=[1, 2, 3, 4], max_tokens=KV - 3)
    assert fits.usage.completion_tokens <= KV - 3


@pytest.mark.slow
@pytest.mark.parametrize("field, value", [("temperature", 0.7), ("top_p", 0.5), ("n", 2), ("stop", ["\n"]),
                                          ("logprobs", 2), ("echo", True), ("presence_penalty", 0.5),
                                          ("tools", [])])
def test_what_greedy_decoding_cannot_honour_is_refused_naming_the_field(client, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=NAME, prompt="Hello", max_tokens=2, extra_body={field: value})
    assert err.value.body["param"] == field and err.value.body["message"].startswith(f"{field}: ")


@pytest.mark.slow
def test_greedy_settings_are_accepted(client):
    reply = client.completions.create(model=NAME, prompt="Hello", max_tokens=2, temperature=0, top_p=1, n=1,
                                      seed=7, presence_penalty=0, user="someone")
    assert reply.usage.completion_tokens >= 1


@pytest.mark.slow
def test_another_model_name_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="Hello", max_tokens=2)
    assert NAME in err.value.body["message"]


@pytest.mark.slow
def test_a_body_that_is_not_json_is_400(server):
    req = urllib.request.Request(server.url + "/chat/completions", data=b"{not json",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 400 and "not JSON" in json.loads(err.value.read())["error"]["message"]


# --- stopping ----------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_stop_signal_ends_the_server_with_exit_0(project, tmp_path, sig=signal.SIGTERM):
    """A pulled bundle directory, served under its directory's name, stopped by SIGTERM (the module's server is
    stopped by Ctrl-C, with the same checks)."""
    bundle = tmp_path / "bundle"
    qbuild("pull", NAME, "--to", str(bundle), cwd=project, env={"QBUILD_STORE": str(project / "store")}, check=True)
    s = start(str(bundle), tmp_path)
    c = openai.OpenAI(base_url=s.url, api_key="unused", max_retries=0)
    assert c.completions.create(model="bundle", prompt="Hello", max_tokens=2).usage.completion_tokens >= 1
    code, err = s.stop(sig)
    assert code == 0, err
    assert "Traceback" not in err and "interrupted" not in err
    assert s.out.read_text().strip() == s.url


# --- refused, or described, before anything is loaded (no build) --------------------------------------------------

def test_a_directory_that_is_not_a_bundle_is_one_line_exit_2(tmp_path):
    proc = qbuild("serve", str(tmp_path))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (f"error: {tmp_path}: not a qbuild bundle (no bundle.json); pull one with "
                                   "`qbuild pull RECIPE --to DIR`")


def test_a_recipe_without_a_lockfile_is_one_line_exit_2(tmp_path):
    proc = qbuild("serve", "tiny-dense", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: tiny-dense: neither a bundle directory nor, without a lockfile "
                                   "(artifacts.lock), a locked recipe")


def test_a_bundle_of_no_known_backend_and_a_bad_ready_file_are_refused(tmp_path):
    from qbuild.model.bundle import write_manifest

    write_manifest(tmp_path, {"backend": "tpu"})
    proc = qbuild("serve", str(tmp_path), "--dry-run")
    assert proc.returncode == 2 and "backend 'tpu' is not one of neuron, inductor, export" in proc.stderr
    (tmp_path / "file").write_text("")
    proc = qbuild("serve", str(tmp_path), "--ready-file", str(tmp_path / "file" / "url"))
    assert proc.returncode == 2 and "--ready-file" in proc.stderr and "not a directory" in proc.stderr
    proc = qbuild("serve", str(tmp_path), "--port", "70000")
    assert proc.returncode == 2 and "Invalid value for '--port'" in proc.stderr


def test_dry_run_of_a_cpu_bundle_names_the_server_and_its_limits(tmp_path):
    """Read from bundle.json alone: the largest CTE bucket bounds a prompt, the largest TKG bucket prompt and answer."""
    from qbuild.model.bundle import write_manifest

    bundle = tmp_path / "tiny"
    bundle.mkdir()
    write_manifest(bundle, {"family": "qwen3_5", "backend": "inductor", "tp": 1, "ep": 1, "batch_size": 1,
                            "seq_len": 256, "dtype": "float32", "buckets": {"cte": [32, 128], "tkg": [256],
                                                                            "vision": []}, "graphs": {}})
    proc = qbuild("serve", str(bundle), "--dry-run", "--json", "--port", "9001", "--host", "::1")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc == {"server": "qbuild", "backend": "inductor", "bundle": str(bundle), "model": "tiny",
                   "url": "http://[::1]:9001/v1", "routes": ["/v1/models", "/v1/completions", "/v1/chat/completions"],
                   "max_prompt_tokens": 128, "max_model_len": 256}
    text = qbuild("serve", str(bundle), "--dry-run", check=True).stdout
    assert "# server: qbuild" in text and "# url: http://127.0.0.1:8000/v1" in text
    # Arguments after `--` are for a server another program runs (vLLM); qbuild's own takes none, and says so.
    # The refusal names the options, never their values (a key among them).
    for dry in (["--dry-run"], []):
        proc = qbuild("serve", str(bundle), *dry, "--", "--chat-template", "t.jinja", "--api-key=sekrit-1",
                      "--api-key", "--sekrit-2", "-k3y")
        assert proc.returncode == 2 and proc.stdout == "", proc
        assert proc.stderr.strip().splitlines() == [
            f"error: {bundle}: the inductor bundle is served by qbuild's own server, which takes no arguments after "
            "`--` (given: --chat-template, --api-key, --api-key)"], proc.stderr
    # vLLM runs neuron bundles only.
    proc = qbuild("serve", str(bundle), "--dry-run", "--server", "vllm")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: --server vllm: {bundle} is a bundle of the inductor backend, which vLLM cannot run; qbuild's own "
        "server serves it (drop --server)"], proc.stderr


def test_each_connection_sends_its_answer_at_once(tmp_path):
    """The server's connections have Nagle's algorithm off (TCP_NODELAY), as asyncio sets it on every TCP connection
    it accepts, which it recognises by the listening socket's protocol. With it on (a listening socket made without
    naming TCP), an answer's body waited for the client's delayed ACK of its headers: every request after the first
    on a keep-alive connection took 40 ms more on Linux, a round trip the demo's warm prompt measured ten times over."""
    import asyncio
    import socket

    from qbuild.backends.openai_server.serve import listen

    async def accept_one() -> int:
        sock = listen("127.0.0.1", 0)
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()

        class Record(asyncio.Protocol):
            def connection_made(self, transport):
                accepted.set_result(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP,
                                                                                  socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Record, sock=sock)
        try:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            writer.close()
            return await asyncio.wait_for(accepted, 30)
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(accept_one()) != 0
