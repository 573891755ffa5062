"""The Neuron compile cache, kept in the store: one of the store's side caches (qbuild.store.side_cache), which the
neuron backend registers (NeuronBackend.side_caches) so that gc trims it and `store verify` checks it.

The Neuron compiler's wrapper keeps every NEFF it compiles in a persistent cache and reuses it when the same HLO and
flags come again (docs/nxdi.md section 10). A neuron compile points it (NEURON_COMPILE_CACHE_URL) at a folder of the
store:

    <store>/neuron-compile-cache/<neuronx-cc pin>/<target>/<group>/      one compile's cache
        neuronxcc-<installed version>/MODULE_<hlo hash>+<flags hash>/    one entry, in the SDK's own layout:
            model.neff, model.hlo_module.pb, compile_flags.json, ..., and model.done once it is complete

A group is one work directory. NxD hashes the absolute work directory into every NEFF's key (the --logfile flag), so
only compiles in the same work directory can share entries; a group is therefore the unit in which the cache is used,
shared and trimmed:
- a compile holds the group's lock (<store>/locks/) while it runs; first it drops the entries a crashed or failed
  compile left (the SDK would reuse a cached failure, and failures are never cached: docs/architecture.md section 5),
  and it marks the group used (the mtime of its directory) before and after;
- with a remote the compile first lays out the entries the remote holds for the group, and a compile that pushes then
  uploads the complete entries the remote lacks: their files as blobs of the remote's CAS, then the group's index
  object `<prefix>/neuron-compile-cache/<pin>/<target>/<group>.json`, {"version": 1, "entries": {"neuronxcc-<v>/
  MODULE_<k>": {file: {"digest", "size"}}}}. The SDK never writes to the remote itself. A cache is an optimisation:
  a transfer that fails is logged and the compile goes on without it. Its bytes are reported as a store's transfers
  are (the `progress` of `using`, qbuild.store.remote.Progress: begin, advance, end), so the driver shows them;
- `qbuild gc` trims whole groups, least recently used first, within the --keep-size budget it also spends on the
  store's unlocked entries (qbuild.store.gc, through `CACHE` below), locally and on the remote;
- `qbuild store verify` names every entry that is not complete, and --repair removes them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from qbuild.core.errors import InfraError
from qbuild.core.hashing import digest_bytes, digest_file
from qbuild.core.files import discard_path, safe_join
from qbuild.store.side_cache import CacheGroup

CACHE_DIR = "neuron-compile-cache"
INDEX_VERSION = 1
# An entry is complete once the wrapper wrote its NEFF and then model.done; model.log without a NEFF is a compile that
# failed, which the wrapper reuses as a failure until asked to retry (neuron-caching.rst @ 539a73c5; the states as
# optimum-neuron classifies them: optimum/neuron/cache/cleanup.py `_classify_entry` @ 09863a4).
NEFF, DONE, LOG = "model.neff", "model.done", "model.log"
_ENTRY = re.compile(r"^neuronxcc-[^/]+/MODULE_[^/]+$")
_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


def lock_key(name: str) -> str:
    """The store lock (LocalStore.lock) a compile holds while it uses group `name`."""
    return "neuron-cache-" + digest_bytes(name.encode())[:32]


def group_name(toolchain: str, target: str, group: str) -> str:
    for part in (toolchain, target, group):
        if not _SEGMENT.match(part):
            raise ValueError(f"compile cache: {part!r} cannot name a folder")
    return f"{toolchain}/{target}/{group}"


def groups(store_root: Path) -> list[CacheGroup]:
    """Every group of the store's compile cache, named "<pin>/<target>/<group>"."""
    out = []
    for path in sorted((Path(store_root) / CACHE_DIR).glob("*/*/*")):
        try:
            if path.name.startswith(".") or not path.is_dir() or path.is_symlink():
                continue
            used = path.stat().st_mtime
        except FileNotFoundError:
            continue
        out.append(CacheGroup(path, path.relative_to(Path(store_root) / CACHE_DIR).as_posix(), used, _size(path)))
    return out


def entries(group: Path) -> list[Path]:
    return sorted(p for p in group.glob("neuronxcc-*/MODULE_*") if p.is_dir() and not p.is_symlink())


def state(entry: Path) -> str:
    """"complete", "failed" (a failure the wrapper would reuse) or "incomplete" (a compile stopped in it)."""
    neff = (entry / NEFF).is_file()
    if neff and (entry / DONE).is_file():
        return "complete"
    if (entry / LOG).is_file() and not neff:
        return "failed"
    return "incomplete"


def _size(path: Path) -> int:
    total = 0
    for f in path.rglob("*"):
        try:
            if f.is_file() and not f.is_symlink():
                total += f.stat().st_size
        except FileNotFoundError:
            continue
    return total


def _touch(group: Path) -> None:
    now = time.time()
    os.utime(group, (now, now))


def prune(group: Path) -> list[str]:
    """Remove the entries that are not complete (call with the group's lock held); returns their names."""
    gone = []
    for entry in entries(group):
        if state(entry) != "complete":
            shutil.rmtree(entry, ignore_errors=True)
            gone.append(entry.relative_to(group).as_posix())
    for stray in group.glob(".pull-*"):   # a download that was killed
        shutil.rmtree(stray, ignore_errors=True)
    return gone


# --- one compile's use of its group ----------------------------------------------------------------------------------

@contextmanager
def using(store, remote_url: str | None, push: bool, toolchain: str, target: str, group: str,
          log: Callable[[str], None], progress=None) -> Iterator[Path]:
    """The group directory of a compile in `store` (a LocalStore; the directory is the compile's
    NEURON_COMPILE_CACHE_URL), locked for it, pruned, and with what the remote at `remote_url` holds for it laid out;
    after the compile succeeded, the complete entries the remote lacks go up where the build pushes. The bytes of
    both transfers are reported to `progress` (qbuild.store.remote.Progress), if given."""
    name = group_name(toolchain, target, group)
    path = Path(store.root) / CACHE_DIR / name
    with store.lock(lock_key(name)):
        path.mkdir(parents=True, exist_ok=True)   # under the lock: a gc may have removed the group until it was taken
        dropped = prune(path)
        if dropped:
            log(f"compile cache: dropped {len(dropped)} failed or incomplete entries ({', '.join(dropped[:3])})")
        _touch(path)
        remote = None
        if remote_url is not None:
            from qbuild.store.s3 import S3Remote

            remote = S3Remote(remote_url)
            _transfer("download", lambda: pull(path, name, remote, progress), remote, log)
        yield path
        _touch(path)
        if remote is not None and push:
            _transfer("upload", lambda: push_group(path, name, remote, progress), remote, log)


def _transfer(verb: str, move: Callable[[], int], remote, log: Callable[[str], None]) -> None:
    try:
        n = move()
    except InfraError as e:
        log(f"compile cache: could not {verb} entries ({e}); compiling without them")
        return
    if n:
        log(f"compile cache: {verb}ed {n} entries {'from' if verb == 'download' else 'to'} {remote.url}")


def index_key(remote, name: str) -> str:
    return remote.object_key(CACHE_DIR, f"{name}.json")


def read_index(remote, key: str) -> dict[str, dict]:
    """{entry: {file: {digest, size}}} of an index object (empty where there is none); a malformed one is an
    InfraError naming it."""
    data = remote.get_object(key)
    if data is None:
        return {}
    try:
        doc = json.loads(data)
        found = doc["entries"]
        for entry, files in found.items():
            if not _ENTRY.match(entry) or not all(isinstance(m["digest"], str) and isinstance(m["size"], int)
                                                  for m in files.values()):
                raise ValueError(entry)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise InfraError(f"{remote.object_url(key)}: unreadable compile cache index ({type(e).__name__}); delete "
                         "it or run `qbuild gc --remote`") from None
    return found


def pull(group: Path, name: str, remote, progress=None) -> int:
    """Lay out in `group` the entries the remote's index names that are not complete here, each file checked against
    its digest, each entry renamed into place whole; the bytes are reported to `progress`. Returns how many."""
    from qbuild.core.threads import map_all
    from qbuild.store.s3 import TRANSFER_THREADS

    wanted = {e: files for e, files in read_index(remote, index_key(remote, name)).items()
              if not ((group / e).is_dir() and state(group / e) == "complete")}
    if not wanted:
        return 0
    stage = group / f".pull-{uuid.uuid4().hex[:12]}"
    try:
        jobs = [(entry, rel, meta) for entry, files in sorted(wanted.items()) for rel, meta in sorted(files.items())]

        def one(job) -> None:
            entry, rel, meta = job
            dest = safe_join(stage / entry, rel)
            dest.parent.mkdir(parents=True, exist_ok=True)
            remote.download_blob(meta["digest"], dest, None if progress is None else progress.advance)
            if dest.stat().st_size != meta["size"] or digest_file(dest) != meta["digest"]:
                raise InfraError(f"{remote.object_url(remote.blob_key(meta['digest']))}: does not match its digest; "
                                 f"refusing {entry}/{rel}")

        with _reported(progress, "compile cache download", len(jobs), sum(meta["size"] for *_, meta in jobs)):
            map_all(one, jobs, TRANSFER_THREADS)
        for entry in sorted(wanted):
            target = group / entry
            if target.exists():
                shutil.rmtree(target)        # incomplete (complete ones were not wanted); the lock is ours
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(stage / entry, target)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return len(wanted)


def push_group(group: Path, name: str, remote, progress=None) -> int:
    """Upload the complete entries of `group` that the remote's index lacks: their files first (those the remote's
    CAS lacks), then the index with them added; the bytes are reported to `progress`. Returns how many entries went
    up."""
    from qbuild.core.threads import map_all
    from qbuild.store.s3 import TRANSFER_THREADS

    key = index_key(remote, name)
    known = read_index(remote, key)
    new: dict[str, dict] = {}
    paths: dict[str, Path] = {}
    for entry in entries(group):
        rel = entry.relative_to(group).as_posix()
        if rel in known or state(entry) != "complete":
            continue
        files = {}
        for f in sorted(p for p in entry.rglob("*") if p.is_file() and not p.is_symlink() and not
                        p.name.endswith(".lock")):
            digest = digest_file(f)
            files[f.relative_to(entry).as_posix()] = {"digest": digest, "size": f.stat().st_size}
            paths[digest] = f
        new[rel] = files
    if not new:
        return 0
    have = remote.has_blobs(paths)
    send = sorted(set(paths) - have)
    with _reported(progress, "compile cache upload", len(send), sum(paths[d].stat().st_size for d in send)):
        map_all(lambda d: remote.upload_blob(paths[d], d, None if progress is None else progress.advance), send,
                TRANSFER_THREADS)
    # Read again just before writing: another host may have added entries since. Two hosts writing at once can
    # still lose one's additions, which costs a later compile those NEFFs, never a wrong one.
    merged = {**read_index(remote, key), **new}
    remote.put_object(key, json.dumps({"version": INDEX_VERSION, "entries": merged}, sort_keys=True).encode())
    return len(new)


@contextmanager
def _reported(progress, verb: str, files: int, total_bytes: int) -> Iterator[None]:
    """One batch of transfers, as `progress` (qbuild.store.remote.Progress, or None) hears of it."""
    if progress is None:
        yield
        return
    progress.begin(verb, files, total_bytes)
    try:
        yield
    finally:
        progress.end()


# --- store verify ----------------------------------------------------------------------------------------------------

def verify(store, repair: bool = False) -> list[str]:
    """One line per entry of the store's compile cache that is not complete (and per killed download); with `repair`
    they are removed. A group a compile holds is skipped: its entries are being written."""
    problems = []
    for g in groups(store.root):
        try:
            with store.lock(lock_key(g.name), timeout=0):
                for entry in entries(g.path):
                    what = state(entry)
                    if what != "complete":
                        why = ("a failed compile the compiler would reuse" if what == "failed"
                               else "incomplete: no model.neff and model.done")
                        problems.append(f"compile cache entry {g.name}/{entry.relative_to(g.path).as_posix()}: {why}")
                        if repair:
                            shutil.rmtree(entry, ignore_errors=True)
                for stray in sorted(g.path.glob(".pull-*")):
                    problems.append(f"compile cache {g.name}: orphaned download {stray.name}")
                    if repair:
                        shutil.rmtree(stray, ignore_errors=True)
        except TimeoutError:
            continue
    return problems


def remove_group(store, g: CacheGroup) -> bool:
    """Remove a whole group unless a compile holds it or used it since `g` was listed; returns whether it went."""
    try:
        with store.lock(lock_key(g.name), timeout=0):
            try:
                if os.stat(g.path).st_mtime != g.used:   # a compile marked it used meanwhile
                    return False
            except FileNotFoundError:
                return False
            discard_path(g.path)
            return True
    except TimeoutError:
        return False


def index_blobs(remote, key: str) -> set[str]:
    """The CAS blobs the index object at `key` names."""
    return {meta["digest"] for files in read_index(remote, key).values() for meta in files.values()}


@dataclass(frozen=True)
class NeuronCompileCache:
    """The compile cache as a side cache of the store (qbuild.store.side_cache.SideCache)."""

    name: str = CACHE_DIR

    def groups(self, store_root: Path) -> list[CacheGroup]:
        return groups(store_root)

    def remove_group(self, store, group: CacheGroup) -> bool:
        return remove_group(store, group)

    def index_blobs(self, remote, key: str) -> set[str]:
        return index_blobs(remote, key)

    def verify(self, store, repair: bool) -> list[str]:
        return verify(store, repair)


CACHE = NeuronCompileCache()
