"""fetch: snapshots from a real HF cache layout (offline) and from local directories, with stat-cached hashing."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from qbuild.planning.step import Context, LockedFiles, Source
from qbuild.recipe.params import FetchParams, parse
from qbuild.steps.fetch import Fetch
from qbuild.core.errors import InfraError, UserError
from qbuild.core.hashing import StatCache, digest_file
from qbuild.hub.hf import hf_cached_snapshot
from qbuild.hub.snapshot import checkpoint_files

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def populate_hf_cache(hub: Path, repo: str, checkpoint: Path, commit: str = COMMIT) -> Path:
    """Lay `checkpoint` out as huggingface_hub's cache does: blobs named by digest, snapshot symlinks, refs."""
    repo_dir = hub / ("models--" + repo.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    for f in checkpoint.iterdir():
        data = f.read_bytes()
        if f.suffix == ".safetensors":
            name = hashlib.sha256(data).hexdigest()  # LFS files: the blob is named by its sha256
        else:
            name = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git blob sha1
        (repo_dir / "blobs").mkdir(exist_ok=True)
        (repo_dir / "blobs" / name).write_bytes(data)
        (snap / f.name).symlink_to(Path("../../blobs") / name)
    return snap


fetch_run = Fetch.run


def _ctx(tmp: Path, params: dict, source: dict) -> Context:
    """The fetch step's context, its params typed from the JSON the planner's would have, its source from `source`
    (path, requested_revision, locked_files as {lock, files})."""
    out = tmp / "out"
    out.mkdir()
    locked = source.get("locked_files")
    source = Source(source.get("path"), source.get("requested_revision"),
                    None if locked is None else LockedFiles(locked["lock"], locked["files"]))
    return Context(params=parse(FetchParams, params), inputs={}, out=out, scratch=tmp, source=source,
                   log=lambda m: None)


def test_hf_cache_offline_uses_hub_digests(tmp_path, tiny_checkpoints, monkeypatch):
    hub = tmp_path / "hf-home" / "hub"
    snap = populate_hf_cache(hub, "tiny-org/tiny-next", tiny_checkpoints["qwen3_next"])
    assert hf_cached_snapshot("tiny-org/tiny-next", COMMIT) == snap
    assert hf_cached_snapshot("tiny-org/tiny-next", "main") is None     # a branch's ref never answers
    ctx = _ctx(tmp_path, {"source": "hf", "repo": "tiny-org/tiny-next", "revision": COMMIT},
               {"requested_revision": "main"})
    fetch_run(ctx)
    snap = json.loads((ctx.out / "snapshot.json").read_text())
    assert snap["revision"] == COMMIT and snap["repo"] == "tiny-org/tiny-next"
    shard = next(n for n in snap["files"] if n.endswith(".safetensors"))
    expected = hashlib.sha256((tiny_checkpoints["qwen3_next"] / shard).read_bytes()).hexdigest()
    assert snap["files"][shard]["digest"] == f"sha256:{expected}"
    assert snap["files"]["config.json"]["digest"].startswith("git-sha1:")


def test_hf_missing_offline_is_one_clear_error(tmp_path):
    ctx = _ctx(tmp_path, {"source": "hf", "repo": "tiny-org/absent", "revision": COMMIT}, {})
    with pytest.raises(InfraError) as e:
        fetch_run(ctx)
    assert str(e.value) == (f"model.hf: tiny-org/absent@{COMMIT[:12]} is not in the HF cache and the Hub cannot be "
                            "reached (HF_HUB_OFFLINE or no network)")


def test_a_fetch_keyed_on_a_branch_is_refused(tmp_path, tiny_checkpoints):
    """The planner keys a hub fetch on a commit only; a branch in a key would name whatever the branch holds later."""
    populate_hf_cache(tmp_path / "hf-home" / "hub", "tiny-org/tiny-next", tiny_checkpoints["qwen3_next"])
    ctx = _ctx(tmp_path, {"source": "hf", "repo": "tiny-org/tiny-next", "revision": "main"}, {})
    with pytest.raises(UserError, match="^model.hf: tiny-org/tiny-next@main is not a commit"):
        fetch_run(ctx)


def test_hf_token_never_reaches_the_snapshot(tmp_path, tiny_checkpoints, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_supersecrettoken123")
    hub = tmp_path / "hf-home" / "hub"
    populate_hf_cache(hub, "tiny-org/tok", tiny_checkpoints["qwen3_next"])
    ctx = _ctx(tmp_path, {"source": "hf", "repo": "tiny-org/tok", "revision": COMMIT}, {})
    fetch_run(ctx)
    assert "supersecret" not in (ctx.out / "snapshot.json").read_text()


def test_local_dir_snapshot_and_change_detection(tmp_path, tiny_checkpoints):
    import shutil

    src = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints["qwen3_5"], src)
    cache = StatCache(tmp_path / "stat.sqlite")
    files = {p.name: "blake3:" + cache.digest(p) for p in checkpoint_files(src)}
    ctx = _ctx(tmp_path, {"source": "path", "files": files}, {"path": str(src)})
    fetch_run(ctx)
    snap = json.loads((ctx.out / "snapshot.json").read_text())
    assert {n: m["digest"] for n, m in snap["files"].items()} == files
    assert "path" not in json.dumps(snap["files"])  # no machine-specific location in the content
    # A file edited after planning is refused rather than silently used.
    target = src / "config.json"
    target.write_text(target.read_text().replace("64", "65", 1))
    (tmp_path / "again").mkdir()
    ctx2 = _ctx(tmp_path / "again", {"source": "path", "files": files}, {"path": str(src)})
    with pytest.raises(UserError, match="config.json"):
        fetch_run(ctx2)


def test_pickled_weights_are_never_part_of_a_snapshot(tmp_path, tiny_checkpoints):
    import shutil

    src = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints["qwen3_next"], src)
    (src / "pytorch_model.bin").write_bytes(b"not loaded")
    assert "pytorch_model.bin" not in {p.name for p in checkpoint_files(src)}


def test_stat_cache_hashes_an_unchanged_file_once(tmp_path):
    f = tmp_path / "big.bin"
    f.write_bytes(os.urandom(1 << 20))
    hour_ago = time.time_ns() - 3600 * 10**9
    os.utime(f, ns=(hour_ago, hour_ago))   # older than the racy window, so the cache may answer for it
    calls = []

    def counted(p):
        calls.append(p)
        return digest_file(p)

    cache = StatCache(tmp_path / "stat.sqlite", hash_file=counted)
    first = cache.digest(f)
    second = StatCache(tmp_path / "stat.sqlite", hash_file=counted).digest(f)   # as a new process opens it afresh
    assert first == second == digest_file(f) and len(calls) == 1
    f.write_bytes(os.urandom(1 << 20))
    assert cache.digest(f) != first and len(calls) == 2
    # A file just modified is hashed every time (its timestamp may not have ticked since a rewrite).
    assert cache.digest(f) == digest_file(f) and len(calls) == 3


# --- the bytes of the HF cache are checked against the digests they are named by -------------------------------------

def _flip_last_byte(path: Path) -> None:
    """Invert the last byte of `path` in place (a safetensors file's tensor data, so its header still parses), keeping
    its size and timestamps, as a disk that rots does."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _shard(snap: Path) -> Path:
    return next(p for p in sorted(snap.iterdir()) if p.name.endswith(".safetensors"))


@pytest.mark.parametrize("which", ["safetensors", "config.json"])
def test_a_flipped_byte_in_an_hf_cache_blob_is_refused_naming_the_file(tmp_path, tiny_checkpoints, which):
    snap = populate_hf_cache(tmp_path / "hf-home" / "hub", "tiny-org/tiny-next", tiny_checkpoints["qwen3_next"])
    path = _shard(snap) if which == "safetensors" else snap / which
    blob = Path(os.path.realpath(path))
    _flip_last_byte(blob)
    ctx = _ctx(tmp_path, {"source": "hf", "repo": "tiny-org/tiny-next", "revision": COMMIT}, {})
    with pytest.raises(InfraError) as e:
        fetch_run(ctx)
    algo = "sha256" if which == "safetensors" else "git-sha1"
    assert str(e.value).startswith(f"{path}: its bytes hash to {algo} ") and \
        f"not the {blob.name[:12]} the Hub named them by" in str(e.value) and f"remove {blob} and run" in str(e.value)
    assert "\n" not in str(e.value) and list(ctx.out.iterdir()) == []


def test_locate_checks_the_bytes_a_step_reads_against_the_snapshot(tmp_path, tiny_checkpoints):
    """A fetch recorded long ago (or on another machine) does not vouch for the HF cache's bytes now."""
    from qbuild.hub.snapshot import locate, read_snapshot

    snap = populate_hf_cache(tmp_path / "hf-home" / "hub", "tiny-org/tiny-next", tiny_checkpoints["qwen3_next"])
    ctx = _ctx(tmp_path, {"source": "hf", "repo": "tiny-org/tiny-next", "revision": COMMIT}, {})
    fetch_run(ctx)
    snapshot = read_snapshot(ctx.out)
    assert set(locate(snapshot, {})) == set(snapshot["files"])
    shard = _shard(snap)
    _flip_last_byte(Path(os.path.realpath(shard)))
    with pytest.raises(InfraError) as e:
        locate(snapshot, {})
    assert str(e.value).startswith(f"{shard}: its bytes hash to sha256 ") and \
        f"`hf download tiny-org/tiny-next {shard.name} --revision {COMMIT}`" in str(e.value)


def test_hub_files_are_hashed_once_while_unchanged(tmp_path, tiny_checkpoints, monkeypatch):
    """The fetch step and every step reading the snapshot check the same bytes; the stat cache answers after the first
    hash of each file (files older than the racy window, as an HF cache's blobs are once downloaded)."""
    import qbuild.core.hashing as hashing
    from qbuild.hub.snapshot import locate, read_snapshot

    snap = populate_hf_cache(tmp_path / "hf-home" / "hub", "tiny-org/tiny-next", tiny_checkpoints["qwen3_next"])
    hour_ago = time.time_ns() - 3600 * 10**9
    for blob in (snap.parent.parent / "blobs").iterdir():
        os.utime(blob, ns=(hour_ago, hour_ago))
    hashed: list[str] = []
    for algo in ("sha256", "git-sha1"):
        function, table = hashing.FILE_DIGESTS[algo]
        monkeypatch.setitem(hashing.FILE_DIGESTS, algo,
                            ((lambda p, f=function: hashed.append(Path(p).name) or f(p)), table))
    ctx = _ctx(tmp_path, {"source": "hf", "repo": "tiny-org/tiny-next", "revision": COMMIT}, {})
    fetch_run(ctx)
    snapshot = read_snapshot(ctx.out)
    assert sorted(hashed) == sorted(snapshot["files"])
    locate(snapshot, {})
    (tmp_path / "again").mkdir()
    fetch_run(_ctx(tmp_path / "again", {"source": "hf", "repo": "tiny-org/tiny-next", "revision": COMMIT}, {}))
    assert sorted(hashed) == sorted(snapshot["files"])


def test_a_snapshot_of_other_files_than_the_lock_holds_for_the_commit_is_refused(tmp_path, tiny_checkpoints):
    """The workspace passes the lock's files of the pinned commit; a snapshot of that commit with other bytes (each
    honestly named by its own digest, as a mirror holding other content serves them) is refused, naming the file."""
    populate_hf_cache(tmp_path / "hf-home" / "hub", "tiny-org/tiny-next", tiny_checkpoints["qwen3_next"])
    params = {"source": "hf", "repo": "tiny-org/tiny-next", "revision": COMMIT}
    ctx = _ctx(tmp_path, params, {})
    fetch_run(ctx)
    files = {n: m["digest"] for n, m in json.loads((ctx.out / "snapshot.json").read_text())["files"].items()}
    (tmp_path / "same").mkdir()
    fetch_run(_ctx(tmp_path / "same", params, {"locked_files": {"lock": "artifacts.lock", "files": files}}))
    other = dict(files, **{"config.json": "git-sha1:" + "0" * 40})
    (tmp_path / "other").mkdir()
    ctx = _ctx(tmp_path / "other", params, {"locked_files": {"lock": "artifacts.lock", "files": other}})
    with pytest.raises(InfraError) as e:
        fetch_run(ctx)
    assert str(e.value) == (f"model.hf: tiny-org/tiny-next@{COMMIT[:12]}: config.json: the Hub served "
                            f"{files['config.json'][:21]}, artifacts.lock holds git-sha1:000000000000 for this commit; "
                            "refusing other files for a pinned commit (a mirror or proxy serving other bytes?); run "
                            "`qbuild compile --update` to accept them")
    assert list(ctx.out.iterdir()) == []


def test_a_snapshot_file_that_is_no_link_to_a_digest_named_blob_is_refused(tmp_path, tiny_checkpoints):
    """huggingface_hub copies files into the snapshot where it cannot make links: the digest the Hub named such a file
    by is not known, and a snapshot must not record its file name as one."""
    snap = populate_hf_cache(tmp_path / "hf-home" / "hub", "tiny-org/tiny-next", tiny_checkpoints["qwen3_next"])
    config = snap / "config.json"
    data = config.read_bytes()
    config.unlink()
    config.write_bytes(data)
    ctx = _ctx(tmp_path, {"source": "hf", "repo": "tiny-org/tiny-next", "revision": COMMIT}, {})
    with pytest.raises(InfraError, match=f"^{config}: not a link to a blob of the HF cache named by its digest"):
        fetch_run(ctx)
