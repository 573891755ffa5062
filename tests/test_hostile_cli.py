"""Hostile inputs and faults through the real CLI: the README's exit-code contract, case by case.

Every case asserts the exit code; that stderr holds exactly one error line (usage errors: click's usage line and
help hint, then one error line) and no traceback; and that nothing was written (store, lockfile, destination), or,
for faults, that the store ends consistent and the next run finishes the job.

The pipeline is the real one up to fetch, with the small test actions of tests/remote_actions after it, so a
recipe builds in about a second (see test_remote_pipeline). Remote cases use moto's S3 server on loopback.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qbuild.core.hashing import digest_file
from tests.s3server import s3_env, shared_server
from tests.test_remote_pipeline import make_locked_project, make_project

# The cases on the module-scoped build `built` run on one worker, so it is built once; the others spread.
ONE_WORKER = pytest.mark.xdist_group("hostile-cli")

REPO = Path(__file__).resolve().parent.parent
MODULE = "tests.remote_actions"     # the real CLI with the fast test actions registered
BUCKET = "qb-hostile"
HOUR_NS = 3600 * 10**9


# --- running the CLI and judging what it printed -------------------------------------------------------------------

def env_for(root: Path, remote: bool = False) -> dict:
    env = s3_env(shared_server().endpoint) if remote else \
        {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "QBUILD_"))}
    env.update(PYTHONPATH=str(REPO), XDG_CACHE_HOME=str(root / ".cache"), HF_HOME=str(root / ".hf"),
               HF_HUB_OFFLINE="1", QBUILD_STORE=str(root / "store"))
    return env


def cli(cwd: Path, *args: str, remote: bool = False, root: Path | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess:
    """`qbuild ARGS` in `cwd` (store, caches under `root`, default `cwd`), as a user would run it."""
    return subprocess.run([sys.executable, "-m", MODULE, *args], cwd=cwd, env=env_for(root or cwd, remote),
                          capture_output=True, text=True, timeout=timeout)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


# Lines that may come before the error: transfer progress, and the note that a recipe changed since it was locked
# (make_locked_project's lock was not built from its recipes, so commands that plan them say so).
PROGRESS = ("download ", "  download:", "upload ", "  upload:", "check ", "  check:", "note: ")


def one_line(proc: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    """The exit code is `code` and stderr is one `error:` line (after any transfer progress lines and notes)
    holding every needle. Returns the line."""
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if not ln.startswith(PROGRESS)]
    assert proc.returncode == code, f"exit {proc.returncode}, want {code}:\n{proc.stderr}"
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


def usage_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 2, click's usage line and help hint, then one `Error:` line; no traceback."""
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert proc.returncode == 2, f"exit {proc.returncode}:\n{proc.stderr}"
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert lines[0].startswith("Usage: ") and lines[-1].startswith("Error: ") and len(lines) <= 3, proc.stderr
    for needle in needles:
        assert needle in lines[-1], f"{needle!r} not in {lines[-1]!r}"


def state(*paths: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every file under `paths`: equal before and after means nothing was written."""
    out = {}
    for root in paths:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []
        for p in files:
            st = p.stat()
            out[str(p)] = (st.st_size, st.st_mtime_ns)
    return out


def lock_doc(project: Path) -> dict:
    return json.loads((project / "artifacts.lock").read_text())


def locked(project: Path, recipe: str, role: str) -> dict:
    doc = lock_doc(project)
    return doc["nodes"][doc["recipes"][recipe]["nodes"][role]]


def blob(project: Path, digest: str) -> Path:
    return project / "store" / "cas" / digest[:2] / digest


# --- fixtures ------------------------------------------------------------------------------------------------------

@pytest.fixture
def project(tmp_path) -> Path:
    """A project with its store and lockfile, as make_locked_project writes them: no build."""
    return make_locked_project(tmp_path / "p")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A project (recipes alpha and beta over one checkpoint) built into its store, with its lockfile. Only the
    slow cases use it: they check that the next build repairs what a fault damaged."""
    root = make_project(tmp_path_factory.mktemp("hostile"))
    ok(cli(root, "compile", "--all", "--mem", "1T"))
    return root


@pytest.fixture
def built_project(built, tmp_path) -> Path:
    """A private copy of `built`, free to damage."""
    dst = tmp_path / "p"
    shutil.copytree(built, dst, symlinks=True)
    return dst


@pytest.fixture(scope="module")
def s3():
    client = shared_server().client()
    try:
        client.create_bucket(Bucket=BUCKET)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    return client


# --- 1. non-finite logits and strict JSON ---------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["bundle", "reference"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_verify_gate_fails_on_a_non_finite_logit(where, bad):
    import torch

    from qbuild.steps.verify import compare, failures
    from qbuild.recipe.params import VerifyParams

    ref = torch.zeros(4, 10)
    ref[:, 2] = 1.0
    ours = ref.clone()
    (ours if where == "bundle" else ref)[1, 3] = bad
    record = {"text": "p", "ids": [0, 1, 2, 3], "greedy": [2, 2], "image": False}
    report = compare(0, record, ours, ref, [2, 2])
    msgs = failures([report], VerifyParams(top1_min=0.0, token_match_min=0.0, max_logit_err=1e9))
    assert msgs, "a non-finite logit passed the verify gate"
    assert any("NaN" in m or "infinite" in m for m in msgs)


def test_json_written_by_qbuild_refuses_nan_and_infinity_in_values_and_keys(tmp_path):
    from qbuild.core import jsonio
    from qbuild.core.hashing import canonical_json, digest_json
    from qbuild.planning.lock import Lock, NodeEntry
    from qbuild.store.manifest import tree_digest
    from qbuild.store.manifest import Manifest

    with pytest.raises(ValueError, match=r"\$\.prompts\[0\]\.max_logit_err"):
        jsonio.dumps({"ok": True, "prompts": [{"max_logit_err": float("nan")}]})
    with pytest.raises(ValueError, match="key"):
        jsonio.dumps({float("inf"): 1})
    with pytest.raises(ValueError):
        canonical_json({"x": float("-inf")})
    node = NodeEntry(kind="verify", key=digest_json({}), preimage={"x": float("nan")}, digest=tree_digest({}),
                     outputs={})
    with pytest.raises(ValueError):
        Lock(nodes={"n": node}).dumps()
    with pytest.raises(ValueError):
        Manifest("k", "verify", {"p": float("nan")}, {}).to_bytes()
    assert json.loads(jsonio.dumps({"a": [1.5, 2]}, indent=1)) == {"a": [1.5, 2]}


# --- 2. tiny into a directory that holds something ------------------------------------------------------------------

def test_tiny_refuses_a_non_empty_directory(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"my fine-tune")
    before = state(out)
    one_line(cli(tmp_path, "tiny", "qwen3_next", str(out)), 2, str(out), "not empty", "--force")
    assert state(out) == before


def test_tiny_refuses_a_directory_under_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    one_line(cli(tmp_path, "tiny", "qwen3_next", "file/ckpt"), 2, "file/ckpt", "not a directory")
    one_line(cli(tmp_path, "tiny", "qwen3_next", "file"), 2, "exists and is not a directory")


def test_tiny_force_replaces_the_directory_whole(tmp_path, monkeypatch):
    import qbuild.model.tinymodel as tinymodel

    def fake_write(out, family, *, seed, fused_experts):
        out.mkdir(parents=True)
        (out / "config.json").write_text(family)

    # No public seam takes the writer, and the real one costs about 10 s on 2 cores; what is under test is how
    # install_tiny_checkpoint stages and swaps the directory around it.
    monkeypatch.setattr(tinymodel, "write_tiny_checkpoint", fake_write)
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "stale-shard.safetensors").write_bytes(b"old")
    tinymodel.install_tiny_checkpoint(out, "qwen3_next", replace=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]     # no staging left behind


HELD_TORCH = """\
import os, signal, sys


class _HeldTorch:
    # Holds `import torch` until a signal ends it, so SIGINT lands inside the command, never after it. The line on
    # the inherited pipe tells the test that the command got there.
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            os.write(int(os.environ["QBUILD_TEST_READY_FD"]), b"ready\\n")
            while True:
                signal.pause()
        return None


sys.meta_path.insert(0, _HeldTorch())
"""


def test_sigint_exits_130_with_one_line_and_writes_nothing(tmp_path):
    out, hook = tmp_path / "ckpt", tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HELD_TORCH)
    ready_r, ready_w = os.pipe()
    env = env_for(tmp_path)
    env.update(PYTHONPATH=f"{hook}{os.pathsep}{env['PYTHONPATH']}", QBUILD_TEST_READY_FD=str(ready_w))
    proc = subprocess.Popen([sys.executable, "-m", MODULE, "tiny", "qwen3_next", str(out)], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, pass_fds=(ready_w,))
    os.close(ready_w)    # the child holds the only write end: its exit ends the read below
    try:
        with os.fdopen(ready_r, "rb") as ready:
            assert select.select([ready], [], [], 60)[0] and ready.readline() == b"ready\n", \
                "the command never reached its torch import"
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and stderr.strip() == "interrupted" and "Traceback" not in stderr + stdout
    assert not [p.name for p in tmp_path.iterdir() if "ckpt" in p.name]


# --- 3. stale digests -----------------------------------------------------------------------------------------------

def _rewrite_keeping_times(path: Path, data: bytes) -> None:
    """Rewrite `path` in place with same-size bytes and put its old times back (`touch -r`, rsync --times)."""
    st = path.stat()
    assert len(data) == st.st_size
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_stat_cache_sees_a_rewrite_with_restored_mtime(tmp_path):
    from qbuild.core.hashing import StatCache

    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 4096)
    os.utime(f, ns=(time.time_ns() - HOUR_NS,) * 2)
    cache = StatCache(tmp_path / "stat.sqlite")
    assert cache.digest(f) == digest_file(f)
    _rewrite_keeping_times(f, b"b" * 4096)
    assert cache.digest(f) == digest_file(f)


def test_stat_cache_rehashes_a_file_modified_within_the_racy_window(tmp_path, monkeypatch):
    from qbuild.core.hashing import StatCache

    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 4096)
    cache = StatCache(tmp_path / "stat.sqlite")
    assert cache.digest(f) == digest_file(f)
    # A rewrite within one tick of a coarse clock: size, mtime and ctime all unchanged. Only the racy-timestamp rule
    # (never trust a digest of a file modified in the last minute) can notice.
    first = f.stat()
    real_stat = Path.stat
    # No filesystem here has a clock that coarse: Path.stat answers as one would.
    monkeypatch.setattr(Path, "stat", lambda self, **kw: first if self == f else real_stat(self, **kw))
    f.write_bytes(b"b" * 4096)
    assert cache.digest(f) == digest_file(f)


@ONE_WORKER
@pytest.mark.slow
def test_a_checkpoint_rewritten_with_its_old_mtime_is_rebuilt_and_relocked(built_project):
    weights = built_project / "model" / "model.safetensors"
    for p in (built_project / "model").iterdir():
        os.utime(p, ns=(time.time_ns() - HOUR_NS,) * 2)
    ok(cli(built_project, "plan", "--all", "--json"))           # hashes and caches the (old) files
    _rewrite_keeping_times(weights, bytes(reversed(weights.read_bytes())))
    out = json.loads(ok(cli(built_project, "compile", "recipes/alpha.yaml", "--mem", "1T", "--json")).stdout)
    assert any(n.startswith("fetch") for n in out["built"]), out["built"]
    assert lock_doc(built_project)["recipes"]["alpha"]["model"]["files"]["model.safetensors"] == \
        "blake3:" + digest_file(weights)


# --- 4. store verify finds lost blobs and unreadable manifests ------------------------------------------------------

@ONE_WORKER
@pytest.mark.slow
def test_store_verify_reports_a_lost_blob_and_repair_lets_it_rebuild(built_project):
    report = locked(built_project, "alpha", "verify")
    blob(built_project, report["outputs"]["report.json"]["digest"]).unlink()
    proc = cli(built_project, "store", "verify")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [f"manifest {report['key'][:16]} (verify) lost report.json"]
    proc = ok(cli(built_project, "store", "verify", "--repair"))
    assert proc.stderr.strip().splitlines() == [f"repaired: manifest {report['key'][:16]} (verify) lost report.json"]
    assert not list((built_project / "store" / "ac").glob(f"*/{report['key']}.json"))
    out = json.loads(ok(cli(built_project, "compile", "--all", "--mem", "1T", "--json")).stdout)
    assert out["built"] == ["verify alpha"]
    ok(cli(built_project, "lock", "check"))
    assert ok(cli(built_project, "store", "verify")).stderr == ""


@ONE_WORKER
@pytest.mark.slow
def test_store_verify_reports_an_unreadable_manifest_and_repair_removes_it(built_project):
    node = locked(built_project, "beta", "package")
    path = built_project / "store" / "ac" / node["key"][:2] / f"{node['key']}.json"
    path.write_text("{not json")
    proc = cli(built_project, "store", "verify")
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [f"unreadable manifest {path}"]
    ok(cli(built_project, "store", "verify", "--repair"))
    assert not path.exists()
    out = json.loads(ok(cli(built_project, "compile", "--all", "--mem", "1T", "--json")).stdout)
    assert "package beta" in out["built"]
    ok(cli(built_project, "lock", "check"))


# --- 5. a corrupted or missing blob on the remote -------------------------------------------------------------------

def _publish(project: Path, prefix: str) -> str:
    url = f"s3://{BUCKET}/{prefix}"
    ok(cli(project, "publish", "--all", "--remote", url, remote=True))
    return url


@pytest.mark.slow
def test_a_corrupt_remote_blob_is_named_by_pull_and_repaired_by_publish_verify_remote(project, s3, tmp_path):
    url = _publish(project, "corrupt")
    package = locked(project, "beta", "package")
    rel, meta = sorted(package["outputs"].items())[-1]
    key = f"corrupt/cas/{meta['digest'][:2]}/{meta['digest']}"
    s3.put_object(Bucket=BUCKET, Key=key, Body=b"\0" * meta["size"])

    host = tmp_path / "host"
    host.mkdir()
    shutil.copyfile(project / "artifacts.lock", host / "artifacts.lock")
    proc = cli(host, "pull", "beta", "--to", "bundle", "--remote", url, remote=True)
    one_line(proc, 3, f"s3://{BUCKET}/{key}", rel, "does not match",
             f"`qbuild publish --all --verify-remote --remote {url}`")
    assert sorted(p.name for p in host.iterdir() if p.name != ".cache") == ["artifacts.lock", "store"]
    assert not blob(host, meta["digest"]).exists()

    # A plain publish sees the object's name and trusts it; --verify-remote reads the bytes back.
    plain = json.loads(ok(cli(project, "publish", "beta", "--remote", url, "--json", remote=True)).stdout)
    assert plain["blobs_uploaded"] == 0
    fixed = json.loads(ok(cli(project, "publish", "beta", "--verify-remote", "--remote", url, "--json",
                              remote=True)).stdout)
    assert fixed["blobs_repaired"] == 1 and fixed["blobs_uploaded"] == 1
    ok(cli(host, "pull", "beta", "--to", "bundle", "--remote", url, remote=True))
    assert digest_file(host / "bundle" / rel) == meta["digest"]
    again = json.loads(ok(cli(project, "publish", "beta", "--verify-remote", "--remote", url, "--json",
                              remote=True)).stdout)
    assert again["blobs_repaired"] == 0 and again["blobs_uploaded"] == 0


def test_a_blob_deleted_from_the_remote_is_uploaded_again_by_publish_verify_remote(project, s3):
    url = _publish(project, "deleted")
    meta = locked(project, "alpha", "verify")["outputs"]["report.json"]
    s3.delete_object(Bucket=BUCKET, Key=f"deleted/cas/{meta['digest'][:2]}/{meta['digest']}")
    out = json.loads(ok(cli(project, "publish", "--all", "--verify-remote", "--remote", url, "--json",
                            remote=True)).stdout)
    assert out["blobs_repaired"] == 1 and out["blobs_uploaded"] == 1
    s3.head_object(Bucket=BUCKET, Key=f"deleted/cas/{meta['digest'][:2]}/{meta['digest']}")


@pytest.mark.parametrize("remote", ["", "s3://Bad_Bucket/x", "s3://ab/x", "s3://a..b/x", "s3://10.0.0.1/x",
                                    "https://bucket/x"])
def test_a_bad_remote_url_is_refused_before_anything_is_written(project, remote):
    before = state(project / "store", project / "artifacts.lock")
    one_line(cli(project, "compile", "--all", "--mem", "1T", "--remote", remote), 2, "remote:", repr(remote))
    assert state(project / "store", project / "artifacts.lock") == before


def test_gc_with_an_empty_remote_is_refused_before_the_local_store_is_touched(project):
    from qbuild.store.local import LocalStore
    from qbuild.store.manifest import Manifest

    # An entry no lockfile names: what `gc --keep-size 0` would remove, were it allowed to start.
    store = LocalStore(project / "store")
    stray = project / "stray"
    stray.mkdir()
    (stray / "out.bin").write_bytes(b"unlocked")
    store.put_manifest(Manifest("f" * 64, "verify", {}, store.ingest_tree(stray)))
    before = state(project / "store")
    one_line(cli(project, "gc", "--keep-size", "0", "--remote", ""), 2, "remote: ''")
    assert state(project / "store") == before


def test_credentials_in_a_remote_url_are_refused_and_never_echoed(project):
    proc = cli(project, "publish", "--all", "--remote", "s3://AKIAEXAMPLE:hunter2secret@bucket/x")
    one_line(proc, 2, "credentials")
    assert "hunter2secret" not in proc.stderr + proc.stdout


# --- 6. usage errors ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, needle", [
    (["compile", "--bogus"], "No such option: --bogus"),
    (["bogus"], "No such command 'bogus'"),
    (["store", "bogus"], "No such command 'bogus'"),
    (["pull", "alpha"], "Missing option '--to'"),
    (["tiny"], "Missing argument"),
    (["compile", "-j", "0", "recipes/alpha.yaml"], "'-j' / '--jobs'"),
    (["run", "alpha", "--max-new-tokens", "0"], "'--max-new-tokens'"),
    (["bench", "alpha", "--repeats", "x"], "'--repeats'"),
])
def test_usage_errors_exit_2_with_the_usage_hint(project, args, needle):
    before = state(project / "store", project / "artifacts.lock")
    usage_error(cli(project, *args), needle)
    assert state(project / "store", project / "artifacts.lock") == before


# --- 9. one resolution of a recipe argument ----------------------------------------------------------------------

def test_pull_takes_an_absolute_recipe_path(project):
    ok(cli(project, "pull", str(project / "recipes" / "alpha.yaml"), "--to", "abs"))
    assert (project / "abs" / "config.json").is_file()


def test_pull_and_lock_check_take_a_dotdot_recipe_path(project):
    sub = project / "sub"
    sub.mkdir()
    ok(cli(sub, "pull", "../recipes/beta.yaml", "--to", "bundle", "--lock", "../artifacts.lock", root=project))
    assert (sub / "bundle" / "config.json").is_file()
    ok(cli(project, "lock", "check", str(project / "recipes" / "beta.yaml"), "recipes/../recipes/alpha.yaml"))


def test_a_recipe_the_lock_does_not_hold_is_one_line_naming_the_locked_ones(project):
    before = state(project / "store")
    one_line(cli(project, "pull", "recipes/gamma.yaml", "--to", "x"), 2, "'recipes/gamma.yaml'", "alpha, beta")
    one_line(cli(project, "lock", "check", "gamma"), 2, "'gamma' is not in the lockfile")
    assert state(project / "store") == before and not (project / "x").exists()


@pytest.mark.parametrize("command", [["run", "--prompt", "hi"], ["bench"], ["serve", "--dry-run"]],
                         ids=["run", "bench", "serve"])
def test_a_locked_recipe_is_named_not_its_temporary_directory(project, command):
    """The test actions' bundle has no bundle.json, so the runtime (serve: the manifest read) refuses it: the error
    must name the recipe, given as an absolute path."""
    target = str(project / "recipes" / "alpha.yaml")
    line = one_line(cli(project, command[0], target, *command[1:]), 2, f"{target} (its locked bundle)",
                    "not a qbuild bundle")
    assert "qbuild-bundle-" not in line and "not in the lockfile" not in line


def test_opening_a_locked_bundle_lays_it_out_for_the_block_only(project):
    from qbuild.core.errors import UserError
    from qbuild.execution.transfer import open_locked_bundle
    from qbuild.planning import lock as lockmod
    from qbuild.store.local import LocalStore

    lock = project / "artifacts.lock"
    doc = lockmod.read(lock)
    target = str(project / "recipes" / ".." / "recipes" / "beta.yaml")     # resolved to the locked recipe "beta"
    with open_locked_bundle(LocalStore(project / "store"), doc, lock, target, share=True) as bundle:
        assert (bundle.name, bundle.shown_as) == ("beta", f"{target} (its locked bundle)")
        assert bundle.digests_checked and bundle.path.name == "beta"
        assert sorted(p.name for p in (bundle.path / "weights").iterdir()) == [
            "tp0_sharded_checkpoint.safetensors", "tp1_sharded_checkpoint.safetensors"]
    assert not bundle.path.exists() and not bundle.path.parent.exists()
    alpha = doc.recipes["alpha"]
    doc = doc.model_copy(update={"recipes": {**doc.recipes, "alpha": alpha.model_copy(update={
        "verified": False, "nodes": {r: n for r, n in alpha.nodes.items() if r != "verify"}})}})
    with pytest.raises(UserError, match="alpha: the bundle is not verified"):
        with open_locked_bundle(LocalStore(project / "store"), doc, lock, "alpha", share=True):
            pass


# --- 13. a pulled bundle never corrupts the store; run names the real mismatch ---------------------------------------

def test_editing_a_pulled_bundle_leaves_the_store_intact(project):
    ok(cli(project, "pull", "alpha", "--to", "bundle"))
    package = locked(project, "alpha", "package")
    rel = "weights/tp0_sharded_checkpoint.safetensors"
    pulled, stored = project / "bundle" / rel, blob(project, package["outputs"][rel]["digest"])
    if os.geteuid() == 0:   # root ignores the read-only bit: the bundle must not share the store's inode
        assert pulled.stat().st_ino != stored.stat().st_ino
        with open(pulled, "ab") as f:
            f.write(b"edited")
    else:                   # hardlinks, protected by the read-only bit
        assert pulled.stat().st_ino == stored.stat().st_ino and not pulled.stat().st_mode & 0o222
        with pytest.raises(PermissionError):
            open(pulled, "ab")
    assert ok(cli(project, "store", "verify")).stderr == ""
    ok(cli(project, "lock", "check"))


def test_materialize_without_sharing_never_hands_out_a_store_inode(tmp_path):
    from qbuild.store.local import LocalStore

    store = LocalStore(tmp_path / "store")
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"payload")
    outputs = store.ingest_tree(src)
    store.materialize(outputs, tmp_path / "out", verify=True, share=False)
    out = tmp_path / "out" / "a.bin"
    assert out.stat().st_ino != store.blob_path(outputs["a.bin"]["digest"]).stat().st_ino
    out.write_bytes(b"changed")
    assert store.verify() == []


def test_run_names_a_grown_bundle_file_as_grown_not_truncated(tmp_path):
    from qbuild.model.bundle import write_manifest

    root = tmp_path / "bundle"
    (root / "weights").mkdir(parents=True)
    (root / "weights" / "tp0_sharded_checkpoint.safetensors").write_bytes(b"w" * 10)
    (root / "config.json").write_text("{}")
    write_manifest(root, {"family": "qwen3_next", "backend": "export", "tp": 1, "ep": 1})
    with open(root / "weights" / "tp0_sharded_checkpoint.safetensors", "ab") as f:
        f.write(b"more")
    line = one_line(cli(tmp_path, "run", str(root), "--prompt", "hi"), 2, "14 bytes where bundle.json says 10",
                    "pull it again")
    assert "truncated" not in line


# --- 14. smaller items --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, needle", [
    (["compile", "--all", "--mem", "-5G"], "--mem: cannot read '-5G'"),
    (["compile", "--all", "--mem", "nan"], "--mem: cannot read 'nan'"),
    (["compile", "--all", "--mem", "inf"], "--mem: cannot read 'inf'"),
    (["compile", "--all", "--mem", "0"], "--mem: '0' leaves no room"),
    (["compile", "--all", "--mem", ""], "--mem: cannot read ''"),
    (["gc", "--keep-size", "-1G"], "--keep-size: cannot read '-1G'"),
    (["gc", "--keep-size", "inf"], "--keep-size: cannot read 'inf'"),
    (["gc", "--grace", "-1h"], "--grace: cannot read '-1h'"),
])
def test_sizes_and_durations_are_refused_before_anything_is_written(project, args, needle):
    before = state(project / "store", project / "artifacts.lock")
    one_line(cli(project, *args), 2, needle)
    assert state(project / "store", project / "artifacts.lock") == before


@pytest.mark.parametrize("value", ["true", "1.0", "'2'"])
def test_integer_recipe_fields_take_integers_only(project, value):
    f = project / "recipes" / "alpha.yaml"
    f.write_text(f.read_text().replace("parallel: {tp: 1}", f"parallel: {{tp: {value}}}"))
    before = state(project / "store", project / "artifacts.lock")
    one_line(cli(project, "compile", "recipes/alpha.yaml", "--mem", "1T"), 2, "alpha.yaml:3:", "parallel.tp",
             "valid integer")
    one_line(cli(project, "recipe", "validate", "recipes/alpha.yaml"), 2, "parallel.tp")
    assert state(project / "store", project / "artifacts.lock") == before


@pytest.mark.parametrize("field, value, needle", [
    ("verify", "{max_logit_err: .nan}", "finite number"),
    ("verify", "{max_logit_err: .inf}", "finite number"),
    ("verify", "{top1_min: true}", "got true/false"),
    ("fused_qkv", "1", "valid boolean"),
])
def test_recipe_numbers_and_flags_are_not_coerced(project, field, value, needle):
    f = project / "recipes" / "alpha.yaml"
    f.write_text(f.read_text() + f"{field}: {value}\n")
    before = state(project / "store", project / "artifacts.lock")
    one_line(cli(project, "compile", "recipes/alpha.yaml", "--mem", "1T"), 2, "alpha.yaml:7:", field, needle)
    assert state(project / "store", project / "artifacts.lock") == before


def test_prompt_and_prompt_ids_together_are_refused(project):
    one_line(cli(project, "run", "alpha", "--prompt", "hi", "--prompt-ids", "1,2"), 2, "--prompt and --prompt-ids")
    one_line(cli(project, "run", "alpha"), 2, "give --prompt TEXT or --prompt-ids")


def test_a_recipe_name_locked_for_another_file_is_refused_naming_both(project):
    other = project / "elsewhere"
    other.mkdir()
    (other / "alpha.yaml").write_text((project / "recipes" / "alpha.yaml").read_text().replace(
        "cte_buckets: [32, 64]", "cte_buckets: [32]"))
    before = state(project / "store", project / "artifacts.lock")
    one_line(cli(project, "compile", "elsewhere/alpha.yaml", "--mem", "1T"), 2, "'alpha'",
             str(other / "alpha.yaml"), str(project / "recipes" / "alpha.yaml"))
    assert state(project / "store", project / "artifacts.lock") == before


@ONE_WORKER
@pytest.mark.slow
def test_a_recipe_file_that_moved_takes_its_lock_entry_over(built_project):
    other = built_project / "elsewhere"
    other.mkdir()
    shutil.move(built_project / "recipes" / "alpha.yaml", other / "alpha.yaml")   # the locked path is gone
    ok(cli(built_project, "compile", "elsewhere/alpha.yaml", "--mem", "1T"))
    assert lock_doc(built_project)["recipes"]["alpha"]["recipe"] == "elsewhere/alpha.yaml"


def test_two_recipes_of_one_name_in_one_run_are_refused(project):
    (project / "dup").mkdir()
    shutil.copyfile(project / "recipes" / "alpha.yaml", project / "dup" / "alpha.yaml")
    before = state(project / "store", project / "artifacts.lock")
    one_line(cli(project, "compile", "recipes/alpha.yaml", "dup/alpha.yaml", "--mem", "1T"), 2, "'alpha'")
    assert state(project / "store", project / "artifacts.lock") == before


def test_pull_to_a_path_under_a_file_is_bad_input(project):
    (project / "afile").write_text("x")
    before = state(project / "store")
    one_line(cli(project, "pull", "alpha", "--to", "afile/bundle"), 2, "afile", "not a directory")
    one_line(cli(project, "pull", "alpha", "--to", "afile"), 2, "exists and is not a directory")
    assert state(project / "store") == before


def test_pull_to_a_non_empty_directory_is_refused_and_left_alone(project):
    dest = project / "occupied"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    before = state(dest, project / "store")
    one_line(cli(project, "pull", "alpha", "--to", "occupied"), 2, "occupied", "not empty")
    assert state(dest, project / "store") == before


# --- more: lockfiles and the store ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, needle", [
    ("{not json", "unreadable lockfile"),
    ('{"version": 99, "recipes": {}, "nodes": {}}', "lockfile version 99"),
])
def test_a_damaged_lockfile_is_one_line_and_left_as_it_is(project, text, needle):
    (project / "artifacts.lock").write_text(text)
    before = state(project / "store", project / "artifacts.lock")
    one_line(cli(project, "compile", "--all", "--mem", "1T"), 2, "artifacts.lock", needle)
    one_line(cli(project, "pull", "alpha", "--to", "b"), 2, needle)
    assert state(project / "store", project / "artifacts.lock") == before and not (project / "b").exists()


@ONE_WORKER
@pytest.mark.slow
def test_a_corrupt_local_blob_is_found_dropped_and_rebuilt(built_project):
    meta = locked(built_project, "beta", "reference")["outputs"]["reference.json"]
    path = blob(built_project, meta["digest"])
    path.chmod(0o644)
    path.write_text('{"seed": "tampered"}')
    proc = cli(built_project, "store", "verify")
    assert proc.returncode == 1 and f"corrupt blob {path}" in proc.stderr and "Traceback" not in proc.stderr
    ok(cli(built_project, "store", "verify", "--repair"))
    ok(cli(built_project, "compile", "--all", "--mem", "1T"))
    ok(cli(built_project, "lock", "check"))
    assert digest_file(path) == meta["digest"]


def test_a_missing_recipe_file_is_one_line_and_writes_nothing(project):
    before = state(project / "store", project / "artifacts.lock")
    one_line(cli(project, "compile", "recipes/nope.yaml", "--mem", "1T"), 2, "recipes/nope.yaml")
    assert state(project / "store", project / "artifacts.lock") == before


# --- 15. a lockfile is one schema and agrees with itself, for every command that reads it ---------------------------

def _edit_lock(project: Path, edit) -> None:
    doc = lock_doc(project)
    edit(doc)
    (project / "artifacts.lock").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def _first_node(doc: dict) -> dict:
    return doc["nodes"][sorted(doc["nodes"])[0]]


# Every command that reads a lockfile (a remote URL that no server answers: the lockfile is refused before it is used).
LOCK_READERS = [["lock", "check"], ["pull", "alpha", "--to", "b"], ["run", "alpha", "--prompt", "hi"],
                ["serve", "alpha", "--dry-run"], ["publish", "--all", "--remote", "s3://qb-unused/x"], ["gc"],
                ["compile", "--all", "--mem", "1T"], ["plan", "--all"]]

MALFORMED_LOCKS = {
    "recipes is a list": (lambda d: d.__setitem__("recipes", []), "$.recipes: expected an object, got a list"),
    "a node is a string": (lambda d: d["nodes"].__setitem__(sorted(d["nodes"])[0], "node"),
                           "expected an object, got 'node'"),
    "a node without a key": (lambda d: _first_node(d).pop("key"), ".key: missing"),
    "a recipe entry is null": (lambda d: d["recipes"].__setitem__("alpha", None),
                               "$.recipes.alpha: expected an object, got null"),
    "nodes is a list": (lambda d: d.__setitem__("nodes", []), "$.nodes: expected an object, got a list"),
    "a bundle is a number": (lambda d: d["recipes"]["alpha"].__setitem__("bundle", 5),
                             "$.recipes.alpha.bundle: expected a string, got 5"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_LOCKS))
def test_a_malformed_lockfile_is_one_line_naming_its_json_path_for_every_command(project, case):
    edit, needle = MALFORMED_LOCKS[case]
    _edit_lock(project, edit)
    before = state(project / "store", project / "artifacts.lock")
    for args in LOCK_READERS:
        one_line(cli(project, *args), 2, "artifacts.lock: $.", needle)
    assert state(project / "store", project / "artifacts.lock") == before and not (project / "b").exists()


def _swap(*fields: str):
    """An edit swapping alpha's and beta's `fields` (a role's node id, or an entry field such as `bundle`)."""
    def edit(doc: dict) -> None:
        a, b = doc["recipes"]["alpha"], doc["recipes"]["beta"]
        for f in fields:
            (x, y) = (a["nodes"], b["nodes"]) if f in a["nodes"] else (a, b)
            x[f], y[f] = y[f], x[f]
    return edit


def _verified_without_its_verify(doc: dict) -> None:
    doc["recipes"]["alpha"]["nodes"].pop("verify")      # a verify that failed, then marked verified by hand


def _preimage_edited(doc: dict) -> None:
    node = doc["nodes"][doc["recipes"]["alpha"]["nodes"]["package"]]
    node["preimage"]["recipe"] = "beta"


INCONSISTENT_LOCKS = {
    "package nodes swapped": (_swap("package"), "$.recipes.alpha.bundle: ", "not the output of its package node"),
    "package nodes and bundles swapped": (_swap("package", "bundle"), "$.recipes.alpha.nodes.verify: ",
                                          "did not verify the bundle"),
    "verified without a verify node": (_verified_without_its_verify, "$.recipes.alpha.verified: ",
                                       "no verify node"),
    "a preimage edited": (_preimage_edited, "$.nodes.", ".key: is not the digest of the node's preimage"),
    "a locked node gone": (lambda d: d.__setitem__("nodes", {}), "$.recipes.alpha.nodes.", "not in $.nodes"),
}


@pytest.mark.parametrize("case", sorted(INCONSISTENT_LOCKS))
def test_a_lockfile_that_disagrees_with_itself_is_refused_by_every_command(project, case):
    """A recipe entry pointing at another recipe's bundle (or a bundle its verify never saw) would be laid out, run
    and served as that recipe's, verified: `lock check` passed it, and every command used it."""
    edit, where, needle = INCONSISTENT_LOCKS[case]
    _edit_lock(project, edit)
    before = state(project / "store", project / "artifacts.lock")
    for args in LOCK_READERS:
        one_line(cli(project, *args), 2, f"artifacts.lock: {where}", needle, "disagrees with itself")
    assert state(project / "store", project / "artifacts.lock") == before and not (project / "b").exists()


def _remote_objects(s3, prefix: str) -> dict[str, int]:
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/").get("Contents", [])
    return {o["Key"]: o["Size"] for o in listed if "/leases/" not in o["Key"]}


GC_EDITS = {"emptied": lambda d: d.__setitem__("nodes", {}),
            "malformed": lambda d: d["nodes"].__setitem__("extra", {"key": 5})}


@pytest.mark.parametrize("case", sorted(GC_EDITS))
def test_gc_refuses_a_lockfile_lock_check_rejects_and_removes_nothing(project, s3, case):
    """With `nodes: {}` a remote gc would delete every object of the remote, and a malformed entry crashed it."""
    edit = GC_EDITS[case]
    url = _publish(project, f"gc-guard-{case}-{os.getpid()}")
    prefix = url.split("/", 3)[3]
    on_remote = _remote_objects(s3, prefix)
    _edit_lock(project, edit)
    before = state(project / "store", project / "artifacts.lock")
    line = one_line(cli(project, "gc", "--keep-size", "0", "--grace", "0", "--remote", url, remote=True), 2,
                    "artifacts.lock: $.")
    assert one_line(cli(project, "lock", "check"), 2) == line
    assert state(project / "store", project / "artifacts.lock") == before
    assert _remote_objects(s3, prefix) == on_remote


# --- 16. a recipe changed since it was locked is named; --strict refuses it ----------------------------------------

@ONE_WORKER
@pytest.mark.slow
def test_a_recipe_changed_since_it_was_locked_is_named_and_strict_refuses_it(built_project):
    recipe = built_project / "recipes" / "alpha.yaml"
    recipe.write_text(recipe.read_text().replace("cte_buckets: [32, 64]", "cte_buckets: [32]"))
    note = (f"note: alpha: {recipe} changed since it was locked (package: params.cte_buckets changed); the lock holds "
            f"what it asked for before: `qbuild compile {recipe}` builds what it asks for now")
    for args in (["pull", "alpha", "--to", "bundle"], ["lock", "check"]):
        proc = ok(cli(built_project, *args))
        assert [ln for ln in proc.stderr.splitlines() if ln.startswith("note: ")] == [note], proc.stderr
    assert json.loads(ok(cli(built_project, "lock", "check", "--json")).stdout)["changed"] == [note[len("note: "):]]
    before = state(built_project / "store", built_project / "artifacts.lock")
    for args in (["pull", "alpha", "--to", "strict"], ["run", "alpha", "--prompt", "hi"], ["bench", "alpha"],
                 ["serve", "alpha", "--dry-run"], ["lock", "check"], ["lock", "check", "alpha"]):
        one_line(cli(built_project, *args, "--strict"), 2, f"alpha: {recipe} changed since it was locked",
                 "--strict refuses")
    assert state(built_project / "store", built_project / "artifacts.lock") == before
    assert not (built_project / "strict").exists()
    # An unchanged recipe, and a pulled bundle directory (which has no recipe to compare), say nothing.
    assert "note:" not in ok(cli(built_project, "pull", "beta", "--to", "beta", "--strict")).stderr
    assert "note:" not in cli(built_project, "run", "bundle", "--prompt", "hi", "--strict").stderr
    # Put back, the recipe asks for what is locked again.
    recipe.write_text(recipe.read_text().replace("cte_buckets: [32]", "cte_buckets: [32, 64]"))
    assert "note:" not in ok(cli(built_project, "lock", "check", "--strict")).stderr


def test_a_locked_recipe_whose_file_cannot_be_planned_is_named_and_strict_refuses_it(project):
    recipe = project / "recipes" / "alpha.yaml"
    recipe.write_text(recipe.read_text().replace("parallel: {tp: 1}", "parallel: {tp: 1, bogus: 2}"))
    proc = ok(cli(project, "pull", "alpha", "--to", "b"))
    assert f"note: alpha: cannot tell whether {recipe} changed since it was locked: {recipe}:3:" in proc.stderr
    one_line(cli(project, "pull", "alpha", "--to", "c", "--strict"), 2, "cannot tell whether", "parallel.bogus")
    assert not (project / "c").exists()


def test_a_locked_recipe_whose_file_was_deleted_is_named_and_strict_refuses_it(project):
    """Deleted, a recipe's locked bundle was laid out, run and served with no word: the lock holds a bundle no recipe
    file asks for any more."""
    recipe = project / "recipes" / "alpha.yaml"
    recipe.unlink()
    gone = f"alpha: {recipe}, which it was locked from, is gone"
    proc = ok(cli(project, "pull", "alpha", "--to", "b"))
    assert [ln for ln in proc.stderr.splitlines() if ln.startswith("note: alpha")] == \
        [f"note: {gone}; the lock holds the bundle it built, which no recipe file asks for now"]
    for args in (["pull", "alpha", "--to", "c"], ["run", "alpha", "--prompt", "hi"], ["serve", "alpha", "--dry-run"],
                 ["lock", "check", "alpha"]):
        one_line(cli(project, *args, "--strict"), 2, gone, "--strict refuses")
    assert not (project / "c").exists()
    # beta's file is still there: it is not gone (this lock was not built from it, so it is named as changed).
    assert "is gone" not in ok(cli(project, "pull", "beta", "--to", "d")).stderr


def test_a_serving_host_holding_the_lockfile_alone_is_told_nothing_unless_strict(project, tmp_path):
    host = tmp_path / "host"
    host.mkdir()
    shutil.copyfile(project / "artifacts.lock", host / "artifacts.lock")
    proc = ok(cli(host, "pull", "alpha", "--to", "b", root=project))
    assert "note:" not in proc.stderr, proc.stderr
    one_line(cli(host, "pull", "alpha", "--to", "c", "--strict", root=project), 2,
             f"alpha: {host / 'recipes' / 'alpha.yaml'}, which it was locked from, is not on this machine",
             "--strict refuses")


# --- 17. smaller items of the same run ------------------------------------------------------------------------------

def test_tiny_refuses_a_negative_seed_as_a_usage_error(tmp_path):
    usage_error(cli(tmp_path, "tiny", "qwen3_5", "ck", "--seed", "-1"), "'--seed'")
    assert not [p for p in tmp_path.iterdir() if "ck" in p.name]


def test_a_memory_budget_no_step_fits_is_bad_input_not_a_failed_step(project):
    before = state(project / "store", project / "artifacts.lock")
    proc = cli(project, "compile", "--all", "--mem", "1K")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "needs ~" in last and \
        "alone, more than the whole memory budget of 1.0 KiB (--mem 1K); give at least that" in last, last
    assert state(project / "store", project / "artifacts.lock") == before


def test_bench_out_naming_a_directory_is_refused_before_the_bench(project):
    (project / "outdir").mkdir()
    one_line(cli(project, "bench", "alpha", "--out", "outdir"), 2, "--out outdir: is a directory")
    (project / "afile").write_text("x")
    one_line(cli(project, "bench", "alpha", "--out", "afile/doc.json"), 2, "afile", "not a directory")


def test_lock_check_names_a_store_entry_of_another_digest_as_such(project):
    from qbuild.store.local import LocalStore
    from qbuild.store.manifest import Manifest

    node = locked(project, "alpha", "package")
    store = LocalStore(project / "store")
    other = project / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    store.put_manifest(Manifest(node["key"], "package", node["preimage"], store.ingest_tree(other)))
    proc = cli(project, "lock", "check")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("alpha: package:")]
    assert line == (f"alpha: package: the store's entry for key {node['key'][:16]} has digest "
                    f"{store.get_manifest(node['key']).digest[:16]}, the lockfile {node['digest'][:16]}")


def test_pull_names_the_file_whose_size_differs_not_one_digest_twice(project):
    node = locked(project, "alpha", "package")
    rel = sorted(node["outputs"])[0]
    _edit_lock(project, lambda d: d["nodes"][d["recipes"]["alpha"]["nodes"]["package"]]["outputs"][rel].__setitem__(
        "size", node["outputs"][rel]["size"] + 1))
    line = one_line(cli(project, "pull", "alpha", "--to", "b"), 3, rel, f"{node['outputs'][rel]['size']} bytes")
    assert line.count(node["digest"][:16]) == 0 and not (project / "b").exists()


def test_recipe_validate_json_reports_every_file_also_a_bad_one(project):
    bad = project / "recipes" / "bad.yaml"
    bad.write_text("name: bad\nmodel: {path: ../model}\nparallel: {tp: 0}\n")
    proc = cli(project, "recipe", "validate", "recipes/alpha.yaml", "recipes/bad.yaml", "--json")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] is False and [r["ok"] for r in doc["recipes"]] == [True, False]
    assert doc["recipes"][1]["file"] == "recipes/bad.yaml" and "parallel.tp" in doc["recipes"][1]["error"]
    assert proc.stderr.strip() == f"error: {doc['recipes'][1]['error']}"


def test_run_refuses_an_unverified_bundle_as_pull_and_serve_do(project):
    def unverified(doc: dict) -> None:
        entry = doc["recipes"]["alpha"]
        entry["nodes"].pop("verify")
        entry.update(verified=False, verify_failure="top-1 agreement 0.5 < 0.99")
    _edit_lock(project, unverified)
    for args in (["run", "alpha", "--prompt", "hi"], ["bench", "alpha"], ["pull", "alpha", "--to", "b"],
                 ["serve", "alpha", "--dry-run"]):
        one_line(cli(project, *args), 2, "alpha: the bundle is not verified (top-1 agreement 0.5 < 0.99)",
                 "--allow-unverified")
    # Allowed, it is laid out and loaded (the test actions' bundle is no qbuild bundle: the runtime says so).
    one_line(cli(project, "run", "alpha", "--prompt", "hi", "--allow-unverified"), 2, "not a qbuild bundle")


def test_lock_update_moves_the_pins_it_can_when_a_locked_recipe_file_is_gone(project):
    (project / "recipes" / "beta.yaml").unlink()
    before = state(project / "artifacts.lock")
    proc = ok(cli(project, "lock", "update"))
    assert f"note: beta: locked from {project / 'recipes' / 'beta.yaml'}, which no longer exists; its pin stays" \
        in proc.stderr
    assert state(project / "artifacts.lock") == before     # path models: no pin moves
    one_line(cli(project, "lock", "update", "beta"), 2, "beta", "no longer exists")


def test_a_recipe_entry_swapped_whole_with_another_recipes_is_refused_by_its_package_inputs(tmp_path):
    """The repository's lockfile, built by the real steps: one recipe's package, bundle and verify swapped with
    another's agree with each other; what gives them away is the package's inputs, the other recipe's graphs."""
    doc = json.loads((REPO / "artifacts.lock").read_text())
    a, b = sorted(doc["recipes"])[:2]
    for field in ("package", "verify"):
        x, y = doc["recipes"][a]["nodes"], doc["recipes"][b]["nodes"]
        x[field], y[field] = y[field], x[field]
    doc["recipes"][a]["bundle"], doc["recipes"][b]["bundle"] = doc["recipes"][b]["bundle"], doc["recipes"][a]["bundle"]
    (tmp_path / "artifacts.lock").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    one_line(cli(tmp_path, "lock", "check"), 2, f"artifacts.lock: $.recipes.{a}.nodes.package: its input ",
             f"is the output of none of {a}'s nodes")
