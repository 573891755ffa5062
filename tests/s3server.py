"""A real S3 API on loopback for tests: moto's standalone server in its own process, plus a TCP relay.

The relay (`python tests/s3server.py relay LISTEN_PORT TARGET_PORT`) stands between qbuild and the server, so a
test can make "the server" vanish mid-transfer by killing the relay while the objects written so far stay
inspectable on the real server behind it.
"""

from __future__ import annotations

import os
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


def wait_for_port(port: int, timeout: float = 20.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for port {port} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


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


def start_server(port: int | None = None, env: dict[str, str] | None = None) -> S3Server:
    """moto_server on 127.0.0.1 in a separate process; returns once it accepts connections.

    env adds variables to the server's environment, e.g. INITIAL_NO_AUTH_ACTION_COUNT=N to enforce IAM after N
    requests."""
    port = port or free_port()
    exe = Path(sys.executable).with_name("moto_server")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "moto.server"]
    proc = subprocess.Popen([*cmd, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, env={**os.environ, **(env or {})})
    try:
        wait_for_port(port, proc=proc)
    except BaseException:
        stop_process(proc)
        raise
    return S3Server(proc, port)


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
    proc = subprocess.Popen([sys.executable, __file__, "relay", str(listen), str(target), str(bytes_per_s)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    wait_for_port(listen, proc=proc)
    return proc


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _relay(listen: int, target: int, bytes_per_s: int) -> None:
    server = socket.create_server(("127.0.0.1", listen))

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


if __name__ == "__main__":
    if sys.argv[1:2] == ["relay"]:
        _relay(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
