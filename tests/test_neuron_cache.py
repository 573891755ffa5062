"""The Neuron compile cache is the store's (qbuild.backends.neuron.compile_cache, a side cache the backend registers): one folder per toolchain, target and work
directory, in the SDK's own entry layout; `store verify` checks every entry and --repair drops broken ones; `gc` trims
groups by last use within --keep-size; with a remote, entries travel as blobs plus one index object per group."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from qbuild.backends.neuron.releases import RELEASES
from qbuild.core.errors import InfraError
from qbuild.core.hashing import digest_file
from qbuild import backends
from qbuild.backends.neuron import compile_cache
from qbuild.store.local import LocalStore
from qbuild.store.gc import gc_local as _gc_local, gc_remote as _gc_remote
from tests.conftest import qbuild
from tests.nxdi_double import MAIN_PORT, read_log
from tests.s3server import s3_env, shared_server
from tests.test_neuron_double import TOOLCHAIN, Build, compiled, write_recipe


def gc_local(store, referenced, **options):
    """gc as `qbuild gc` runs it: with the side caches the backends register (the neuron backend's compile cache)."""
    return _gc_local(store, referenced, caches=backends.side_caches(), **options)


def gc_remote(remote, referenced, **options):
    return _gc_remote(remote, referenced, caches=backends.side_caches(), **options)


BUCKET = "qb-ncc"
SDK_DIR = "neuronxcc-2.26.6360.0+6f180f47"


def _entry(group: Path, name: str, files: dict[str, bytes]) -> Path:
    entry = group / SDK_DIR / f"MODULE_{name}+0badf00d"
    entry.mkdir(parents=True)
    for rel, data in files.items():
        (entry / rel).write_bytes(data)
    return entry


def _complete(group: Path, name: str, size: int = 100) -> Path:
    return _entry(group, name, {"model.hlo_module.pb": f"hlo {name}".encode(), "compile_flags.json": b"[]",
                                "model.neff": name.encode() * (size // len(name)), "model.done": b""})


def _group(store: LocalStore, name: str, used: float | None = None) -> Path:
    path = store.root / compile_cache.CACHE_DIR / compile_cache.group_name("2.26.6360.0", "trn2", name)
    path.mkdir(parents=True)
    return path


def _age(path: Path, used: float) -> None:
    os.utime(path, (used, used))


def test_entries_are_classified_and_store_verify_reports_and_repairs_the_broken(tmp_path):
    store = LocalStore(tmp_path / "store")
    group = _group(store, "text-0123456789abcdef")
    good = _complete(group, "good")
    failed = _entry(group, "failed", {"model.hlo_module.pb": b"hlo", "model.log": b"error"})
    cut = _entry(group, "cut", {"model.hlo_module.pb": b"hlo", "model.neff": b"half"})
    (group / ".pull-0123").mkdir()
    assert [compile_cache.state(e) for e in (good, failed, cut)] == ["complete", "failed", "incomplete"]

    problems = store.verify() + compile_cache.verify(store)
    assert len(problems) == 3, problems
    assert any("MODULE_failed" in p and "failed compile" in p for p in problems)
    assert any("MODULE_cut" in p and "incomplete" in p for p in problems)
    assert any(".pull-0123" in p for p in problems) and not any("MODULE_good" in p for p in problems)
    # A group a compile holds is left alone: its entries are being written.
    name = group.relative_to(store.root / compile_cache.CACHE_DIR).as_posix()
    with store.lock(compile_cache.lock_key(name)):
        assert compile_cache.verify(store, repair=True) == []
    assert failed.is_dir()
    # Through the CLI: exit 1 naming each; --repair removes them and keeps the complete entry.
    proc = qbuild("store", "verify", "--store", str(store.root))
    assert proc.returncode == 1 and proc.stderr.count("compile cache") == 3, proc.stderr
    proc = qbuild("store", "verify", "--repair", "--store", str(store.root))
    assert proc.returncode == 0, proc.stderr
    assert compile_cache.entries(group) == [good] and not (group / ".pull-0123").exists()
    assert qbuild("store", "verify", "--store", str(store.root)).returncode == 0


def test_gc_trims_whole_groups_by_last_use_within_the_budget(tmp_path):
    store = LocalStore(tmp_path / "store")
    now = time.time()
    groups = {}
    for name, age in (("old", 7000), ("mid", 5000), ("new", 100)):
        groups[name] = _group(store, f"text-{name}")
        _complete(groups[name], "a", 1000)
        _age(groups[name], now - age)
    size = compile_cache.groups(store.root)[0].size

    report = gc_local(store, set, keep_size=size + size // 2, grace_s=60)
    assert {(r.what, r.name) for r in report.removed} == {("cache", "2.26.6360.0/trn2/text-old"),
                                                           ("cache", "2.26.6360.0/trn2/text-mid")}
    assert report.bytes_freed == 2 * size and report.kept_cache == 1
    assert [g.name for g in compile_cache.groups(store.root)] == ["2.26.6360.0/trn2/text-new"]

    # Within the grace period, or held by a compile, a group stays whatever the budget.
    assert gc_local(store, set, keep_size=0, grace_s=3600).removed == []
    (held,) = compile_cache.groups(store.root)
    with store.lock(compile_cache.lock_key(held.name)):
        report = gc_local(store, set, keep_size=0, grace_s=0)
    assert report.removed == [] and report.kept_cache == 1
    assert gc_local(store, set, keep_size=0, grace_s=0, dry_run=True).removed[0].name == held.name
    assert held.path.is_dir()
    assert [r.name for r in gc_local(store, set, keep_size=0, grace_s=0).removed] == [held.name]
    assert compile_cache.groups(store.root) == []


@pytest.fixture
def remote(monkeypatch):
    server = shared_server()
    server.client().create_bucket(Bucket=BUCKET)
    for k, v in s3_env(server.endpoint).items():
        monkeypatch.setenv(k, v)
    from qbuild.store.s3 import S3Remote

    return S3Remote(f"s3://{BUCKET}/{os.urandom(4).hex()}")


class _Transfers:
    """What a store's transfers report (qbuild.store.remote.Progress), batch by batch: (verb, files, total bytes,
    bytes advanced)."""

    def __init__(self):
        self.batches: list[tuple[str, int, int, int]] = []

    def begin(self, verb: str, files: int, total_bytes: int) -> None:
        self.batches.append((verb, files, total_bytes, 0))

    def advance(self, nbytes: int) -> None:
        verb, files, total, done = self.batches[-1]
        self.batches[-1] = (verb, files, total, done + nbytes)

    def file_done(self, name: str) -> None:
        pass

    def end(self) -> None:
        pass


def test_groups_travel_as_blobs_and_an_index_and_gc_remote_trims_them(tmp_path, remote):
    """push uploads the complete entries (never a failed one) as blobs plus the group's index, once; pull lays them
    out byte for byte in another store, and refuses a blob whose bytes changed; gc --remote keeps an index within the
    budget or the grace period, and otherwise removes it and the blobs only it named."""
    here = LocalStore(tmp_path / "here")
    group = _group(here, "text-shared")
    entries = [_complete(group, "one"), _complete(group, "two", 300)]
    _entry(group, "failed", {"model.log": b"error"})
    name = "2.26.6360.0/trn2/text-shared"
    up = _Transfers()
    assert compile_cache.push_group(group, name, remote, up) == 2
    files = [f for e in entries for f in e.iterdir()]
    blobs = {digest_file(f): f.stat().st_size for f in files}     # files of equal bytes go up once
    assert up.batches == [("compile cache upload", len(blobs), sum(blobs.values()), sum(blobs.values()))]
    assert compile_cache.push_group(group, name, remote) == 0
    index = compile_cache.read_index(remote, compile_cache.index_key(remote, name))
    assert sorted(index) == sorted(e.relative_to(group).as_posix() for e in entries)
    assert index[f"{SDK_DIR}/MODULE_one+0badf00d"]["model.neff"] == {
        "digest": digest_file(entries[0] / "model.neff"), "size": 99}

    there = LocalStore(tmp_path / "there")
    target = _group(there, "text-shared")
    down = _Transfers()
    assert compile_cache.pull(target, name, remote, down) == 2
    complete = sum(f.stat().st_size for f in files)
    assert down.batches == [("compile cache download", len(files), complete, complete)]
    for e in entries:
        copy = target / e.relative_to(group)
        assert {p.name: p.read_bytes() for p in copy.iterdir()} == {p.name: p.read_bytes() for p in e.iterdir()}
    assert compile_cache.pull(target, name, remote) == 0          # complete here: nothing to fetch

    # A blob changed on the remote is refused, and nothing of its entry is laid out.
    neff = index[f"{SDK_DIR}/MODULE_two+0badf00d"]["model.neff"]["digest"]
    remote.client.put_object(Bucket=remote.bucket, Key=remote.blob_key(neff), Body=b"x" * 297)
    elsewhere = _group(LocalStore(tmp_path / "elsewhere"), "text-shared")
    with pytest.raises(InfraError, match="does not match its digest"):
        compile_cache.pull(elsewhere, name, remote)
    assert compile_cache.entries(elsewhere) == [] and not list(elsewhere.glob(".pull-*"))

    blobs = {m["digest"] for files in index.values() for m in files.values()}
    kept = gc_remote(remote, set, keep_size=1 << 30, grace_s=0)
    assert kept.removed == [] and kept.kept_cache == 1
    young = gc_remote(remote, set, keep_size=0, grace_s=3600)
    assert young.removed == [] and young.kept_cache == 1
    report = gc_remote(remote, set, keep_size=0, grace_s=0)
    assert {(r.what, r.name) for r in report.removed} == {("cache", name)} | {("blob", d) for d in blobs}
    assert remote.get_object(compile_cache.index_key(remote, name)) is None
    assert remote.has_blobs(blobs) == set()


def _cache_bytes(stderr: str, what: str) -> None:
    """A text compile's `--progress json` events counted the compile cache's transfer (`what`) up to its total."""
    reports = [e for e in map(json.loads, stderr.splitlines()) if e["event"] == "progress" and e["what"] == what]
    assert reports and reports[-1]["done"] == reports[-1]["total"] > 0, stderr
    assert {(e["step"], e["unit"]) for e in reports} == {("compile", "B")}
    assert all(e["node"].startswith("compile text") for e in reports)


@pytest.mark.slow
def test_compiles_share_neffs_through_the_remote_and_the_store_drops_cached_failures(tmp_path, small_checkpoints,
                                                                                     monkeypatch):
    """Host A compiles and pushes; host B (another store, the same work directory path) adds a token-generation
    bucket and compiles only that NEFF, the others coming from the remote's cache. A failure the compiler cached in
    A's store is reported by `store verify` and dropped by the next compile, which compiles that NEFF again instead of
    failing on it; `gc` then trims the cache here and on the remote."""
    server = shared_server()
    server.client().create_bucket(Bucket=BUCKET)
    url = f"s3://{BUCKET}/share"
    s3 = {k: v for k, v in s3_env(server.endpoint).items() if k.startswith(("AWS_", "QBUILD_S3_"))}
    a, b = Build(tmp_path / "a"), Build(tmp_path / "b")
    checkpoint = small_checkpoints["qwen3_5"]
    recipe = write_recipe(a.root / "recipes" / "dense.yaml", checkpoint, MAIN_PORT)
    result, stderr = a.compile(recipe, "--remote", url, "--push", "--progress", "json", **s3)
    compiled(result, stderr)
    _cache_bytes(stderr, "compile cache upload")
    pin = RELEASES[TOOLCHAIN["sdk"]]["neuronx-cc"]
    (group,) = [g for g in compile_cache.groups(a.store) if g.name.startswith(f"{pin}/trn2/")]
    layout = {p.relative_to(e).as_posix() for e in compile_cache.entries(group.path) for p in e.iterdir()}
    assert layout == {"model.hlo_module.pb", "compile_flags.json", "model.neff", "model.done"}
    keys = [o["Key"] for o in server.client().list_objects_v2(Bucket=BUCKET, Prefix="share/neuron-compile-cache/")
            ["Contents"]]
    assert keys == [f"share/neuron-compile-cache/{group.name}.json"]

    more = write_recipe(b.root / "recipes" / "dense.yaml", checkpoint, MAIN_PORT, text={"tkg_buckets": [64, 128]})
    log = b.root / "b.jsonl"
    result, stderr = b.compile(more, "--remote", url, "--progress", "json", log=log, QBUILD_NEURON_WORKDIR=str(a.work),
                               **s3)
    compiled(result, stderr)
    _cache_bytes(stderr, "compile cache download")
    (call,) = [c for c in read_log(log) if c["call"] == "compile"]
    assert [(n["tag"], n["bucket"]) for n in call["neffs"] if not n["hit"]] == [("token_generation_model", 128)]
    assert len(call["neffs"]) == 4

    # A's store: one entry becomes a failure the compiler would reuse.
    first = compile_cache.entries(group.path)[0]
    for f in ("model.neff", "model.done"):
        (first / f).unlink()
    (first / "model.log").write_text("ERROR: compilation was interrupted\n")
    proc = qbuild("store", "verify", "--store", str(a.store))
    assert proc.returncode == 1 and "failed compile" in proc.stderr and first.name in proc.stderr
    log = a.root / "again.jsonl"
    result, stderr = a.compile(write_recipe(a.root / "recipes" / "dense.yaml", checkpoint, MAIN_PORT,
                                            text={"tkg_buckets": [64, 128]}), log=log)
    compiled(result, stderr)
    (call,) = [c for c in read_log(log) if c["call"] == "compile"]
    assert sorted(Path(n["cache_entry"]).name for n in call["neffs"] if not n["hit"]) == \
        sorted([first.name, next(Path(n["cache_entry"]).name for n in call["neffs"] if n["bucket"] == 128)])
    assert qbuild("store", "verify", "--store", str(a.store)).returncode == 0

    report = json.loads(a.cli("gc", "--keep-size", "0", "--grace", "0", "--remote", url, "--json",
                              **s3).stdout)
    local, far = report
    assert {r["name"] for r in local["removed"] if r["what"] == "cache"} == {group.name}
    assert {r["name"] for r in far["removed"] if r["what"] == "cache"} == {group.name}
    assert compile_cache.groups(a.store) == []
