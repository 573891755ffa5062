"""This host's platform tag: what a native or CPU-dependent output depends on beyond the rest of its key.

    <machine>-<os>-<libc><version>-<python>-<torch CPU capability>     e.g. x86_64-linux-glibc2.36-cp311-AVX2

An AOTInductor package is native code for the machine, libc and Python it was built with; and torch picks its
vectorised CPU kernels by capability (the widest the CPU supports), whose results differ in their last bits, so
reference logits and verify reports depend on it too. Non-portable nodes carry this tag in their key preimage
(qbuild.planning.keys), portable ones do not.

torch reads the capability once per process: ATEN_CPU_CAPABILITY where it names one this build of torch has
("default", "avx2", "avx512" on x86; "vsx", "zvector" on POWER and Z), else the widest the CPU supports; any other
value it ignores with a warning (aten/src/ATen/native/DispatchStub.cpp:L13-L40 @ a466df454c4c, `compute_cpu_capability`;
`torch.backends.cpu.get_cpu_capability()` returns it as "DEFAULT", "AVX2", "AVX512", ...). So that variable is the one
way to build for a narrower capability on a wider CPU, and the tag follows it. torch takes the value without asking
the CPU: one wider than the CPU's makes its kernels use instructions the CPU lacks (SIGILL).

Reading the capability means importing torch, which planning never does: a subprocess asks torch, and the answer
is cached in the user cache directory under what it depends on (torch's installed version, the CPU's flags in
/proc/cpuinfo, ATEN_CPU_CAPABILITY), so a host asks once per torch install and setting.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform as _platform
import subprocess
import sys
import tempfile
from functools import cache

from qbuild.core.errors import InfraError
from qbuild.core.hashing import digest_json
from qbuild.core.userdir import cache_dir

CAPABILITY_ENV = "ATEN_CPU_CAPABILITY"
NO_TORCH = "notorch"          # the capability part of the tag where torch is not installed
PROBE_TIMEOUT_S = 300.0
_PROBE = "import torch; print(torch.backends.cpu.get_cpu_capability())"
_MACHINES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}
_IMPLEMENTATIONS = {"cpython": "cp", "pypy": "pp"}


def host_tag() -> str:
    """This host's platform tag (see the module docstring), under the current ATEN_CPU_CAPABILITY."""
    return _host_tag(os.environ.get(CAPABILITY_ENV))


@cache
def _host_tag(capability_env: str | None) -> str:
    return "-".join((machine(), sys.platform, libc(), python_tag(), cpu_capability()))


def machine() -> str:
    m = _platform.machine().lower()
    return _MACHINES.get(m, m) or "unknown"


def libc() -> str:
    """The C library native code links against, with its version: "glibc2.36". "unknownlibc" where Python cannot
    tell (musl, macOS)."""
    name, version = _platform.libc_ver()
    return f"{name}{version}" if name else "unknownlibc"


def python_tag() -> str:
    """The interpreter as wheel tags name it: cp311."""
    impl = sys.implementation.name
    return f"{_IMPLEMENTATIONS.get(impl, impl)}{sys.version_info.major}{sys.version_info.minor}"


def cpu_capability() -> str:
    """torch's CPU capability ("AVX2", "AVX512", "DEFAULT", "SVE256", ...; spaces dropped), from the cache or a
    subprocess; NO_TORCH where torch is not installed."""
    torch_version = _torch_version()
    if torch_version is None:
        return NO_TORCH
    env = os.environ.get(CAPABILITY_ENV)
    path = os.path.join(cache_dir("platform"),
                        digest_json({"torch": torch_version, "cpu": _cpu_flags(), "env": env,
                                     "python": sys.executable})[:32] + ".json")
    cached = _read_cached(path)
    if cached is not None:
        return cached
    capability = _probe()
    _write_cached(path, {"capability": capability, "torch": torch_version, CAPABILITY_ENV: env})
    return capability


def _probe() -> str:
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise InfraError(f"cannot ask torch for this CPU's capability: {e}") from None
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        why = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        raise InfraError(f"cannot ask torch for this CPU's capability ({sys.executable} -c {_PROBE!r}): {why}")
    return lines[-1].replace(" ", "")


def _torch_version() -> str | None:
    """torch's installed version, read from the first lines of its METADATA (parsing the whole file as a message
    costs more than the rest of this module)."""
    try:
        dist = importlib.metadata.distribution("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    for line in (dist.read_text("METADATA") or "").splitlines():
        if not line:
            break
        if line.startswith("Version:"):
            return line.removeprefix("Version:").strip()
    return dist.version


def _cpu_flags() -> str:
    """The CPU's feature flags (x86 "flags", ARM "Features"); the machine and processor names where there is no
    /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return " ".join(sorted(value.split()))
    except OSError:
        pass
    return f"{_platform.machine()} {_platform.processor()}"


def _read_cached(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            capability = json.load(f)["capability"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return capability if isinstance(capability, str) and capability else None


def _write_cached(path: str, doc: dict) -> None:
    """Best effort, by atomic rename (a concurrent reader sees the old answer or the new one): without a writable
    cache the probe simply runs again next time."""
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".probe-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(doc, f, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass
