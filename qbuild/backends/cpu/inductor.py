"""AOTInductor: compile an exported program to native CPU code, packaged as one .pt2 (weights stay inputs)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def package(program, target: Path, scratch: Path) -> float:
    """AOT-compile `program` into the package `target`; returns the seconds it took.

    Inductor's caches go to `scratch` so a build never reads or pollutes a shared cache (the result must be a
    function of the program and the toolchain only). One stays shared, on purpose upstream: the C++ precompiled
    headers, under <tmp>/torchinductor_<user>/precompiled_headers whatever TORCHINDUCTOR_CACHE_DIR says
    (torch/_inductor/codecache.py line 3542 at v2.13.0). Each is named by the preprocessed header and the command
    line, and the compiler takes one only where it stands for that header, so it changes the time, not the bytes: the
    first AOTInductor compile with a new torch include path (a new venv) builds them, about 15 s on 2 cores.
    """
    import torch

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(scratch / "inductor-cache")
    start = time.monotonic()
    torch._inductor.aoti_compile_and_package(program, package_path=str(target))
    return time.monotonic() - start


def load(path: Path):
    """A callable with the exported program's signature: (weights, *args) -> outputs."""
    import torch

    return torch._inductor.aoti_load_package(str(path))
