"""Fake of the Qwen3.6-27B port's vllm/qwen36_chat_proxy.py (PR 173 @ 03db3ef), for the contract double: its command
line (--host, --port, --backend-url, --allow-completions, --allow-thinking: L397-431) and what it does with a request.
Raw POST /v1/completions is a 400 with code qwen36_chat_required unless --allow-completions (L359-375); a chat request
is forwarded with chat_template_kwargs.enable_thinking false unless --allow-thinking (L241-266, L377-394); anything
else, and the backend's answer, pass through as they are (_forward L310-348). Standard library only, as the real
one."""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--backend-url", default="http://127.0.0.1:8001")
    parser.add_argument("--allow-completions", action="store_true")
    parser.add_argument("--allow-thinking", action="store_true")
    args = parser.parse_args()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:
            pass

        def reply(self, status: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def forward(self, method: str, body: bytes | None = None) -> None:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length",
                                                                                 "connection")}
            request = urllib.request.Request(args.backend_url.rstrip("/") + self.path, data=body, headers=headers,
                                             method=method)
            try:
                with urllib.request.urlopen(request, timeout=None) as r:
                    self.reply(r.status, r.read(), r.headers.get("Content-Type", "application/json"))
            except urllib.error.HTTPError as e:
                self.reply(e.code, e.read(), e.headers.get("Content-Type", "application/json"))

        def do_GET(self) -> None:
            self.forward("GET")

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
            path = self.path.split("?", 1)[0].rstrip("/")
            if path == "/v1/completions" and not args.allow_completions:
                return self.reply(400, json.dumps({"error": {
                    "message": "Raw /v1/completions is disabled for Qwen3.6. Use /v1/chat/completions so the Qwen "
                               "chat template and non-thinking mode are applied.",
                    "type": "invalid_request_error", "code": "qwen36_chat_required"}}).encode())
            if path == "/v1/chat/completions" and body:
                payload = json.loads(body)
                kwargs = dict(payload.get("chat_template_kwargs") or {})
                kwargs["enable_thinking"] = bool(kwargs.get("enable_thinking")) if args.allow_thinking else False
                payload["chat_template_kwargs"] = kwargs
                body = json.dumps(payload).encode()
            self.forward("POST", body)

    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
