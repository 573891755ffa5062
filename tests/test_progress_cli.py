"""Progress as a user sees it, through the real CLI: `--progress json` events of a tiny build from a Hub (the real
HTTP double, tests/hubdouble.py) with byte counts for the download and the shards written, and no bar of
huggingface_hub's own; rich's live rows with bytes on a pseudo-terminal; byte events of publish and pull against the
loopback S3 server (tests/s3server.py); and the compile cache's transfers (docs/progress.md)."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qbuild.hub.hf import CHECKPOINT_PATTERNS
from tests.conftest import REPO, qbuild
from tests.hubdouble import HubDouble

REPO_ID = "tiny-org/dense"
HUB_RECIPE = """name: hubby
model: {{hf: {repo}, revision: main}}
text: {{seq_len: 48, cte_buckets: [32], tkg_buckets: [48]}}
dtype: float32
backend: export
verify: {{prompts: ["Hello"], new_tokens: 2, top1_min: 0.99, token_match_min: 1.0, max_logit_err: 0.001}}
"""
ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]")
PTY_TIMEOUT_S = 600     # a hang guard only


def events(stderr: str) -> list[dict]:
    """Every line of stderr, each a JSON object (with --progress json nothing else is written there on success)."""
    return [json.loads(line) for line in stderr.splitlines()]


def progress_of(evs: list[dict], step: str, what: str) -> list[dict]:
    return [e for e in evs if e["event"] == "progress" and e["step"] == step and e["what"] == what]


def assert_complete(reports: list[dict], total: int) -> None:
    """Byte reports that climb to `total` and end there, with a rate."""
    assert reports, "no progress reported"
    assert all(r["unit"] == "B" and r["total"] == total for r in reports), reports
    assert [r["done"] for r in reports] == sorted(r["done"] for r in reports)
    assert reports[-1]["done"] == total and isinstance(reports[-1]["rate"], (int, float))


# --- a build from the Hub, as JSON events -------------------------------------------------------------------------

@pytest.mark.slow
def test_json_progress_of_a_hub_build_counts_the_download_and_the_shards_and_draws_no_hf_bars(tmp_path,
                                                                                           small_checkpoints):
    checkpoint = small_checkpoints["qwen3_5"]
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "hubby.yaml").write_text(HUB_RECIPE.format(repo=REPO_ID))
    with HubDouble() as hub:
        hub.add_commit(REPO_ID, checkpoint)
        # TQDM_POSITION=-1 forces huggingface_hub's own bars on (utils/tqdm.py `is_tqdm_disabled`, 2.4.0): they would
        # land in the step's output, which -v shows.
        env = {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "NO_PROXY": "127.0.0.1,localhost",
               "no_proxy": "127.0.0.1,localhost", "TQDM_POSITION": "-1"}
        proc = qbuild("compile", "recipes/hubby.yaml", "--json", "--progress", "json", "-v", "-j", "2",
                      cwd=tmp_path, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout)          # stdout stays the result document
        assert result["ok"] and len(result["built"]) == 8
        evs = events(proc.stderr)

        served = sum(p.stat().st_size for p in checkpoint.iterdir() if any(p.match(g) for g in CHECKPOINT_PATTERNS))
        assert_complete(progress_of(evs, "fetch", "download"), served)
        (shard,) = [e for e in evs if e["event"] == "built" and e["step"] == "shard"]
        shard_bytes = progress_of(evs, "shard", "write")
        assert_complete(shard_bytes, shard_bytes[-1]["total"])
        assert shard_bytes[-1]["total"] > 0 and {e["id"] for e in shard_bytes} == {shard["id"]}
        # Each step's reports come before its built event.
        assert max(evs.index(e) for e in shard_bytes) < evs.index(shard)
        compiles = [e for e in evs if e["event"] == "progress" and e["step"] == "compile"]
        assert compiles and all(e["unit"] == "s" and e["rate"] is None for e in compiles)
        assert evs[-1]["event"] == "summary" and evs[-1]["built"] == 8

        (fetch,) = [e for e in evs if e["event"] == "built" and e["step"] == "fetch"]
        bars = [line for line in fetch.get("output", []) if "Fetching" in line or "Downloading" in line
                or "Reconstructing" in line or "it/s" in line]
        assert bars == [] and "Fetching" not in proc.stderr

        # The progress mode moves no key: another mode builds nothing and changes nothing.
        again = qbuild("compile", "recipes/hubby.yaml", "--json", "--frozen", "--progress", "plain", cwd=tmp_path,
                       env=env, timeout=600)
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout)["built"] == []


# --- rich's rows on a terminal ------------------------------------------------------------------------------------

def _on_a_terminal(args: list[str], cwd: Path) -> tuple[int, str]:
    """`qbuild ARGS` with stdin, stdout and stderr on a pseudo-terminal: (exit code, what the terminal got, without
    its control sequences)."""
    master, slave = pty.openpty()
    env = dict(os.environ, TERM="xterm-256color", COLUMNS="200", LINES="50", PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "qbuild.cli", *args], cwd=cwd, env=env, stdin=slave,
                            stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    got = b""
    deadline = time.monotonic() + PTY_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                continue
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:          # EIO: the child closed the terminal
                break
            if not chunk:
                break
            got += chunk
    finally:
        os.close(master)
        code = proc.wait(timeout=60)
    return code, ANSI.sub(b"", got).decode("utf-8", "replace")


@pytest.mark.slow
def test_a_terminal_shows_rich_rows_with_the_bytes_a_step_wrote(tmp_path, dense_project):
    project = Path(shutil.copytree(dense_project, tmp_path / "project"))
    lock = json.loads((project / "artifacts.lock").read_text())
    key = lock["nodes"][lock["recipes"]["tiny-dense"]["nodes"]["shard"]]["key"]
    (project / "store" / "ac" / key[:2] / f"{key}.json").unlink()       # the shard step runs again
    code, screen = _on_a_terminal(["compile", "--all", "--store", "store"], project)
    assert code == 0, screen
    row = re.search(r"shard cpu 1 rank: write .*?(\d+\.\d (?:KiB|MiB))/(\d+\.\d (?:KiB|MiB)) +\S+ (?:KiB|MiB)/s", screen)
    assert row is not None, screen
    assert "1 built" in screen


# --- publish and pull against S3 -------------------------------------------------------------------------------

def test_publish_and_pull_report_their_bytes_as_json_events(tmp_path):
    """`--progress json`: every line of stderr is a JSON object, byte reports climbing to the total, a note (a recipe
    changed since it was locked) and the closing summary among them; the summary is what --json prints on stdout."""
    from tests.test_remote_pipeline import make_locked_project, ok, run_qbuild
    from tests.s3server import shared_server

    client = shared_server().client()
    if "qb-progress" not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
        client.create_bucket(Bucket="qb-progress")
    remote = f"s3://qb-progress/{tmp_path.name}"
    project = make_locked_project(tmp_path / "project")
    lock = json.loads((project / "artifacts.lock").read_text())
    blobs = {o["digest"]: o["size"] for n in lock["nodes"].values() for o in n["outputs"].values()}

    published = ok(run_qbuild(project, "publish", "--all", "--store", "store", "--remote", remote, "--json",
                              "--progress", "json"))
    uploads = progress_of(events(published.stderr), "publish", "upload")
    assert_complete(uploads, sum(blobs.values()))
    assert all(e["node"] is None and e["id"] is None for e in uploads)
    assert json.loads(published.stdout)["bytes_uploaded"] == sum(blobs.values())

    host = tmp_path / "host"
    host.mkdir()
    shutil.copyfile(project / "artifacts.lock", host / "artifacts.lock")
    pulled = ok(run_qbuild(host, "pull", "alpha", "--to", "bundle", "--store", "store", "--remote", remote,
                           "--progress", "json"))
    package = lock["nodes"][lock["recipes"]["alpha"]["nodes"]["package"]]
    pulled_events = events(pulled.stderr)   # JSON lines only: the summary too (it was a plain line)
    downloads = progress_of(pulled_events, "pull", "download")
    size = sum({o["digest"]: o["size"] for o in package["outputs"].values()}.values())
    assert_complete(downloads, size)
    assert pulled_events[-1] == {"event": "summary", "step": "pull", "recipe": "alpha", "dir": "bundle",
                                 "digest": package["digest"], "files": len(package["outputs"]), "bytes": size}
    assert pulled.stdout == ""

    again = ok(run_qbuild(project, "publish", "--all", "--store", "store", "--remote", remote, "--progress", "json"))
    summary = events(again.stderr)[-1]
    assert summary["event"] == "summary" and summary["step"] == "publish" and summary["blobs_uploaded"] == 0
    assert summary["recipes"] == ["alpha", "beta"] and summary["remote"] == remote

    # in the project, whose recipe files are not what its lock was built from: the note is an event too
    noted = ok(run_qbuild(project, "pull", "alpha", "--to", "noted", "--store", "store", "--progress", "json"))
    notes = [e for e in events(noted.stderr) if e["event"] == "note"]
    assert len(notes) == 1 and notes[0]["step"] == "pull" and notes[0]["message"].startswith("alpha")
