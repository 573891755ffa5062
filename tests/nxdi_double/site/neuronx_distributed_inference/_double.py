"""What every part of the NxDI contract double shares: the call log and the refusals.

The double stands in for the public surface of neuronx-distributed-inference (NxDI), NxD and torch-neuronx that qbuild
calls. It exists only on the PYTHONPATH the tests build (tests/nxdi_double/site), never for the product. Each fact it
encodes names its source; where the sources say nothing, it is stricter than the real SDK and says so.

Every call appends one JSON line to the log file the double's settings name (nothing is logged without one), with
the environment the SDK reads, the names of every variable the process has, sys.path and the working directory, so a
test can assert what a compile subprocess saw. The settings are a JSON file, nxdi_double_settings.json, in the first
directory of sys.path that has one (a test puts it on PYTHONPATH, tests.nxdi_double.settings_dir): qbuild gives the
SDK worker a hermetic environment, which no test variable reaches, while PYTHONPATH is how the worker finds the SDK.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time

# The variables the SDK and the ports read (docs/nxdi.md sections 10, 9; docs/nxdi.md sections 15, 16).
ENV_KEYS = ("BASE_COMPILE_WORK_DIR", "NEURON_COMPILE_CACHE_URL", "NEURON_CC_FLAGS", "NEURON_LOGICAL_NC_CONFIG",
            "NEURON_PLATFORM_TARGET_OVERRIDE", "XLA_HANDLE_SPECIAL_SCALAR", "UNSAFE_FP8FNCAST")
ENV_PREFIXES = ("QWEN36_",)


class DoubleRefusal(RuntimeError):
    """The double cannot do what the real SDK would do here (read a checkpoint, find the host's platform, reach S3).
    It refuses loudly instead of pretending, so a product path that would take it fails in the tests."""


SETTINGS_FILE = "nxdi_double_settings.json"


def env_snapshot() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if k in ENV_KEYS or k.startswith(ENV_PREFIXES)}


def settings() -> dict:
    """{"log": the call log's path, "barrier": "<dir>:<n>"}, each optional, from the first SETTINGS_FILE on sys.path."""
    for entry in sys.path:
        path = os.path.join(entry, SETTINGS_FILE) if entry else None
        if path and os.path.isfile(path):
            with open(path) as f:
                return json.load(f)
    return {}


def record(call: str, **data) -> None:
    """Append one JSON line describing a call to the settings' log (flocked: concurrent compiles share the file)."""
    path = settings().get("log")
    if not path:
        return
    doc = {"call": call, "pid": os.getpid(), "time": time.time(), "cwd": os.getcwd(), "sys_path": list(sys.path),
           "env": env_snapshot(), "env_names": sorted(os.environ), **data}
    line = json.dumps(doc, sort_keys=True, default=str) + "\n"
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(line)
        f.flush()
