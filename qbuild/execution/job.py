"""One node's build, as a worker runs it: lock the key, lay out inputs, run the action, commit the outputs.

A Job is plain data so that any executor (a local process pool, a Ray task) can carry it to a worker, and the
worker needs nothing but the store to do its part.

An action's inputs are hardlinks to the store's read-only blobs, and the read-only bit does not stop root: a write
into an input would change the blob itself, under every entry naming it. So a step may only read its inputs, and
that is checked: every input file's inode, size and mtime are taken before the action runs and compared after it,
which sees a write by any code (Python, a C++ or Rust library, a subprocess); a step that wrote fails, and the blob it
damaged leaves the store. With QBUILD_AUDIT_INPUT_WRITES=1 (the test suite sets it) an audit hook also refuses every
write-open of an input from Python at the call, naming the code that tried (docs/architecture.md section 5).
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

from qbuild.core.errors import BuildError, InfraError, QbuildError
from qbuild.core.progress import Emit, StepProgress, elapsed, silent
from qbuild.execution.source_files import locate_checkpoint
from qbuild.planning.keys import other_bytes
from qbuild.planning.step import Context, Source, Step
from qbuild.store.remote import Store, open_store
from qbuild.store.spec import StoreSpec
from qbuild.store.manifest import Manifest

# What a step's libraries print (warnings, progress bars, compiler chatter) is kept, this much of its end, in the
# manifest (meta "output") or on the step's error (`output`); `qbuild compile -v` shows it.
OUTPUT_LINES = 100
OUTPUT_LINE_CHARS = 300
# Below this much free space where a step writes, its failure is reported as a full disk: libraries such as
# torch's zip writer say so in their own words, without an errno.
LOW_SPACE_BYTES = 1 << 20
AUDIT_ENV = "QBUILD_AUDIT_INPUT_WRITES"
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_TRUNC
_audited: set[str] = set()      # the real paths of the inputs of the steps this process runs now (with AUDIT_ENV)
_audit_hook_installed = False


@dataclass(frozen=True)
class Job:
    """One node's build as a worker gets it: plain data, and its step kind, which pickles as a reference to its class
    (a worker imports the class's module to run it)."""

    node_id: str
    step: type[Step]                 # the node's step kind
    name: str
    key: str
    preimage: dict
    params: object                   # the node's typed params (frozen dataclasses, so a job pickles)
    inputs: dict[str, dict]          # input name -> that input's output tree {path: {digest, size}}
    store_spec: StoreSpec            # the store the worker opens (plain data, so a job pickles)
    source: Source | None = None     # where the node's source is on this machine
    code: tuple[str, ...] = ()       # modules the node runs beyond its step's own (part of its code hash)
    locked_digest: str | None = None  # the lock's output under this key: a build of other bytes is refused before
                                      # it is committed or pushed (qbuild.planning.keys.other_bytes)
    expected_seconds: float | None = None   # how long the last such step took, for a timed step (None: not known)

    @property
    def kind(self) -> str:
        return self.step.kind


def run_job(job: Job, emit: Emit | None = None) -> Manifest:
    """Build `job` into the store its spec names (see build_job), reporting its progress to `emit`."""
    progress = silent() if emit is None else StepProgress(emit)
    store = open_store(job.store_spec, progress.transfers())
    return build_job(job, store, progress)


def build_job(job: Job, store: Store, progress: StepProgress | None = None) -> Manifest:
    """Build `job` into `store` unless another process already has; returns the committed manifest. What the step
    reports of its work goes to `progress` (a remote-backed store reports its transfers where it was opened)."""
    with store.local.lock(job.key):
        existing = store.get_manifest(job.key)
        if existing is not None:
            # Another process built it while this one waited for the lock; say so, so it counts as cached.
            _refuse_other_bytes(job, existing, "cached")
            return replace(existing, meta={**existing.meta, "reused": True})
        store.local.clear_staging(job.key)
        stage = store.local.staging_dir(job.key)
        progress = progress or silent()
        try:
            return _build(job, store, stage, progress)
        finally:
            progress.close()
            shutil.rmtree(stage, ignore_errors=True)


def _build(job: Job, store: Store, stage: Path, progress: StepProgress) -> Manifest:
    log_lines: list[str] = []
    ctx = Context(params=job.params, inputs={}, out=stage / "out", scratch=stage / "tmp",
                  source=job.source or Source(), store=job.store_spec, log=log_lines.append, progress=progress)
    ctx.out.mkdir()
    ctx.scratch.mkdir()
    for name, outputs in job.inputs.items():
        ctx.inputs[name] = stage / "in" / name
        store.materialize(outputs, ctx.inputs[name], verify=True)
    inputs = _input_files(job, stage / "in")
    start = time.monotonic()
    output_file = stage / "output.log"
    try:
        if job.step.reads_checkpoint and "snapshot" in ctx.inputs:
            ctx.checkpoint = locate_checkpoint(ctx.inputs["snapshot"], ctx.source, ctx.scratch, ctx.log,
                                               job.store_spec)
        with _captured_output(output_file), _audited_inputs(inputs), _timed(job, progress):
            job.step.run(ctx)
    except Exception as e:
        error = _input_written(job, store, inputs) or _step_error(job, store, stage, e)
        error.output = _tail(output_file)
        raise error from None
    written = _input_written(job, store, inputs)
    if written is not None:
        raise written
    outputs = store.local.ingest_tree(ctx.out)
    manifest = Manifest(key=job.key, kind=job.kind, preimage=job.preimage, outputs=outputs,
                        meta={"seconds": round(time.monotonic() - start, 3), "log": log_lines[-50:],
                              "output": _tail(output_file)})
    _refuse_other_bytes(job, manifest, "built")
    # The staging dir goes before the manifest lands: a build killed just after its commit would leave it behind
    # for good, since a cached key is never built (and its staging cleared) again.
    shutil.rmtree(stage, ignore_errors=True)
    store.commit(manifest)
    return manifest


@contextmanager
def _timed(job: Job, progress: StepProgress) -> Iterator[None]:
    """A timed step reports its elapsed seconds while its action runs (docs/progress.md)."""
    if not job.step.timed:
        yield
        return
    with elapsed(progress, job.kind, job.expected_seconds):
        yield


def _refuse_other_bytes(job: Job, manifest: Manifest, how: str) -> None:
    """Refuse a result under the job's key whose digest is not the lock's for that key, before it is committed or
    pushed: it never becomes the key's entry, here or on a remote (a refused build's blobs stay unnamed until gc
    takes them)."""
    refused = other_bytes(job.name, how, manifest, job.locked_digest)
    if refused is not None:
        raise BuildError(refused)


def _input_files(job: Job, root: Path) -> dict[Path, tuple[str, str, os.stat_result]]:
    """Every materialized input file: its input's name, its relative path, its lstat before the step runs."""
    return {path: (name, rel, os.lstat(path)) for name, outputs in job.inputs.items()
            for rel in outputs for path in [root / name / rel]}


def _input_written(job: Job, store: Store, inputs: dict[Path, tuple[str, str, os.stat_result]]) -> BuildError | None:
    """The step's error if it wrote into one of its inputs (the same inode, another size or mtime; a name it
    removed or replaced left the blob as it was). A damaged blob is removed from the store, if the store still holds
    that inode, so every entry naming it is rebuilt."""
    for path, (name, rel, before) in inputs.items():
        try:
            now = os.lstat(path)
        except FileNotFoundError:
            continue
        if (now.st_dev, now.st_ino) != (before.st_dev, before.st_ino) or \
                (now.st_size, now.st_mtime_ns) == (before.st_size, before.st_mtime_ns):
            continue
        blob = store.local.blob_path(job.inputs[name][rel]["digest"])
        try:
            held = os.lstat(blob)
        except FileNotFoundError:
            held = None
        shared = held is not None and (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)
        if shared:
            store.local.discard_blobs([(blob, held)])
        return BuildError(f"{job.name}: wrote into its input {name}/{rel}; a step may only read its inputs"
                          + (f" (the file was the store's blob {blob.name[:16]}, which is removed now and will be "
                             "rebuilt)" if shared else ""))
    return None


@contextmanager
def _audited_inputs(inputs: dict[Path, tuple]) -> Iterator[None]:
    """With AUDIT_ENV set, refuse every write-open of an input from Python while the block runs (an audit hook, as
    cheap as a set lookup on the opens that write)."""
    global _audit_hook_installed
    if not os.environ.get(AUDIT_ENV):
        yield
        return
    if not _audit_hook_installed:
        sys.addaudithook(_refuse_input_writes)   # for the life of the process: a hook cannot be removed
        _audit_hook_installed = True
    paths = {os.path.realpath(p) for p in inputs}
    _audited.update(paths)
    try:
        yield
    finally:
        _audited.difference_update(paths)


def _refuse_input_writes(event: str, args: tuple) -> None:
    if not _audited or event not in ("open", "os.truncate"):
        return
    path = args[0]
    if event == "open" and not (isinstance(args[2], int) and args[2] & _WRITE_FLAGS):
        return
    if isinstance(path, (str, bytes, os.PathLike)) and os.path.realpath(os.fsdecode(path)) in _audited:
        raise PermissionError(errno.EACCES, "a build step may only read its inputs (they are the store's blobs)",
                              os.fsdecode(path))


def _step_error(job: Job, store: Store, stage: Path, e: Exception) -> QbuildError:
    """The one-line domain error of an action's failure (never cached): the action's own domain error, else a full
    disk (infrastructure), else a build error naming the action's last frame."""
    if isinstance(e, QbuildError):
        return e
    if _out_of_space(e, stage):
        return InfraError(f"{job.name}: no space left on device under {store.root}; free space or use --store on "
                          "a larger disk")
    if isinstance(e, OSError) and e.errno == errno.EFBIG:   # the filesystem's largest file, or `ulimit -f`
        return InfraError(f"{job.name}: a file it wrote under {store.root} outgrew the largest file this process may "
                          f"write ({e.strerror}); raise `ulimit -f` or use --store on another filesystem")
    if isinstance(e, OSError):
        return BuildError(f"{job.name}: {type(e).__name__}: {e}")
    frame = traceback.extract_tb(e.__traceback__)[-1]
    return BuildError(f"{job.name}: {type(e).__name__}: {e} ({frame.filename.split('/')[-1]}:{frame.lineno})")


def _out_of_space(e: BaseException, where: Path) -> bool:
    """Whether a failure is the disk filling up: ENOSPC / EDQUOT anywhere in the exception's chain, or almost no
    free space left where the step was writing (checked before its partial outputs are removed)."""
    seen: BaseException | None = e
    for _ in range(16):
        if seen is None:
            break
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        st = os.statvfs(where)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < LOW_SPACE_BYTES


@contextmanager
def _captured_output(path: Path) -> Iterator[None]:
    """Send this process's stdout and stderr (file descriptors 1 and 2, so C libraries and subprocesses too) to
    `path` while a step runs: a build's own output stays its progress lines."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        with open(path, "wb") as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def _tail(path: Path) -> list[str]:
    """The last OUTPUT_LINES lines of a step's output, each as a terminal would leave it (progress bars redraw with
    carriage returns: the text after the last one)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - OUTPUT_LINES * OUTPUT_LINE_CHARS * 4))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    lines = [line.rsplit("\r", 1)[-1].rstrip() for line in text.split("\n")]
    return [line[:OUTPUT_LINE_CHARS] for line in lines if line][-OUTPUT_LINES:]

