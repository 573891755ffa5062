"""The store beside processes that change it: `store verify`, `gc` and builds interleaved at the exact points where
one of them looked at an entry and another changed it before it acted. Each interleaving is forced by a hook at that
point (a wrapped function), never by timing.

What must hold: an entry removed or replaced meanwhile is never reported as a problem; a removal takes only the very
file that was judged (a manifest or blob a build put back, or a blob a build claimed, stays); gc reads the leases of
running builds before the lockfiles, so a build that writes its lockfile and ends between the two is seen in one."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

import qbuild.store.gc as gcmod
import qbuild.store.local as localmod
from qbuild.cli import app
from qbuild.core.errors import UserError
from qbuild.core.hashing import digest_json
from qbuild import backends
from qbuild.backends.neuron import compile_cache
from qbuild.store.local import LocalStore
from qbuild.store.manifest import Manifest
from qbuild.core.files import atomic_write
from qbuild.planning.lock import referenced_keys
from qbuild.store.gc import gc_local
from qbuild.store.lease import Lease
from qbuild.store.local import CorruptBlobError

EMPTY_LOCK = {"version": 2, "recipes": {}, "nodes": {}}


def _entry(store: LocalStore, name: str, files: dict[str, bytes] | None = None) -> Manifest:
    """A committed entry whose outputs are `files` (default: one file of its own)."""
    src = store.root.parent / f"src-{name}"
    for rel, data in (files or {"out.bin": name.encode() * 64}).items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    preimage = {"entry": name}
    m = Manifest(key=digest_json(preimage), kind="compile", preimage=preimage, outputs=store.ingest_tree(src))
    shutil.rmtree(src)
    store.put_manifest(m)
    return m


def _blobs(store: LocalStore, m: Manifest) -> list[Path]:
    return [store.blob_path(o["digest"]) for o in m.outputs.values()]


def _remove_as_gc_does(store: LocalStore, m: Manifest) -> None:
    store.manifest_path(m.key).unlink()          # the manifest first, then its blobs
    for blob in _blobs(store, m):
        blob.unlink(missing_ok=True)


def _recommit(store: LocalStore, m: Manifest, data: dict[str, bytes]) -> None:
    """What a build of `m`'s key does when it finds the entry gone: its blobs (`data` by digest) put back, the
    manifest written anew."""
    src = store.root.parent / "rebuilt"
    src.mkdir(exist_ok=True)
    for digest, content in data.items():
        if not store.blob_path(digest).exists():
            (src / digest).write_bytes(content)
            store.put_file(src / digest, digest)
    atomic_write(store.manifest_path(m.key), m.to_bytes())


def _contents(store: LocalStore, m: Manifest) -> dict[str, bytes]:
    return {blob.name: blob.read_bytes() for blob in _blobs(store, m)}


def _after_listing(monkeypatch, directory: Path, act) -> None:
    """Run `act(listed paths)` right after the store lists `directory` (as another process would, between the
    listing and the checks)."""
    original = Path.glob
    fired = []

    def glob(self, pattern, *args, **kwargs):
        listed = list(original(self, pattern, *args, **kwargs))
        if self == directory and not fired:
            fired.append(True)
            act(listed)
        return iter(listed)

    monkeypatch.setattr(Path, "glob", glob)


# --- store verify --------------------------------------------------------------------------------------------------

def test_verify_skips_blobs_gc_removed_after_the_listing(tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "store")
    entries = [_entry(store, f"e{i}") for i in range(3)]
    _after_listing(monkeypatch, store.root / "cas", lambda listed: [_remove_as_gc_does(store, m) for m in entries])
    assert store.verify(repair=True) == []
    assert not list((store.root / "cas").glob("*/*")) and not list((store.root / "ac").glob("*/*"))


def test_verify_skips_manifests_gc_removed_after_the_listing(tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "store")
    entries = [_entry(store, f"e{i}") for i in range(3)]
    _after_listing(monkeypatch, store.root / "ac", lambda listed: [_remove_as_gc_does(store, m) for m in entries])
    assert store.verify(repair=True) == []


def test_verify_skips_a_manifest_gc_removed_with_its_blobs_after_it_was_read(tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "store")
    entry = _entry(store, "read-then-removed")
    original = Manifest.from_json.__func__

    def from_json(cls, doc):
        m = original(cls, doc)
        if m.key == entry.key and store.manifest_path(m.key).exists():
            _remove_as_gc_does(store, m)
        return m

    monkeypatch.setattr(Manifest, "from_json", classmethod(from_json))
    assert store.verify(repair=True) == []


def test_verify_repair_keeps_a_blob_put_back_after_it_was_found_corrupt(tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "store")
    entry = _entry(store, "damaged")
    (blob,) = _blobs(store, entry)
    good = blob.read_bytes()
    blob.chmod(0o644)
    blob.write_bytes(b"x" + good[1:])   # the same size: a damaged byte
    original = localmod.digest_file

    def digest_file(path):
        got = original(path)
        if path == blob:   # hashed as corrupt; now a build puts the right bytes back (a new file at the name)
            fresh = tmp_path / "fresh"
            fresh.write_bytes(good)
            os.replace(fresh, blob)
        return got

    monkeypatch.setattr(localmod, "digest_file", digest_file)
    store.verify(repair=True)
    assert blob.read_bytes() == good
    monkeypatch.undo()
    assert store.verify() == []


def test_verify_repair_keeps_a_manifest_a_build_put_back_after_it_was_found_lost(tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "store")
    entry = _entry(store, "lost")
    (blob,) = _blobs(store, entry)
    data = _contents(store, entry)
    blob.unlink()
    original = LocalStore.has_blob

    def has_blob(self, digest):
        there = original(self, digest)
        if not there and digest == blob.name:   # found lost; a build of its key commits it again right now
            _recommit(store, entry, data)
        return there

    monkeypatch.setattr(LocalStore, "has_blob", has_blob)
    store.verify(repair=True)
    monkeypatch.undo()
    assert store.get_manifest(entry.key) == entry
    assert store.verify() == []


def test_materialize_names_a_blob_removed_meanwhile_missing_not_corrupt(tmp_path):
    store = LocalStore(tmp_path / "store")
    entry = _entry(store, "gone")
    (blob,) = _blobs(store, entry)
    blob.unlink()
    with pytest.raises(CorruptBlobError) as e:
        store.materialize(entry.outputs, tmp_path / "in", verify=True)
    assert e.value.missing and "missing from the store" in str(e.value) and "corrupt" not in str(e.value)


def test_materialize_removes_a_corrupt_blob_and_says_so(tmp_path):
    store = LocalStore(tmp_path / "store")
    entry = _entry(store, "flipped")
    (blob,) = _blobs(store, entry)
    blob.chmod(0o644)
    blob.write_bytes(b"?" + blob.read_bytes()[1:])
    with pytest.raises(CorruptBlobError) as e:
        store.materialize(entry.outputs, tmp_path / "in", verify=True)
    assert not e.value.missing and "was corrupt and has been removed" in str(e.value)
    assert not blob.exists()


def test_a_remote_hit_whose_blob_gc_removes_as_it_is_recorded_stays_pending_and_comes_down_again(tmp_path,
                                                                                                  monkeypatch):
    """A remote hit whose blobs are all local already is recorded in the local store as it is looked up. gc removing
    one of its blobs just before that write is LocalStore.put_manifest's refusal (missing), which leaves the entry to
    be recorded once its blobs are here, never an error of the lookup."""
    from qbuild.store.remote import RemoteStore, push_manifests
    from qbuild.store.s3 import S3Remote
    from tests.s3server import s3_env, shared_server

    server = shared_server()
    for k, v in s3_env(server.endpoint).items():
        monkeypatch.setenv(k, v)
    try:
        server.client().create_bucket(Bucket="qb-races")
    except server.client().exceptions.BucketAlreadyOwnedByYou:
        pass
    writer = LocalStore(tmp_path / "writer")
    entry = _entry(writer, "remote-hit")
    remote = S3Remote(f"s3://qb-races/{tmp_path.name}")
    push_manifests(writer, remote, [entry])
    local = LocalStore(tmp_path / "reader")
    for blob in _blobs(writer, entry):      # downloaded already (by a worker process), the manifest not written
        shutil.copyfile(blob, tmp_path / blob.name)
        local.put_file(tmp_path / blob.name, blob.name)
    put_manifest, fired = local.put_manifest, []

    def gc_first(manifest: Manifest) -> None:
        if not fired:
            fired.append(True)
            for blob in _blobs(local, manifest):
                blob.unlink()
        put_manifest(manifest)

    monkeypatch.setattr(local, "put_manifest", gc_first)
    reader = RemoteStore(local, remote)
    assert reader.get_manifest(entry.key) == entry and fired
    assert not local.manifest_path(entry.key).exists()
    reader.ensure_blobs(entry.outputs)
    assert local.get_manifest(entry.key) == entry


# --- gc --------------------------------------------------------------------------------------------------------------

def _gc(store: LocalStore, *locks: Path):
    return gc_local(store, lambda: referenced_keys(locks), keep_size=0, grace_s=0, caches=backends.side_caches())


def _after_listing_gc(monkeypatch, act) -> None:
    """Run `act()` when gc reads the leases: after it listed the store's entries."""
    original = gcmod.live_leases

    def live_leases(root, **kwargs):
        act()
        return original(root, **kwargs)

    monkeypatch.setattr(gcmod, "live_leases", live_leases)


def test_gc_keeps_a_manifest_a_build_put_back_after_gc_read_it(tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "store")
    entry = _entry(store, "rebuilt")
    _after_listing_gc(monkeypatch, lambda: atomic_write(store.manifest_path(entry.key), entry.to_bytes()))
    report = _gc(store)
    assert store.get_manifest(entry.key) == entry
    assert report.removed == [] and report.in_use == 1


def _clock_past(ns: int, where: Path) -> None:
    """Return once a file made now gets a ctime after `ns` (file times come from a clock that moves in ticks of a few
    milliseconds): a chmod after this gives a file a ctime of its own."""
    probe = where / ".clock-probe"
    while True:
        probe.write_bytes(b"")
        if os.lstat(probe).st_ctime_ns > ns:
            probe.unlink()
            return


def test_gc_keeps_a_blob_a_build_claimed_after_gc_listed_it(tmp_path, monkeypatch):
    """A build whose output equals a blob the store holds claims that blob instead of writing its own; if gc listed
    the blob before, its removal must see the claim."""
    store = LocalStore(tmp_path / "store")
    old = _entry(store, "old", {"shared.bin": b"same bytes" * 100})
    (blob,) = _blobs(store, old)

    def build_claims() -> None:
        _clock_past(os.lstat(blob).st_ctime_ns, tmp_path)
        out = tmp_path / "output.bin"
        out.write_bytes(b"same bytes" * 100)
        assert store.put_file(out) == blob.name and not out.exists()   # deduplicated: claimed

    _after_listing_gc(monkeypatch, build_claims)
    report = _gc(store)
    assert [r.what for r in report.removed] == ["manifest"]   # the old entry goes, the blob a build uses stays
    assert blob.is_file()


def test_gc_never_lists_what_a_build_started_after_the_listing_writes(tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "store")
    made = []
    _after_listing_gc(monkeypatch, lambda: made.append(_entry(store, "newcomer")))
    _gc(store)
    assert store.get_manifest(made[0].key) == made[0]


def test_gc_keeps_a_compile_cache_group_a_compile_used_after_gc_listed_it(tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "store")
    group = store.root / compile_cache.CACHE_DIR / compile_cache.group_name("2.26.6360.0", "trn2", "text-0")
    (group / "neuronxcc-2.26.6360.0" / "MODULE_a").mkdir(parents=True)
    for name in ("model.neff", "model.done"):
        (group / "neuronxcc-2.26.6360.0" / "MODULE_a" / name).write_bytes(b"neff")
    os.utime(group, (time.time() - 7200,) * 2)

    def compile_uses_it() -> None:   # what compile_cache.using does around a compile, under the group's lock
        with compile_cache.using(store, None, False, "2.26.6360.0", "trn2", "text-0", lambda line: None):
            pass

    _after_listing_gc(monkeypatch, compile_uses_it)
    report = _gc(store)
    assert report.removed == [] and group.is_dir()


@pytest.mark.parametrize("ends", ["before gc reads the leases", "after gc read the leases"])
def test_gc_sees_a_build_that_writes_its_lockfile_and_ends_around_the_lease_read(tmp_path, monkeypatch, ends):
    """`qbuild gc`, run in this process: the build's entry is protected by its lease while it runs and by its lockfile
    once it wrote it, and the lockfile is written before the lease is released. gc reads the lockfiles after the
    leases, so whichever side of the lease read the build ends on, one of them keeps the entry."""
    store = LocalStore(tmp_path / "store")
    lock = tmp_path / "artifacts.lock"
    lock.write_text(json.dumps(EMPTY_LOCK))
    lease = Lease(store.root)
    built = _entry(store, "built")
    lease.add(built.key)

    def build_ends() -> None:
        node = {"kind": built.kind, "name": built.kind, "key": built.key, "preimage": built.preimage,
                "digest": built.digest, "outputs": built.outputs}   # as a build writes it (qbuild.planning.lock.NodeEntry)
        doc = {"version": 1, "recipes": {}, "nodes": {"n": node}}
        atomic_write(lock, json.dumps(doc).encode())
        lease.close()

    original = gcmod.live_leases

    def live_leases(root, **kwargs):
        if ends.startswith("before"):
            build_ends()
        read = original(root, **kwargs)
        if ends.startswith("after"):
            build_ends()
        return read

    monkeypatch.setattr(gcmod, "live_leases", live_leases)
    code = app(["gc", "--keep-size", "0", "--grace", "0", "--lock", str(lock), "--store", str(store.root), "--json"],
               standalone_mode=False)
    assert code in (None, 0)
    assert store.get_manifest(built.key) == built


def test_gc_refuses_a_lockfile_that_vanished_before_it_was_read(tmp_path):
    store = LocalStore(tmp_path / "store")
    entry = _entry(store, "kept")
    with pytest.raises(UserError) as e:
        _gc(store, tmp_path / "gone.lock")
    assert "no such lockfile" in str(e.value)
    assert store.get_manifest(entry.key) == entry


def _partial_write(store: LocalStore, m: Manifest, age_s: float) -> Path:
    """What a manifest write killed between its write and its rename leaves beside the entry (store.files.staged)."""
    path = store.manifest_path(m.key)
    partial = path.parent / f".{path.name}.partial-0123456789ab"
    partial.write_bytes(m.to_bytes()[:40])
    when = time.time() - age_s
    os.utime(partial, (when, when))
    return partial


def test_verify_and_gc_remove_abandoned_partial_writes_and_leave_live_ones(tmp_path):
    """A manifest write killed before its rename leaves a `.partial-` file that no entry names: verify reports it and
    --repair removes it; gc removes it as well; one younger than the age a live write can reach stays."""
    store = LocalStore(tmp_path / "store")
    m = _entry(store, "a")
    old, young = _partial_write(store, m, 2 * localmod.ABANDONED_WRITE_S), _partial_write(store, _entry(store, "b"), 1)
    assert store.verify() == [f"abandoned partial write {old}"]
    assert old.exists()
    assert store.verify(repair=True) == [f"abandoned partial write {old}"]
    assert not old.exists() and young.exists() and store.verify() == []
    assert store.get_manifest(m.key) == m

    again = _partial_write(store, m, 2 * gcmod.GRACE_S)
    lock = tmp_path / "artifacts.lock"
    lock.write_text(json.dumps(EMPTY_LOCK))
    dry = gc_local(store, lambda: referenced_keys([lock]), keep_size=1 << 40, dry_run=True)
    assert [(r.what, r.name) for r in dry.removed] == [("partial", again.name)] and again.exists()
    with store.lock(m.key):   # a build holding the key is still writing it, however old its file
        assert gc_local(store, lambda: referenced_keys([lock]), keep_size=1 << 40).removed == [] and again.exists()
    # A partial write's age is its own, not the grace: with none, the live one (a second old) stays all the same.
    report = gc_local(store, lambda: referenced_keys([lock]), keep_size=1 << 40, grace_s=0)
    assert [(r.what, r.name) for r in report.removed] == [("partial", again.name)]
    assert not again.exists() and young.exists() and store.get_manifest(m.key) == m
