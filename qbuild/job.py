"""One node's build, as a worker runs it: lock the key, lay out inputs, run the action, commit the outputs.

A Job is plain data so that any executor (a local process pool, a Ray task) can carry it to a worker, and the
worker needs nothing but the store to do its part.
"""

from __future__ import annotations

import errno
import shutil
import time
import traceback
from dataclasses import dataclass, field, replace

from .actions import RunContext
from .errors import BuildError, InfraError, QbuildError
from .store import StoreSpec, open_store
from .store.manifest import Manifest


@dataclass(frozen=True)
class Job:
    node_id: str
    kind: str
    name: str
    key: str
    preimage: dict
    params: dict
    inputs: dict[str, dict]          # input name -> that input's output tree {path: {digest, size}}
    store: StoreSpec
    entry: str                       # "module:function" the worker imports and calls
    context: dict = field(default_factory=dict)


def run_job(job: Job) -> Manifest:
    """Build `job` into the store unless another process already has; returns the committed manifest."""
    store = open_store(job.store)
    with store.lock(job.key):
        existing = store.get_manifest(job.key)
        if existing is not None:
            # Another process built it while this one waited for the lock; say so, so it counts as cached.
            return replace(existing, meta={**existing.meta, "reused": True})
        store.clear_staging(job.key)
        stage = store.staging_dir(job.key)
        try:
            return _build(job, store, stage)
        finally:
            shutil.rmtree(stage, ignore_errors=True)


def _build(job: Job, store, stage) -> Manifest:
    ctx = RunContext(kind=job.kind, params=job.params, inputs={}, out=stage / "out", scratch=stage / "tmp",
                     context=job.context, store=job.store)
    ctx.out.mkdir()
    ctx.scratch.mkdir()
    for name, outputs in job.inputs.items():
        ctx.inputs[name] = stage / "in" / name
        store.materialize(outputs, ctx.inputs[name], verify=True)
    log_lines: list[str] = []
    ctx.log = log_lines.append
    fn = _load(job.entry)
    start = time.monotonic()
    try:
        fn(ctx)
    except QbuildError:
        raise
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise InfraError(f"{job.name}: no space left on device under {store.root}; free space or use --store "
                             "on a larger disk") from None
        raise BuildError(f"{job.name}: {type(e).__name__}: {e}") from None
    except Exception as e:
        # An action's own failure is reported as a build error with its last frame, never cached.
        frame = traceback.extract_tb(e.__traceback__)[-1]
        raise BuildError(f"{job.name}: {type(e).__name__}: {e} ({frame.filename.split('/')[-1]}:{frame.lineno})") \
            from None
    outputs = store.ingest_tree(ctx.out)
    manifest = Manifest(key=job.key, kind=job.kind, preimage=job.preimage, outputs=outputs,
                        meta={"seconds": round(time.monotonic() - start, 3), "log": log_lines[-50:]})
    store.commit(manifest)
    return manifest


def _load(entry: str):
    import importlib

    module, func = entry.split(":")
    return getattr(importlib.import_module(module), func)
