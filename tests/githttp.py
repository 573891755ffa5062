"""A git smart-HTTP server on loopback that asks for a password, for the port tests: git's own `git http-backend`
(a CGI program) behind Python's http.server, with HTTP Basic authentication in front of it.

It serves every repository under `root` (`http://127.0.0.1:PORT/<name>`) to a client that sends `user:password`,
and answers anyone else 401, as a private Git host does. Runs in a thread of the test process; stop() ends it.
"""

from __future__ import annotations

import base64
import os
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit


class GitHttpServer:
    def __init__(self, root: Path, user: str, password: str):
        self.root = root
        self.requests: list[tuple[str, int]] = []     # (path, status) of each request, in order
        expected = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._serve(b"")

            def do_POST(self) -> None:
                self._serve(self.rfile.read(int(self.headers.get("Content-Length") or 0)))

            def _serve(self, body: bytes) -> None:
                if self.headers.get("Authorization") != expected:
                    server.requests.append((self.path, 401))
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="git"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                status, headers, payload = server._backend(self, body)
                server.requests.append((self.path, status))
                self.send_response(status)
                for name, value in headers:
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args) -> None:   # quiet: the test reads `requests`
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def _backend(self, request: BaseHTTPRequestHandler, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        """Run `git http-backend` for one request (the CGI variables it reads: git's http-backend documentation)."""
        parts = urlsplit(request.path)
        env = {"PATH": os.environ["PATH"], "GIT_PROJECT_ROOT": str(self.root), "GIT_HTTP_EXPORT_ALL": "1",
               "PATH_INFO": parts.path, "QUERY_STRING": parts.query, "REQUEST_METHOD": request.command,
               "CONTENT_TYPE": request.headers.get("Content-Type", ""), "CONTENT_LENGTH": str(len(body)),
               "REMOTE_USER": "git", "REMOTE_ADDR": "127.0.0.1",
               "HTTP_CONTENT_ENCODING": request.headers.get("Content-Encoding", ""),
               "HTTP_GIT_PROTOCOL": request.headers.get("Git-Protocol", "")}
        out = subprocess.run(["git", "http-backend"], input=body, env=env, capture_output=True, check=True).stdout
        head, _, payload = out.partition(b"\r\n\r\n")
        status, headers = 200, []
        for line in head.decode().split("\r\n"):
            name, _, value = line.partition(": ")
            if name.lower() == "status":
                status = int(value.split()[0])
            elif name:
                headers.append((name, value))
        return status, headers, payload

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
