"""The resident planner: a `qbuild plan` that the plan cache cannot answer, planned by a warm process.

Right after a recipe is edited the plan cache misses and the planner must run. Most of that run is not planning:
it is starting the interpreter's imports and building the recipe schema (pydantic), which cost several times the
interpreter's own start. So a plan that misses also starts this server in the background, once per interpreter
setup (see `address`); it imports the planner and then waits. A later miss connects, hands over its standard
streams (SCM_RIGHTS), working directory, environment, umask, start time and arguments, and the server forks a
child that runs the command line's own full plan path (qbuild.fastpath) on those streams, recording a plan-cache
entry as the command would. The server itself never plans, so every request starts from the same freshly imported
state, and what the child prints is what the command would have printed.

It answers only while it is the code and the installation that the command would run: the address is a digest of
the interpreter, its flags, sys.path and the environment variables that change how Python starts, and qbuild's
source files and the installed distributions are compared with what the server started with on every request; any
difference stops the server, and the command plans in process. It exits after IDLE_SECONDS without a request.
Anything that goes wrong on the way (no server, a stale one, a child that could not answer) is the command
planning in process, exactly as without a server. QBUILD_PLAN_SERVER=off neither uses nor starts one.

Like the fast path, a request imports nothing heavy: this module needs only the standard library.
"""

from __future__ import annotations

import json
import os
import sys

SWITCH = "QBUILD_PLAN_SERVER"
IDLE_SECONDS = 1200
_MAX_MESSAGE = 1 << 20
# What changes how the interpreter starts or decodes text: a server started under other values is another server.
_STARTUP_ENV = ("LANG", "LC_ALL", "LC_CTYPE")


def enabled() -> bool:
    return os.environ.get(SWITCH, "").lower() not in ("off", "0", "false", "no")


# --- where a server is --------------------------------------------------------------------------------------------

def _interpreter() -> dict:
    """What the server must share with the command for a child of it to run as the command would."""
    env = {k: v for k, v in os.environ.items() if k.startswith("PYTHON") or k in _STARTUP_ENV}
    return {"executable": sys.executable, "version": sys.version, "flags": repr(sys.flags),
            "xoptions": sorted(map(str, sys._xoptions.items())), "sys_path": list(sys.path),
            "env": [[k, v] for k, v in sorted(env.items())]}      # as a request carries it through JSON


def address(interpreter: dict | None = None) -> str | None:
    """The socket of the server for this interpreter setup (short: a socket path has a limit of about 100 bytes)."""
    import hashlib

    from .userdir import runtime_dir

    directory = runtime_dir()
    if directory is None:
        return None
    digest = hashlib.blake2b(json.dumps(interpreter or _interpreter(), sort_keys=True).encode(),
                             digest_size=8).hexdigest()
    return os.path.join(directory, f"plan-{digest}.sock")


# --- the command's side -------------------------------------------------------------------------------------------

def ask(argv: list[str], started_ns: int) -> tuple[bool, int | None]:
    """Have a running server plan `argv` on this process's streams: (whether a server was reached, its exit code).
    The code is None where it did not answer (a stale server, or a plan it could not answer, which the command line
    then runs and reports itself)."""
    path = address() if enabled() else None
    if path is None:
        return False, None
    import socket

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        conn.close()
        return False, None
    return True, _request(conn, argv, started_ns)


def _request(conn, argv: list[str], started_ns: int) -> int | None:
    import array
    import socket

    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "umask": _umask(),
               "started_ns": started_ns, "interpreter": _interpreter(),
               "streams": [_stream_setup(sys.stdout), _stream_setup(sys.stderr)]}
    child = None
    try:
        fds = [sys.stdin.fileno() if sys.stdin else os.open(os.devnull, os.O_RDONLY), 1, 2]
        conn.sendmsg([json.dumps(request).encode() + b"\n"],
                     [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        reader = conn.makefile("rb")
        first = json.loads(reader.readline() or "null")
        if not isinstance(first, dict) or "pid" not in first:
            return None
        child = first["pid"]
        reply = json.loads(reader.readline() or "null")
        return reply.get("code") if isinstance(reply, dict) else None
    except KeyboardInterrupt:
        if child is not None:
            _kill(child)
        raise
    except (OSError, ValueError):
        return None
    finally:
        conn.close()


def start() -> None:
    """Start a server for this interpreter setup in the background, unless one is disabled or cannot be placed.
    Two commands starting one at once are fine: the second server finds the first holding the address and exits."""
    path = address() if enabled() else None
    if path is None:
        return
    import subprocess

    boot = "import sys, json; a = json.loads(sys.argv[1]); sys.path[:] = a['sys_path']; " \
           "from qbuild.planserver import serve; serve(a['path'])"
    args = json.dumps({"path": path, "sys_path": sys.path})
    try:
        subprocess.Popen([sys.executable, *_interpreter_options(), "-c", boot, args], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    except OSError:
        pass


def stop(path: str | None = None) -> bool:
    """Ask the server at `path` (default: this interpreter setup's) to exit; whether one was there."""
    path = path or address()
    if path is None:
        return False
    import socket

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        conn.sendall(json.dumps({"stop": True}).encode() + b"\n")
        conn.recv(16)
        return True
    except OSError:
        return False
    finally:
        conn.close()


def serving(directory: str) -> list[int]:
    """The processes serving from `directory` (each server's lock file names it once it is ready to answer)."""
    out = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".sock.lock"):
            try:
                with open(os.path.join(directory, name)) as f:
                    pid = f.read().strip()
            except OSError:
                continue
            if pid.isdigit():
                out.append(int(pid))
    return out


def stop_all(directory: str) -> None:
    """End every server serving from `directory` (a benchmark's or a test's own runtime directory)."""
    import signal

    for pid in serving(directory):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def _interpreter_options() -> list[str]:
    """The options this interpreter was started with (`python -X importtime -m ...` -> ["-X", "importtime"]), so
    that the server shares its flags."""
    out: list[str] = []
    args = sys.orig_argv[1:]
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-m", "-c") or not a.startswith("-") or a == "-":
            break
        out.append(a)
        if a in ("-X", "-W", "--check-hash-based-pycs") and i + 1 < len(args):
            out.append(args[i + 1])
            i += 1
        i += 1
    return out


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _stream_setup(stream) -> dict | None:
    if stream is None:
        return None
    return {"encoding": stream.encoding, "errors": stream.errors, "line_buffering": stream.line_buffering,
            "write_through": getattr(stream, "write_through", False)}


def _kill(pid: int) -> None:
    import signal

    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


# --- the server's side --------------------------------------------------------------------------------------------

def serve(path: str) -> None:
    """Hold `path` and fork a planning child per request until idle, stale, or asked to stop."""
    import fcntl
    import signal
    import socket
    import time

    lock_fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return      # another server holds the address
    try:
        os.unlink(path)         # left by a server that died; the lock says none is serving
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    bound = os.stat(path).st_ino
    listener.listen(16)
    listener.settimeout(IDLE_SECONDS)
    try:
        from . import plancache

        # Taken before the imports, so that a file changed while they ran is a difference at the first request; a
        # file changed too recently for its timestamp to tell a later change apart makes no server at all.
        started_ns = time.time_ns()
        baseline = (plancache._source_files(), plancache.distributions())
        if any(plancache._racy(sig, os.path.join(plancache.SOURCE_ROOT, rel), started_ns) for rel, sig in baseline[0]):
            return
        _warm_up()
        interpreter = _interpreter()
        os.ftruncate(lock_fd, 0)
        os.write(lock_fd, f"{os.getpid()}\n".encode())     # ready; and which process serves, to stop it by hand
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)     # children are reaped by the kernel
        while True:
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                return
            try:
                conn.settimeout(10)
                request, fds = _receive(conn)
            except (OSError, ValueError):
                conn.close()
                continue
            if request.get("stop"):
                conn.sendall(b"{}\n")
                conn.close()
                return
            current = (plancache._source_files(), plancache.distributions())
            if current != baseline or request.get("interpreter") != interpreter or len(fds) != 3:
                _refuse(conn, fds)
                if current != baseline:
                    return
                continue
            conn.settimeout(None)
            pid = os.fork()
            if pid == 0:
                listener.close()
                _child(conn, request, fds)      # never returns
            for fd in fds:
                os.close(fd)
            conn.close()
    finally:
        listener.close()
        try:
            if os.stat(path).st_ino == bound:      # still ours: a successor may have bound it since
                os.unlink(path)
        except OSError:
            pass
        os.close(lock_fd)


def _warm_up() -> None:
    """Import what a full plan imports, so that children start with it; create no state (consoles, caches)."""
    from . import fastpath, recipe, render, workspace  # noqa: F401
    from .backends import neuron  # noqa: F401

    import rich.console  # noqa: F401
    import rich.tree  # noqa: F401


def _receive(conn) -> tuple[dict, list[int]]:
    import array
    import socket

    fds = array.array("i")
    data, ancillary, _, _ = conn.recvmsg(_MAX_MESSAGE, socket.CMSG_LEN(3 * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    while not data.endswith(b"\n"):
        more = conn.recv(_MAX_MESSAGE)
        if not more:
            break
        data += more
    request = json.loads(data)
    if not isinstance(request, dict):
        raise ValueError("not a request")
    return request, list(fds)


def _refuse(conn, fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
    try:
        conn.sendall(b"{}\n")
    except OSError:
        pass
    conn.close()


def _child(conn, request: dict, fds: list[int]) -> None:
    """Become the command: its streams, directory, environment and umask; plan as the command line would; send the
    exit code (None: not answered, the command runs its own full path)."""
    import signal

    code = None
    try:
        conn.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
        for target, fd in enumerate(fds):
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)
        sys.stdout, sys.stderr = (_text_stream(fd, setup) for fd, setup in zip((1, 2), request["streams"]))
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.umask(request["umask"])
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sys.argv = ["qbuild", *request["argv"]]
        from .fastpath import plan_request

        code = plan_request(request["argv"], request["started_ns"])
    except BaseException:
        code = None
    finally:
        try:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            conn.sendall(json.dumps({"code": code}).encode() + b"\n")
        except BaseException:
            pass
        os._exit(0)


def _text_stream(fd: int, setup: dict | None):
    import io

    if setup is None:
        return None
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=setup["encoding"], errors=setup["errors"],
                            line_buffering=setup["line_buffering"], write_through=setup["write_through"])
