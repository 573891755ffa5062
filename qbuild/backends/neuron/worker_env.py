"""The environment an SDK worker (qbuild.backends.neuron.sdk_worker) runs with: an allow-list of the host's variables,
then what qbuild sets from the recipe and the store. Every other host variable is dropped.

The SDK and the ports read the environment while tracing, and what they read shapes the graph: the Coder-Next port's
SKIP_CONV1D / SKIP_LAYER_COMPUTE / SKIP_ATTN_COMPUTE / SKIP_MOE_COMPUTE, the main ports' QWEN36_* / DELTANET_*
switches, NxD's NXD_LAYOUT_TRANSFORMATION_OPTIONS and NXD_CPU_MODE, NxDI's DISABLE_NUMERIC_CC_TOKEN (set only where
unset), the compiler wrapper's NEURON_CC_FLAGS (docs/nxdi.md section 19). A compile must be a function of its key, so
such a variable reaches it only from the recipe's `port.env`, which is part of the key. Pure: planning imports it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Mapping

# What starts the interpreter, finds the compiler and the runtime's libraries, and reads and writes files; nothing
# here is read by NxD, NxDI, libneuronxla or a port to shape a graph (docs/nxdi.md section 19).
HOST = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "PYTHONPATH", "LD_LIBRARY_PATH")
HOST_PREFIXES = ("LC_",)
# A bundle run keeps the NeuronCores this process was given (Ray sets the variable per task; docs/nxdi.md section 18).
# It picks cores, never what runs on them, and a compile never sees it.
RUNTIME = ("NEURON_RT_VISIBLE_CORES",)
# What qbuild sets itself for a compile (why, for the line that refuses it in port.env).
QBUILD_SET = {
    "BASE_COMPILE_WORK_DIR": "one work directory per compile, under this user's cache directory",
    "NEURON_COMPILE_CACHE_URL": "the store's Neuron compile cache, per toolchain, target and work directory",
    "NEURON_PLATFORM_TARGET_OVERRIDE": "from compiler.target",
    "NEURON_LOGICAL_NC_CONFIG": "from compiler.lnc",
    "NEURON_RT_VISIBLE_CORES": "the NeuronCores a bundle run was given",
    "TMPDIR": "a scratch directory per step",
}
# neuron_cc_wrapper's own flags in NEURON_CC_FLAGS that move or switch off the persistent cache (neuron-caching.rst
# @ 539a73c5).
CACHE_FLAGS = ("--cache_dir", "--no_cache")


def worker_env(qbuild_env: Mapping[str, str], scratch: Path, *, runtime: bool = False,
               host: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment of one SDK operation: the allow-listed host variables (and, for a bundle run, RUNTIME), this
    interpreter's bin directory first on PATH (libneuronxla runs `neuronx-cc` by name: it must be the install beside
    the interpreter that checked the pins, activated or not), TMPDIR in `scratch`, then `qbuild_env` (the recipe's
    port.env, the FP8 switches, target, LNC, work dir and cache)."""
    env = {k: v for k, v in host.items() if k in HOST or k.startswith(HOST_PREFIXES)}
    if runtime:
        env.update({k: host[k] for k in RUNTIME if k in host})
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bindir, env["PATH"]]) if env.get("PATH") else bindir
    tmp = scratch / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env["TMPDIR"] = str(tmp)
    env.update(qbuild_env)
    return env
