"""Holds `qbuild serve`'s runtime at chosen points, so that a test acts while a request is exactly there, and records
what the runtime did (installed by tests/startup/sitecustomize.py when QBUILD_SERVE_POINTS names a directory).

In that directory:
- `Runtime.encode` of a text holding "HOLD-ENCODE:<tag>" writes `encoding-<tag>` and waits until `release-<tag>`
  exists. Every text encoded is appended to encoded.jsonl.
- `Runtime.generate` of a prompt holding "HOLD:<tag>" writes `held-<tag>` after its first token and then waits for the
  server to stop it: every POLL_S it hands the server's on_token that token again and ends the generation as soon as
  the answer is true (a streamed answer repeats the token meanwhile: the tests disconnect that client), or goes on
  once `release-<tag>` exists. "HOLD-DEAF:<tag>" holds the same way but asks the server nothing: a generation that
  does not end when the server stops it (one busy in a long prefill). Every generation that ends appends {"prompt",
  "tokens", "max_new"} to generations.jsonl: its prompt's text, how many tokens it made, how many it was allowed.
- uvicorn's connection_lost writes `lost-<client port>`: from then on the server has seen that client go.
A hold gives up after HOLD_S and lets the work go on: a server that never stops it fails its test then.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

HOLD_S = 120.0
POLL_S = 0.01


def install(root: str, after_import) -> None:
    directory = Path(root)
    after_import("qbuild.model.runtime", lambda module: _wrap_runtime(module.Runtime, directory))
    after_import("uvicorn.protocols.http.h11_impl", lambda module: _wrap_connection(module.H11Protocol, directory))


def mark(path: Path) -> None:
    path.with_suffix(".tmp").write_text("")
    os.replace(path.with_suffix(".tmp"), path)


def _append(path: Path, doc: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(doc) + "\n")


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + HOLD_S
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(POLL_S)


def _wrap_runtime(runtime_class, root: Path) -> None:
    encode, generate = runtime_class.encode, runtime_class.generate

    def held_encode(self, prompt: str) -> list[int]:
        _append(root / "encoded.jsonl", {"text": prompt[:200]})
        if tag := re.search(r"HOLD-ENCODE:(\w+)", prompt):
            mark(root / f"encoding-{tag[1]}")
            _wait_for(root / f"release-{tag[1]}")
        return encode(self, prompt)

    def held_generate(self, prompt_ids, max_new_tokens, *args, on_token=None, **kwargs):
        text = self.tokenizer.decode(prompt_ids)
        if tag := re.search(r"HOLD(-DEAF)?:(\w+)", text):
            on_token = _holding(on_token, root, tag[2], deaf=bool(tag[1]))
        generation = generate(self, prompt_ids, max_new_tokens, *args, on_token=on_token, **kwargs)
        _append(root / "generations.jsonl", {"prompt": text, "tokens": len(generation.token_ids),
                                             "max_new": max_new_tokens})
        return generation

    runtime_class.encode, runtime_class.generate = held_encode, held_generate


def _holding(server_on_token, root: Path, tag: str, deaf: bool):
    held = False

    def on_token(token: int) -> bool:
        nonlocal held
        if server_on_token is not None and server_on_token(token):
            return True
        if held:
            return False
        held = True
        mark(root / f"held-{tag}")
        deadline = time.monotonic() + HOLD_S
        while time.monotonic() < deadline and not (root / f"release-{tag}").exists():
            if not deaf and server_on_token is not None and server_on_token(token):
                return True
            time.sleep(POLL_S)
        return False

    return on_token


def _wrap_connection(protocol_class, root: Path) -> None:
    connection_lost = protocol_class.connection_lost

    def lost(self, exc) -> None:
        connection_lost(self, exc)
        if self.client:
            mark(root / f"lost-{self.client[1]}")

    protocol_class.connection_lost = lost
