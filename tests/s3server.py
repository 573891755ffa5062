"""A real S3 API on loopback for tests: moto's standalone server in its own process, plus a TCP relay.

Each runs in its own process (`python tests/s3server.py moto|relay ...`) and serves a socket this module listens on
before starting it, so it is reachable the moment it is started. The relay stands between qbuild and the server, so a
test can make "the server" vanish mid-transfer by killing the relay while the objects written so far stay
inspectable on the real server behind it.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "AKIAQBUILDTESTFAKE7Q",
    "AWS_SECRET_ACCESS_KEY": "qbuildFakeSecret/DoNotLeak+4f2c9e71aa0b",
    "AWS_SESSION_TOKEN": "qbuildFakeSessionToken0123456789abcdef",
}
REGION = "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listen(port: int = 0) -> socket.socket:
    """A socket listening on 127.0.0.1:port (any free port for 0), to hand to a server process: a client may connect
    as soon as this returns, its connection waits in the backlog until the server accepts it."""
    return socket.create_server(("127.0.0.1", port), backlog=128)


def _serve(args: list[str], sock: socket.socket, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python tests/s3server.py ARGS FD` in a new session, FD being `sock` (closed here: the child owns it)."""
    with sock:
        return subprocess.Popen([sys.executable, __file__, *args, str(sock.fileno())], pass_fds=(sock.fileno(),),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, **(env or {})})


def s3_env(endpoint: str) -> dict[str, str]:
    """The environment a qbuild process needs to talk to the test server (fake credentials only)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "QBUILD_"))}
    env.update(FAKE_CREDENTIALS, AWS_DEFAULT_REGION=REGION, AWS_REGION=REGION, QBUILD_S3_ENDPOINT_URL=endpoint,
               AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull)
    return env


@dataclass
class S3Server:
    proc: subprocess.Popen
    port: int

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"])

    def stop(self) -> None:
        stop_process(self.proc)


def start_server(env: dict[str, str] | None = None) -> S3Server:
    """moto's S3 server on 127.0.0.1 in a separate process, serving a socket already listening (see _listen).

    env adds variables to the server's environment, e.g. INITIAL_NO_AUTH_ACTION_COUNT=N to enforce IAM after N
    requests."""
    sock = _listen()
    port = sock.getsockname()[1]
    return S3Server(_serve(["moto"], sock, {"MOTO_PORT": str(port), **(env or {})}), port)


_SHARED: S3Server | None = None


def shared_server() -> S3Server:
    """One server per test process (each xdist worker has its own), stopped when the process exits."""
    global _SHARED
    if _SHARED is None or _SHARED.proc.poll() is not None:
        import atexit

        _SHARED = start_server()
        atexit.register(_SHARED.stop)
    return _SHARED


def start_relay(listen: int, target: int, bytes_per_s: int = 0) -> subprocess.Popen:
    """A TCP relay 127.0.0.1:listen -> 127.0.0.1:target, optionally slowing each upload stream to bytes_per_s."""
    return _serve(["relay", str(target), str(bytes_per_s)], _listen(listen))


def start_cutting_relay(listen: int, target: int, cut_after: int, path_part: str = "/cas/") -> subprocess.Popen:
    """A TCP relay 127.0.0.1:listen -> 127.0.0.1:target that closes a connection once `cut_after` bytes of the body
    of a GET response whose path holds `path_part` have passed (a remote dropping connections mid-blob). Other
    requests pass whole; restart a plain relay (start_relay) on the same port to heal it."""
    return _serve(["cutter", str(target), str(cut_after), path_part], _listen(listen))


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _moto(fd: int) -> None:
    """moto_server's main, serving the inherited listening socket `fd`."""
    from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    app = DomainDispatcherApplication(create_backend_app)
    make_server("127.0.0.1", int(os.environ["MOTO_PORT"]), app, threaded=True, request_handler=MotoRequestHandler,
                fd=fd).serve_forever()


def _relay(target: int, bytes_per_s: int, fd: int) -> None:
    server = socket.socket(fileno=fd)

    def pump(src: socket.socket, dst: socket.socket, rate: int) -> None:
        try:
            while data := src.recv(1 << 14):
                dst.sendall(data)
                if rate:
                    time.sleep(len(data) / rate)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    while True:
        client, _ = server.accept()
        upstream = socket.create_connection(("127.0.0.1", target))
        for a, b, rate in ((client, upstream, bytes_per_s), (upstream, client, 0)):
            threading.Thread(target=pump, args=(a, b, rate), daemon=True).start()


def _shut(*socks: socket.socket) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _cutting_relay(target: int, cut_after: int, path_part: str, fd: int) -> None:
    server = socket.socket(fileno=fd)

    def serve(client: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", target))
        cut_next = threading.Event()   # the request just sent is a GET whose response is to be cut

        def requests() -> None:
            try:
                while data := client.recv(1 << 14):
                    # A request line starts a request; boto3 sends one request at a time on a connection.
                    first = data.split(b"\r\n", 1)[0]
                    if first.startswith(b"GET ") and path_part.encode() in first:
                        cut_next.set()
                    upstream.sendall(data)
            except OSError:
                pass
            finally:
                _shut(client, upstream)

        def responses() -> None:
            sent, limit, head = 0, None, b""   # of the response to cut: bytes sent, where to cut, its head so far
            try:
                while data := upstream.recv(1 << 14):
                    if not cut_next.is_set():
                        client.sendall(data)
                        continue
                    if limit is None:
                        head += data
                        end = head.find(b"\r\n\r\n")
                        if end >= 0:
                            length = re.search(rb"(?im)^content-length:\s*(\d+)", head[:end])
                            whole = end + 4 + int(length[1]) if length else None
                            limit = end + 4 + cut_after
                            if whole is not None and whole <= limit:   # too short to cut: pass it, wait for the next
                                client.sendall(data)
                                sent, limit, head = 0, None, b""
                                cut_next.clear()
                                continue
                    if limit is not None and sent + len(data) >= limit:
                        client.sendall(data[:limit - sent])
                        return
                    client.sendall(data)
                    sent += len(data)
            except OSError:
                pass
            finally:
                _shut(client, upstream)

        threading.Thread(target=requests, daemon=True).start()
        threading.Thread(target=responses, daemon=True).start()

    while True:
        serve(server.accept()[0])


if __name__ == "__main__":
    if sys.argv[1:2] == ["moto"]:
        _moto(int(sys.argv[2]))
    elif sys.argv[1:2] == ["relay"]:
        _relay(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1:2] == ["cutter"]:
        _cutting_relay(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
