"""port: the NxDI contrib port's source, copied into the store so that every machine compiles the same code.

Output: the port's Python files (tests excluded) under their relative paths, checked against the digests the planner
took (its params, the neuron backend's PortFiles, or PortMissing where the port was not found). A neuron compile puts
this tree on sys.path (qbuild.backends.neuron.ports.Lineage.module_dir), so a Ray worker or a CI runner compiles
exactly what was planned, and a changed port changes the keys of what it affects: shard, compile, package.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from qbuild.build.actions import RunContext
from qbuild.core.errors import UserError


def run(ctx: RunContext) -> None:
    files = ctx.params.planned_files()
    from qbuild.core.hashing import default_stat_cache

    root = Path(ctx.context["path"])
    cache = default_stat_cache()
    for rel, digest in sorted(files.items()):
        src = root / rel
        if not src.is_file() or "blake3:" + cache.digest(src) != digest:
            raise UserError(f"{src}: changed since planning; run the command again")
        dst = ctx.out / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
    ctx.log(f"port {root.name}: {len(files)} files")
