"""The server process of a neuron bundle, whichever program it is (vLLM's OpenAI server, or qbuild's own over the port's
VL classes: vllm_serve, vl_serve): a port chosen before it starts, the child run in a session of its own with Ctrl-C
and SIGTERM handed on, its URL announced once it answers, and the bundle checked after it stopped."""

from __future__ import annotations

import http.client
import os
import subprocess
from pathlib import Path

from qbuild.backends.base import ServeOptions
from qbuild.core.errors import InfraError, UserError

READY_POLL_S = 1.0


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10000


def free_ports(host: str, count: int) -> list[int]:
    """`count` distinct ports nothing listens on now, on `host` (the first) and loopback (the others), for --port 0:
    the server is told its port, so one is chosen before it starts. Each socket is held until all are chosen, so two
    choices cannot meet.

    They are taken below the kernel's ephemeral range where it is known (Linux), because qbuild polls the port before
    the server listens: a connect() to a port of that range nobody listens on can be given that very port as its
    source port and connect to itself (TCP self-connect), reading its own request back and holding the port, which the
    server then cannot bind."""
    import random
    import socket

    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    candidates = random.sample(range(LOWEST_PORT, low), min(256, low - LOWEST_PORT)) if low > LOWEST_PORT else []
    sockets = []
    try:
        for i in range(count):
            where = host if i == 0 else "127.0.0.1"
            family = socket.getaddrinfo(where, 0, type=socket.SOCK_STREAM)[0][0]
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            while candidates:
                try:
                    sock.bind((where, candidates.pop()))
                    break
                except OSError:   # taken: try another
                    continue
            else:
                sock.bind((where, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def child_env(doc_env: dict) -> dict:
    """This process's environment with a serving document's over it, its PYTHONPATH in front of the host's."""
    env = dict(os.environ, **doc_env)
    if os.environ.get("PYTHONPATH") and doc_env.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join((doc_env["PYTHONPATH"], os.environ["PYTHONPATH"]))
    return env


def run_children(commands: list[tuple[list[str], dict]], urls: list[str], options: ServeOptions,
                 bundle: Path, manifest: dict, names: list[str]) -> int:
    """Start each (command, environment) in a session of its own, announce the last of `urls` once each answers in
    turn, and wait until one ends, forwarding SIGINT and SIGTERM to each; then stop the others and check that the
    bundle is as it was. Returns 0 when they ended after such a signal; InfraError naming the one of `names` that ended
    by itself, or a changed bundle."""
    children = [subprocess.Popen(command, env=env, start_new_session=True) for command, env in commands]
    try:
        stopped = _wait(children, urls, options)
    finally:
        for child in children:
            if child.poll() is None:
                child.terminate()
                child.wait()
        check_unchanged(bundle, manifest, names[0])
    if stopped:
        return 0
    ended = next(i for i, c in enumerate(children) if c.returncode is not None)
    raise InfraError(f"{names[ended]} exited with code {children[ended].returncode} before it was stopped; its output "
                     "is above")


def _wait(children: list, urls: list[str], options: ServeOptions) -> bool:
    """Wait until one of `children` ends, forwarding SIGINT and SIGTERM to each and announcing the last of `urls`
    once each has answered in turn; whether they ended after such a signal."""
    import signal
    import threading
    import urllib.error
    import urllib.request

    stopping, ended = threading.Event(), threading.Event()

    def forward(signum, frame) -> None:
        stopping.set()
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    def answers(url: str) -> bool:
        try:
            with urllib.request.urlopen(url + "/models", timeout=READY_POLL_S):
                return True
        except urllib.error.HTTPError:
            return True     # it answers (401 where an API key is set): the server listens once its model is loaded
        except (OSError, http.client.HTTPException):
            # Nobody listens yet; or, the port being in the ephemeral range, the poll's own socket was given it as its
            # source port and connected to itself (Linux's TCP self-connect), so it read its own request back.
            return False

    def announce() -> None:
        for url in urls:
            while not answers(url):
                if ended.is_set() or stopping.wait(READY_POLL_S):
                    return
        options.on_ready(urls[-1])

    def wait(child) -> None:
        child.wait()
        ended.set()

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        threading.Thread(target=announce, daemon=True).start()
        for child in children:
            threading.Thread(target=wait, args=(child,), daemon=True).start()
        while not ended.wait(READY_POLL_S):
            pass
        if stopping.is_set():
            for child in children:
                child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return stopping.is_set()


def check_unchanged(bundle: Path, manifest: dict, who: str = "vLLM") -> None:
    """InfraError naming the first file the server (`who`) changed, added or removed in the bundle."""
    from qbuild.model.bundle import MANIFEST, check_files

    try:
        check_files(bundle, manifest)
    except UserError as e:
        raise InfraError(f"{who} changed the bundle while it served it: {e}") from None
    added = sorted(p.relative_to(bundle).as_posix() for p in bundle.rglob("*")
                   if p.is_file() and p.relative_to(bundle).as_posix() not in manifest["files"]
                   and p.name != MANIFEST and "__pycache__" not in p.parts)
    if added:
        raise InfraError(f"{who} changed the bundle while it served it: {bundle / added[0]} was written "
                         f"({len(added)} new file{'s' if len(added) > 1 else ''}); pull it again")
