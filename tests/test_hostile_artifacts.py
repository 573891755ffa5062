"""The hostile corpus, continued: no wrong artifact from the Hub, the lock or a remote.

Each case is a server or a disk that hands a build other bytes than the ones it names: the Hub (tests/hubdouble.py,
a real HTTP server huggingface_hub talks to) serving a file corrupt under its true ETag, or another commit's bytes
under their own honest ETags for a pinned commit; a blob of the HF cache that rotted on disk; a remote (moto's S3
server on loopback) holding another output under a locked key, or a manifest whose blob is gone or replaced. Each
is refused in one line naming the file or the node, or rebuilt; never "cached", never written into the lock.

As in test_hostile_cli, the CLI is the real one with the fast test actions of tests/remote_actions after fetch, so a
recipe builds in about a second; the fetch step, the planner, the engine, the stores and the lock are the real ones.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import blake3
import pytest

from qbuild.store.manifest import Manifest
from tests.hubdouble import HubDouble
from tests.conftest import qbuild
from tests.remote_actions import blob_bytes
from tests.test_hostile_cli import BUCKET, MODULE, blob, env_for, lock_doc, locked, ok, one_line
from tests.test_hostile_cli import s3  # noqa: F401  (the fixture: moto's server with the corpus's bucket)
from tests.test_remote_pipeline import make_project

REPO_ID = "tiny-org/dense"
RECIPE = """name: hubby
model: {{hf: {repo}, revision: {revision}}}
text: {{seq_len: 128, cte_buckets: [32], tkg_buckets: [128]}}
dtype: float32
backend: export
"""


def run(cwd: Path, *args: str, extra: dict | None = None, remote: bool = False) -> subprocess.CompletedProcess:
    """test_hostile_cli's `cli`, with `extra` in the environment (the Hub double's endpoint)."""
    env = {**env_for(cwd, remote), **(extra or {})}
    return subprocess.run([sys.executable, "-m", MODULE, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def error_line(proc: subprocess.CompletedProcess, code: int) -> str:
    """Exit `code`, no traceback, and one `error:` line, the last (after the build's progress lines, when a step
    failed). Returns it."""
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert proc.returncode == code, f"exit {proc.returncode}, want {code}:\n{proc.stderr}"
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert len(errors) == 1 and proc.stderr.strip().splitlines()[-1] == errors[0], proc.stderr
    return errors[0]


def manifests(project: Path) -> list[Path]:
    return sorted((project / "store" / "ac").rglob("*.json")) if (project / "store" / "ac").is_dir() else []


# --- the Hub ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def seed_one(tmp_path_factory) -> Path:
    """The small Qwen3.5 with seed 1's weights: the same files, other bytes."""
    from qbuild.model.tinymodel import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("seed1") / "qwen3_5", "qwen3_5", seed=1)


@pytest.fixture
def hub(small_checkpoints):
    """The Hub double serving the small Qwen3.5 (what `qbuild tiny` writes) as one commit on main."""
    with HubDouble() as double:
        double.add_commit(REPO_ID, small_checkpoints["qwen3_5"])
        yield double


def first_shard(hub: HubDouble) -> str:
    repo = hub.repos[REPO_ID]
    return min(n for n in repo.commits[repo.branches["main"]] if n.endswith(".safetensors"))


def online(hub: HubDouble) -> dict:
    return {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost"}


def hub_project(root: Path, revision: str = "main") -> Path:
    (root / "recipes").mkdir(parents=True)
    (root / "recipes" / "hubby.yaml").write_text(RECIPE.format(repo=REPO_ID, revision=revision))
    return root


def cached_file(project: Path, commit: str, name: str) -> Path:
    return project / ".hf" / "hub" / ("models--" + REPO_ID.replace("/", "--")) / "snapshots" / commit / name


def test_bytes_the_hub_serves_corrupt_under_their_etag_are_refused_and_a_fresh_download_mends_them(hub, tmp_path):
    project = hub_project(tmp_path / "p")
    commit = hub.repos[REPO_ID].branches["main"]
    weights = first_shard(hub)
    hub.flipped = {weights}
    path = cached_file(project, commit, weights)
    line = error_line(run(project, "compile", "recipes/hubby.yaml", "--mem", "1T", extra=online(hub)), 3)
    blob_path = Path(os.path.realpath(path))
    assert f"{path}: its bytes hash to sha256 " in line and f"not the {blob_path.name[:12]} the Hub named" in line
    assert not (project / "artifacts.lock").exists() and manifests(project) == []

    # The corrupt copy stays in the HF cache: the next build refuses it before any step runs, saying what to do.
    hub.flipped = set()
    line = one_line(run(project, "compile", "recipes/hubby.yaml", "--mem", "1T", extra=online(hub)), 3)
    assert line.startswith(f"error: {path}: its bytes hash to sha256 ") and f"remove {blob_path} and run" in line
    assert not (project / "artifacts.lock").exists() and manifests(project) == []
    blob_path.unlink()
    # The real CLI's check of a checkpoint before building leaves a snapshot missing a blob to the fetch step: here
    # --strict gets past it and stops at the first step to build.
    strict = qbuild("compile", "recipes/hubby.yaml", "--strict", cwd=project, env={**env_for(project), **online(hub)})
    assert strict.returncode == 1 and "--strict forbids building it" in strict.stderr, strict.stderr
    ok(run(project, "compile", "recipes/hubby.yaml", "--mem", "1T", extra=online(hub)))
    files = lock_doc(project)["recipes"]["hubby"]["model"]["files"]
    assert files[weights] == f"sha256:{blob_path.name}"


def test_a_blob_that_rots_in_the_hf_cache_is_refused_before_anything_is_built(hub, tmp_path):
    commit = hub.repos[REPO_ID].branches["main"]
    project = hub_project(tmp_path / "p", revision=commit)
    ok(run(project, "compile", "recipes/hubby.yaml", "--mem", "1T", extra=online(hub)))
    lock_before = (project / "artifacts.lock").read_bytes()
    shutil.rmtree(project / "store")
    config = cached_file(project, commit, "config.json")
    blob_path = Path(os.path.realpath(config))
    data = blob_path.read_bytes()
    at = max(i for i, c in enumerate(data) if chr(c).isdigit())     # still JSON, another number: another model
    blob_path.write_bytes(data[:at] + str((int(chr(data[at])) + 1) % 10).encode() + data[at + 1:])
    line = one_line(run(project, "compile", "recipes/hubby.yaml", "--mem", "1T", extra={"HF_HUB_OFFLINE": "1"}), 3)
    assert line.startswith(f"error: {config}: its bytes hash to git-sha1 ")
    assert (project / "artifacts.lock").read_bytes() == lock_before and manifests(project) == []


def test_a_mirror_serving_other_bytes_for_a_pinned_commit_is_refused_until_update_accepts_them(hub, seed_one,
                                                                                               tmp_path):
    weights = first_shard(hub)
    built = hub_project(tmp_path / "built")
    ok(run(built, "compile", "recipes/hubby.yaml", "--mem", "1T", extra=online(hub)))
    commit = hub.repos[REPO_ID].branches["main"]
    good = lock_doc(built)["recipes"]["hubby"]["model"]
    assert good["revision"] == commit and good["files"][weights].startswith("sha256:")

    # A clean machine with the good lock, behind a mirror that serves other weights for the pinned commit, each
    # under its own honest digest.
    machine = tmp_path / "machine"
    shutil.copytree(built / "recipes", machine / "recipes")
    shutil.copyfile(built / "artifacts.lock", machine / "artifacts.lock")
    lock_before = (machine / "artifacts.lock").read_bytes()
    hub.lies[commit] = {weights: (seed_one / weights).read_bytes()}
    line = error_line(run(machine, "compile", "recipes/hubby.yaml", "--mem", "1T", extra=online(hub)), 3)
    assert f"model.hf: {REPO_ID}@{commit[:12]}: {weights}: the Hub served sha256:" in line, line
    assert f"artifacts.lock holds {good['files'][weights][:19]} for this commit" in line, line
    assert (machine / "artifacts.lock").read_bytes() == lock_before and manifests(machine) == []

    # Moving the lock to them is explicit.
    ok(run(machine, "compile", "recipes/hubby.yaml", "--mem", "1T", "--update", extra=online(hub)))
    moved = lock_doc(machine)["recipes"]["hubby"]["model"]
    assert moved["revision"] == commit and moved["files"][weights] != good["files"][weights]


# --- a remote ----------------------------------------------------------------------------------------------------------

@pytest.fixture
def published(tmp_path, s3, request) -> tuple[Path, str, str]:
    """A project built and published under its own prefix; returns (project, prefix, remote URL)."""
    project = make_project(tmp_path / "p")
    ok(run(project, "compile", "--all", "--mem", "1T"))
    prefix = f"artifacts-{request.node.name}".replace("[", "-").replace("]", "")
    url = f"s3://{BUCKET}/{prefix}"
    ok(run(project, "publish", "--all", "--remote", url, remote=True))
    return project, prefix, url


def clean_machine(project: Path, tmp_path: Path) -> Path:
    """The project's recipes, checkpoint and lock on a machine with an empty store."""
    machine = tmp_path / "machine"
    shutil.copytree(project, machine, ignore=shutil.ignore_patterns("store", ".cache"))
    return machine


def _convert_name(project: Path) -> str:
    """The name the plan gives the convert step alpha and beta share."""
    plan = json.loads(ok(run(project, "plan", "--all", "--json")).stdout)
    (name,) = {n["name"] for n in plan["nodes"] if n["kind"] == "convert"}
    return name


def test_a_remote_holding_other_bytes_under_a_locked_key_is_refused_not_cached(published, s3, tmp_path):
    project, prefix, url = published
    convert = locked(project, "alpha", "convert")
    # Another output under the convert step's key, self-consistent (its blob is there, its tree digest right), as a
    # push from a machine whose input was corrupt would have left it.
    bad = blob_bytes("other convert output", 96 << 10)
    digest = blake3.blake3(bad).hexdigest()
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/cas/{digest[:2]}/{digest}", Body=bad)
    outputs = dict(convert["outputs"], **{"weights.safetensors": {"digest": digest, "size": len(bad)}})
    forged = Manifest(convert["key"], "convert", convert["preimage"], outputs)
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/ac/{convert['key'][:2]}/{convert['key']}.json",
                  Body=forged.to_bytes())

    machine = clean_machine(project, tmp_path)
    name = _convert_name(machine)
    lock_before = (machine / "artifacts.lock").read_bytes()
    proc = run(machine, "compile", "--all", "--mem", "1T", "--remote", url, "--json", remote=True)
    error = error_line(proc, 1)
    out = json.loads(proc.stdout)
    assert [f["name"] for f in out["failed"].values()] == [name] and out["built"] == [], out
    assert name not in out["cached"] and out["bundles"] == {"alpha": None, "beta": None}, out
    assert f"{name}: the cached output {forged.digest[:12]} differs from " \
        f"the locked {convert['digest'][:12]} under the same key {convert['key'][:16]}" in error, error
    assert (machine / "artifacts.lock").read_bytes() == lock_before


@pytest.mark.parametrize("damage", ["deleted", "other-size"])
def test_a_remote_entry_whose_blob_is_gone_is_rebuilt_not_cached_and_a_push_mends_it(published, s3, tmp_path, damage):
    project, prefix, url = published
    convert = locked(project, "alpha", "convert")
    meta = convert["outputs"]["weights.safetensors"]
    key = f"{prefix}/cas/{meta['digest'][:2]}/{meta['digest']}"
    if damage == "deleted":
        s3.delete_object(Bucket=BUCKET, Key=key)
    else:
        s3.put_object(Bucket=BUCKET, Key=key, Body=b"not the bytes")

    machine = clean_machine(project, tmp_path)
    lock_before = (machine / "artifacts.lock").read_bytes()
    plan = json.loads(ok(run(machine, "plan", "--all", "--remote", url, "--json", remote=True)).stdout)
    assert {n["status"] for n in plan["nodes"] if n["kind"] == "convert"} == {"build"}
    name = _convert_name(machine)
    out = json.loads(ok(run(machine, "compile", "--all", "--mem", "1T", "--remote", url, "--push", "--json",
                            remote=True)).stdout)
    assert name in out["built"] and name not in out["cached"], out
    assert (machine / "artifacts.lock").read_bytes() == lock_before
    assert blob(machine, meta["digest"]).is_file()
    # The rebuilt entry's push put the blob back.
    assert s3.head_object(Bucket=BUCKET, Key=key)["ContentLength"] == meta["size"]
    again = clean_machine(project, tmp_path / "again")
    out = json.loads(ok(run(again, "compile", "--all", "--mem", "1T", "--remote", url, "--strict", "--json",
                            remote=True)).stdout)
    assert out["built"] == []


# --- a step that builds other bytes under its locked key -------------------------------------------------------------

def test_a_step_rebuilt_into_other_bytes_under_its_locked_key_is_refused_never_stored_nor_pushed(tmp_path, s3):
    """An input the key does not hold changed (tests/remote_actions' convert reads one from the environment, as a
    step reading a file outside its inputs would): the rebuilt output is refused, naming the node and both digests,
    before its worker commits or pushes it, and the lock keeps the locked one; --update accepts it."""
    project = make_project(tmp_path / "p")
    ok(run(project, "compile", "--all", "--mem", "1T"))
    convert = locked(project, "alpha", "convert")
    lock_before = (project / "artifacts.lock").read_bytes()
    entry = project / "store" / "ac" / convert["key"][:2] / f"{convert['key']}.json"
    entry.unlink()
    changed = {"QBUILD_TEST_UNKEYED_INPUT": "something else"}
    prefix = f"refused-{tmp_path.name}"
    line = error_line(run(project, "compile", "--all", "--mem", "1T", "--remote", f"s3://{BUCKET}/{prefix}",
                          "--push", extra=changed, remote=True), 1)
    assert f"{_convert_name(project)}: the built output " in line and \
        f"differs from the locked {convert['digest'][:12]} under the same key {convert['key'][:16]}" in line, line
    assert (project / "artifacts.lock").read_bytes() == lock_before
    # Neither the store nor the remote holds the refused bytes as the key's entry.
    assert not entry.exists()
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/ac/{convert['key'][:2]}/{convert['key']}")
    assert listed.get("KeyCount", 0) == 0, listed
    # So a build whose input is back as it was builds the locked bytes; --update takes the other ones.
    ok(run(project, "compile", "--all", "--mem", "1T"))
    assert (project / "artifacts.lock").read_bytes() == lock_before
    entry.unlink()
    ok(run(project, "compile", "--all", "--mem", "1T", "--update", extra=changed))
    assert locked(project, "alpha", "convert")["digest"] != convert["digest"]


def test_a_shared_step_built_again_for_one_recipe_leaves_the_other_recipes_entry_whole(tmp_path):
    """alpha and beta share their convert step; built again into other bytes for alpha alone (--update accepts them),
    it changes alpha's entry, and beta's, left as it was, keeps the convert its bundle was built from: the lockfile
    still agrees with itself, and beta's bundle is still the one it names."""
    from qbuild.planning import lock as lockmod

    project = make_project(tmp_path / "p")
    ok(run(project, "compile", "--all", "--mem", "1T"))
    convert, beta = locked(project, "alpha", "convert"), lock_doc(project)["recipes"]["beta"]
    (project / "store" / "ac" / convert["key"][:2] / f"{convert['key']}.json").unlink()
    changed = {"QBUILD_TEST_UNKEYED_INPUT": "something else"}
    ok(run(project, "compile", "recipes/alpha.yaml", "--mem", "1T", "--update", extra=changed))
    lockmod.read(project / "artifacts.lock")     # validated: every entry agrees with itself
    doc = lock_doc(project)
    assert locked(project, "alpha", "convert")["digest"] != convert["digest"]
    kept = doc["recipes"]["beta"]
    assert kept["bundle"] == beta["bundle"] and kept["nodes"]["convert"] == f"{beta['nodes']['convert']}@" \
        f"{convert['digest'][:12]}"
    assert doc["nodes"][kept["nodes"]["convert"]] == convert
    assert {role: nid for role, nid in kept["nodes"].items() if role != "convert"} == \
        {role: nid for role, nid in beta["nodes"].items() if role != "convert"}
    # beta's entry holds it to its own convert: the new bytes are refused for it until --update accepts them.
    error_line(run(project, "compile", "recipes/beta.yaml", "--mem", "1T", extra=changed), 1)
    ok(run(project, "compile", "recipes/beta.yaml", "--mem", "1T", "--update", extra=changed))
    assert locked(project, "beta", "convert") == locked(project, "alpha", "convert")
    assert not any("@" in nid for nid in lock_doc(project)["nodes"])
