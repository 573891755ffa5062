"""The S3 remote end to end: real CLI processes, the real planner and engine, moto's S3 server on loopback.

The pipeline is the real one (fetch of a local checkpoint, planner, engine, lockfile); every other step is a small
test-defined action (registered in the CLI process this module starts, never in the pytest process), so a whole
recipe builds in about a second while producing a multi-file bundle that depends on every upstream step.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.s3server import FAKE_CREDENTIALS, s3_env, shared_server
from tests.remote_actions import blob_bytes

# The cases on the module-scoped build `built` run on one worker, so it is built once; the others spread.
ONE_WORKER = pytest.mark.xdist_group("remote-pipeline")

REPO = Path(__file__).resolve().parent.parent
MODULE = "tests.remote_actions"     # the CLI with the test actions registered


# --- a project on disk and a CLI that runs it ----------------------------------------------------------------------

RECIPE = """name: {name}
model: {{path: ../model}}
parallel: {{tp: {tp}}}
text: {{seq_len: 128, cte_buckets: {buckets}, tkg_buckets: [128]}}
dtype: float32
backend: export
"""


def make_project(root: Path) -> Path:
    """A checkpoint directory (a real Qwen3.5 config, placeholder weights) and two recipes sharing it."""
    (root / "model").mkdir(parents=True)
    shutil.copyfile(REPO / "qbuild" / "configs" / "Qwen--Qwen3.5-2B.json", root / "model" / "config.json")
    (root / "model" / "model.safetensors").write_bytes(blob_bytes("weights", 200 << 10))
    (root / "recipes").mkdir()
    write_recipe(root, "alpha", tp=1, buckets=[32, 64])
    write_recipe(root, "beta", tp=2, buckets=[32])
    return root


def make_locked_project(root: Path) -> Path:
    """make_project's recipes (alpha, beta) with a store and an artifacts.lock as a build leaves them, written by
    the store and lockfile libraries instead of a build: per recipe a package step (the bundle: config.json and one
    weight shard per rank, no bundle.json) and a passed verify step. For the cases that need what a lockfile names,
    not the steps that made it."""
    from qbuild.core.hashing import digest_json
    from qbuild.planning import lock as lockmod
    from qbuild.store.local import LocalStore
    from qbuild.store.manifest import Manifest

    make_project(root)
    store = LocalStore(root / "store")
    recipes, nodes = {}, {}
    for name, tp in (("alpha", 1), ("beta", 2)):
        steps = {"package": {"config.json": b'{"family": "qwen3_5"}',
                             **{f"weights/tp{rank}_sharded_checkpoint.safetensors": blob_bytes(f"{name}/{rank}", 4096)
                                for rank in range(tp)}},
                 "verify": {"report.json": json.dumps({"ok": True, "recipe": name}).encode()}}
        roles = {}
        for kind, files in steps.items():
            staging = root / ".staging"
            for rel, data in files.items():
                (staging / rel).parent.mkdir(parents=True, exist_ok=True)
                (staging / rel).write_bytes(data)
            outputs = store.ingest_tree(staging)
            shutil.rmtree(staging)
            # A verify's preimage names the bundle it verified, as a build's does (lock.read checks it).
            inputs = {"bundle": nodes[roles["package"]].digest} if kind == "verify" else {}
            preimage = {"action": kind, "recipe": name, "inputs": inputs}
            manifest = Manifest(digest_json(preimage), kind, preimage, outputs)
            store.put_manifest(manifest)
            roles[kind] = nid = f"n{manifest.key[:15]}"
            nodes[nid] = lockmod.NodeEntry.of(kind, manifest)
        recipes[name] = lockmod.RecipeEntry(recipe=f"recipes/{name}.yaml", model=lockmod.ModelEntry(
            source="path", revision=None, files={}), nodes=roles, bundle=nodes[roles["package"]].digest, verified=True)
    lockmod.write(root / "artifacts.lock", lockmod.Lock(recipes=recipes, nodes=nodes))
    return root


def write_recipe(root: Path, name: str, tp: int, buckets: list[int]) -> None:
    (root / "recipes" / f"{name}.yaml").write_text(RECIPE.format(name=name, tp=tp, buckets=buckets))


def run_qbuild(project: Path, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`qbuild ARGS` in `project`, with the test actions registered, talking to the loopback S3 server."""
    full = dict(env if env is not None else base_env())
    full["PYTHONPATH"] = str(REPO)
    full.setdefault("XDG_CACHE_HOME", str(project / ".cache"))
    return subprocess.run([sys.executable, "-m", MODULE, *args], cwd=project, env=full, capture_output=True,
                          text=True, timeout=timeout)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def base_env() -> dict:
    env = s3_env(shared_server().endpoint)
    env.pop("XDG_CACHE_HOME", None)
    env["HF_HUB_OFFLINE"] = "1"
    return env


def remote_state(client, bucket: str, prefix: str) -> tuple[dict[str, dict], dict[str, int]]:
    """(manifests by key, blob sizes by digest) under s3://bucket/prefix, read straight from the server."""
    manifests, blobs = {}, {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(prefix) + 1:]
            if rel.startswith("ac/"):
                body = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
                manifests[rel.rsplit("/", 1)[1].removesuffix(".json")] = json.loads(body)
            elif rel.startswith("cas/"):
                blobs[rel.rsplit("/", 1)[1]] = obj["Size"]
    return manifests, blobs


def assert_no_dangling_manifest(client, bucket: str, prefix: str) -> None:
    """The remote's invariant: every visible manifest's blobs are all there, with their sizes."""
    manifests, blobs = remote_state(client, bucket, prefix)
    for key, m in manifests.items():
        for rel, meta in m["outputs"].items():
            assert blobs.get(meta["digest"]) == meta["size"], f"manifest {key[:16]} names missing blob of {rel}"


def local_keys(store: Path) -> set[str]:
    return {p.stem for p in (store / "ac").glob("*/*.json")}


def local_blobs(store: Path) -> set[str]:
    return {p.name for p in (store / "cas").glob("*/*")}


def lock_keys(lock: Path) -> set[str]:
    return {n["key"] for n in json.loads(lock.read_text())["nodes"].values()}


# --- fixtures ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def s3():
    server = shared_server()
    client = server.client()
    client.create_bucket(Bucket="qb-pipeline")
    return client


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A project with both recipes built into its own store, and its lockfile."""
    root = make_project(tmp_path_factory.mktemp("project"))
    ok(run_qbuild(root, "compile", "--all", "--store", "store", "--mem", "1T", "-j", "2"))
    return root


@pytest.fixture(scope="module")
def published(built, s3):
    """`built`, published under s3://qb-pipeline/shared."""
    ok(run_qbuild(built, "publish", "--all", "--store", "store", "--remote", "s3://qb-pipeline/shared", "--json"))
    return "s3://qb-pipeline/shared"


# --- tests -----------------------------------------------------------------------------------------------------------

def test_publish_then_pull_into_an_empty_machine(s3, tmp_path):
    project = make_locked_project(tmp_path / "project")
    remote = "s3://qb-pipeline/roundtrip"
    first = json.loads(ok(run_qbuild(project, "publish", "--all", "--store", "store", "--remote", remote,
                                     "--json")).stdout)
    lock = json.loads((project / "artifacts.lock").read_text())
    locked_blobs = {o["digest"]: o["size"] for n in lock["nodes"].values() for o in n["outputs"].values()}
    assert first["bytes_uploaded"] == sum(locked_blobs.values()) and first["manifests_uploaded"] == len(lock["nodes"])
    assert_no_dangling_manifest(s3, "qb-pipeline", "roundtrip")

    second = json.loads(ok(run_qbuild(project, "publish", "--all", "--store", "store", "--remote", remote,
                                      "--json")).stdout)
    assert second["bytes_uploaded"] == 0 and second["blobs_uploaded"] == 0 and second["manifests_uploaded"] == 0

    # A serving host: nothing but the lockfile, an empty store, and the remote.
    host = tmp_path / "host"
    host.mkdir()
    shutil.copyfile(project / "artifacts.lock", host / "artifacts.lock")
    ok(run_qbuild(host, "pull", "alpha", "--to", "bundle", "--store", "store", "--remote", remote))
    package = lock["nodes"][lock["recipes"]["alpha"]["nodes"]["package"]]
    got = {p.relative_to(host / "bundle").as_posix(): p for p in (host / "bundle").rglob("*") if p.is_file()}
    assert set(got) == set(package["outputs"]) and "weights/tp0_sharded_checkpoint.safetensors" in got
    from qbuild.core.hashing import digest_file

    for rel, meta in package["outputs"].items():
        assert digest_file(got[rel]) == meta["digest"]
    # Exactly the bundle came down: one manifest, the package's blobs, nothing of the other steps.
    assert local_keys(host / "store") == {package["key"]}
    assert local_blobs(host / "store") == {o["digest"] for o in package["outputs"].values()}


@ONE_WORKER
@pytest.mark.slow
def test_second_store_reads_through_and_builds_nothing(built, published, tmp_path):
    project = tmp_path / "clone"
    shutil.copytree(built, project, ignore=shutil.ignore_patterns("store"))
    out = json.loads(ok(run_qbuild(project, "compile", "--all", "--strict", "--store", "fresh", "--mem", "1T",
                                   "--remote", published, "--json")).stdout)
    assert out["built"] == [] and out["failed"] == {} and len(out["cached"]) > 0
    assert out["bundles"] == {n: e["bundle"] for n, e in json.loads((built / "artifacts.lock").read_text())
                              ["recipes"].items()}
    # Lookups download no blobs: only what the lockfile writer reads (each fetch step's snapshot.json) came down,
    # and only those fully downloaded entries are recorded locally.
    lock = json.loads((built / "artifacts.lock").read_text())
    fetches = [lock["nodes"][e["nodes"]["fetch"]] for e in lock["recipes"].values()]
    assert local_keys(project / "fresh") == {n["key"] for n in fetches}
    assert local_blobs(project / "fresh") == {o["digest"] for n in fetches for o in n["outputs"].values()}
    # `plan` with the remote only asks it: everything shows as cached, nothing is downloaded.
    plan = json.loads(ok(run_qbuild(project, "plan", "--all", "--store", "empty", "--remote", published,
                                    "--json")).stdout)
    assert {n["status"] for n in plan["nodes"]} == {"cached"} and not (project / "empty" / "ac").exists()
    # The project config and the environment name the remote as well as --remote does.
    (project / "qbuild.yaml").write_text(f"remote: {published}\n")
    out = json.loads(ok(run_qbuild(project, "compile", "--all", "--strict", "--store", "cfg", "--mem", "1T",
                                   "--json")).stdout)
    assert out["built"] == []


def test_strict_names_the_node_it_would_have_to_build(s3, tmp_path):
    project = make_project(tmp_path / "p")
    proc = run_qbuild(project, "compile", "recipes/alpha.yaml", "--strict", "--store", "empty", "--mem", "1T",
                      "--remote", "s3://qb-pipeline/nothing-here")
    assert proc.returncode == 1
    assert "fetch model is not in the store" in proc.stderr and "--strict" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (project / "empty" / "ac").exists()


@ONE_WORKER
@pytest.mark.slow
def test_corrupt_blob_on_the_server_is_refused_and_nothing_is_written(built, published, s3, tmp_path):
    lock = json.loads((built / "artifacts.lock").read_text())
    package = lock["nodes"][lock["recipes"]["beta"]["nodes"]["package"]]
    rel, meta = sorted(package["outputs"].items())[-1]
    prefix = "corrupt"
    ok(run_qbuild(built, "publish", "beta", "--store", "store", "--remote", f"s3://qb-pipeline/{prefix}"))
    bad_key = f"{prefix}/cas/{meta['digest'][:2]}/{meta['digest']}"
    s3.put_object(Bucket="qb-pipeline", Key=bad_key, Body=b"\0" * meta["size"])

    host = tmp_path / "host"
    host.mkdir()
    shutil.copyfile(built / "artifacts.lock", host / "artifacts.lock")
    proc = run_qbuild(host, "pull", "beta", "--to", "bundle", "--store", "store", "--remote",
                      f"s3://qb-pipeline/{prefix}")
    assert proc.returncode == 3, proc.stderr
    assert f"s3://qb-pipeline/{bad_key}" in proc.stderr and rel in proc.stderr and "does not match" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: s3://") and "Traceback" not in proc.stderr
    assert not (host / "bundle").exists() and not list(host.glob(".bundle*"))
    assert package["key"] not in local_keys(host / "store")
    assert meta["digest"] not in local_blobs(host / "store")
    # A fully cached compile does not need that blob, so it never downloads (nor refuses) it.
    clone = tmp_path / "clone"
    shutil.copytree(built, clone, ignore=shutil.ignore_patterns("store"))
    out = json.loads(ok(run_qbuild(clone, "compile", "recipes/beta.yaml", "--store", "s", "--mem", "1T", "--strict",
                                   "--remote", f"s3://qb-pipeline/{prefix}", "--json")).stdout)
    assert out["built"] == [] and meta["digest"] not in local_blobs(clone / "s")


@ONE_WORKER
@pytest.mark.slow
def test_corrupt_input_blob_on_the_server_is_refused_by_the_step_that_needs_it(built, s3, tmp_path):
    """A step that must build downloads its inputs; a corrupt one is refused, naming the object, and nothing of
    it (blob or manifest) is recorded locally."""
    lock = json.loads((built / "artifacts.lock").read_text())
    nodes = {role: lock["nodes"][nid] for role, nid in lock["recipes"]["beta"]["nodes"].items()}
    convert, shard = nodes["convert"], nodes["shard"]
    rel, meta = "weights.safetensors", convert["outputs"]["weights.safetensors"]
    prefix = "corrupt-input"
    ok(run_qbuild(built, "publish", "beta", "--store", "store", "--remote", f"s3://qb-pipeline/{prefix}"))
    bad_key = f"{prefix}/cas/{meta['digest'][:2]}/{meta['digest']}"
    s3.put_object(Bucket="qb-pipeline", Key=bad_key, Body=b"\0" * meta["size"])
    # shard is not on the remote, so it must build, from the converted weights
    s3.delete_object(Bucket="qb-pipeline", Key=f"{prefix}/ac/{shard['key'][:2]}/{shard['key']}.json")

    clone = tmp_path / "clone"
    shutil.copytree(built, clone, ignore=shutil.ignore_patterns("store"))
    proc = run_qbuild(clone, "compile", "recipes/beta.yaml", "--store", "s", "--mem", "1T",
                      "--remote", f"s3://qb-pipeline/{prefix}")
    assert proc.returncode == 3, proc.stderr     # the remote's fault, met by the step that downloads its input
    assert f"s3://qb-pipeline/{bad_key}" in proc.stderr and rel in proc.stderr and "does not match" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert meta["digest"] not in local_blobs(clone / "s")
    assert not {convert["key"], shard["key"], nodes["package"]["key"]} & local_keys(clone / "s")


@ONE_WORKER
@pytest.mark.slow
def test_second_machine_downloads_only_what_it_needs(built, published, tmp_path):
    """A fresh machine compiling a fully built recipe through the remote writes the same lockfile while downloading
    only the fetch step's snapshot.json (what the lockfile writer reads); `pull` then fetches exactly the bundle."""
    lock = json.loads((built / "artifacts.lock").read_text())
    nodes = {role: lock["nodes"][nid] for role, nid in lock["recipes"]["alpha"]["nodes"].items()}
    project = tmp_path / "machine"
    shutil.copytree(built, project, ignore=shutil.ignore_patterns("store", "artifacts.lock"))
    out = json.loads(ok(run_qbuild(project, "compile", "recipes/alpha.yaml", "--store", "s", "--mem", "1T",
                                   "--remote", published, "--json")).stdout)
    assert out["built"] == [] and out["failed"] == {}
    written = json.loads((project / "artifacts.lock").read_text())
    assert written["recipes"]["alpha"] == lock["recipes"]["alpha"]
    assert {nid: written["nodes"][nid] for nid in written["recipes"]["alpha"]["nodes"].values()} == \
        {nid: lock["nodes"][nid] for nid in lock["recipes"]["alpha"]["nodes"].values()}
    snapshot = nodes["fetch"]["outputs"]["snapshot.json"]["digest"]
    assert local_blobs(project / "s") == {snapshot} and local_keys(project / "s") == {nodes["fetch"]["key"]}
    # `lock check` with the remote: entries not local are checked on the remote, still downloading nothing
    ok(run_qbuild(project, "lock", "check", "alpha", "--store", "s", env={**base_env(), "QBUILD_REMOTE": published}))
    assert local_blobs(project / "s") == {snapshot}

    ok(run_qbuild(project, "pull", "alpha", "--to", "bundle", "--store", "s", "--remote", published))
    package = nodes["package"]
    assert local_blobs(project / "s") == {snapshot} | {o["digest"] for o in package["outputs"].values()}
    assert local_keys(project / "s") == {nodes["fetch"]["key"], package["key"]}
    got = {p.relative_to(project / "bundle").as_posix() for p in (project / "bundle").rglob("*") if p.is_file()}
    assert got == set(package["outputs"])
    # a later run hits locally for what came down, and still downloads nothing else
    out = json.loads(ok(run_qbuild(project, "compile", "recipes/alpha.yaml", "--store", "s", "--mem", "1T",
                                   "--remote", published, "--json")).stdout)
    assert out["built"] == [] and local_blobs(project / "s") == \
        {snapshot} | {o["digest"] for o in package["outputs"].values()}


@ONE_WORKER
@pytest.mark.slow
def test_compile_push_uploads_blobs_before_manifests(built, s3, tmp_path):
    project = tmp_path / "p"
    shutil.copytree(built, project, ignore=shutil.ignore_patterns("store", "artifacts.lock"))
    remote = "s3://qb-pipeline/pushed"
    ok(run_qbuild(project, "compile", "recipes/alpha.yaml", "--push", "--store", "s", "--mem", "1T",
                  "--remote", remote))
    manifests, _ = remote_state(s3, "qb-pipeline", "pushed")
    assert set(manifests) == lock_keys(project / "artifacts.lock")
    assert_no_dangling_manifest(s3, "qb-pipeline", "pushed")
    # entries built earlier without --push are uploaded by the next --push run, even though nothing is built
    ok(run_qbuild(project, "compile", "recipes/beta.yaml", "--store", "s", "--mem", "1T"))
    out = json.loads(ok(run_qbuild(project, "compile", "--all", "--push", "--store", "s", "--mem", "1T",
                                   "--remote", remote, "--json")).stdout)
    assert out["built"] == [] and out["pushed"]["manifests_uploaded"] > 0
    manifests, _ = remote_state(s3, "qb-pipeline", "pushed")
    assert set(manifests) == lock_keys(project / "artifacts.lock")
    out = json.loads(ok(run_qbuild(project, "compile", "--all", "--push", "--store", "s", "--mem", "1T",
                                   "--remote", remote, "--json")).stdout)
    assert out["pushed"]["bytes_uploaded"] == 0 and out["pushed"]["manifests_uploaded"] == 0
    lock_text = (project / "artifacts.lock").read_text()
    assert not any(v in lock_text for v in FAKE_CREDENTIALS.values()) and "qb-pipeline" not in lock_text


def test_push_without_a_remote_is_a_user_error(tmp_path):
    project = make_locked_project(tmp_path / "p")
    env = base_env()
    proc = run_qbuild(project, "compile", "--all", "--push", "--store", str(tmp_path / "s"), env=env)
    assert proc.returncode == 2 and "--push needs a remote" in proc.stderr
    proc = run_qbuild(project, "publish", "--all", "--store", "store", "--remote", "https://example.com/x", env=env)
    assert proc.returncode == 2 and "not an s3://bucket/prefix URL" in proc.stderr

