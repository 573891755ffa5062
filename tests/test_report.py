"""`qbuild report`: the page of a built project opened in a real browser (Debian's chromium, driven by Playwright), with
every node of the plan, every verify row and the latency charts, loading nothing from anywhere; the build record it
draws its timeline from; what it says when something is missing; and its refusals of bad input."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import pytest

from qbuild.execution.engine import Event
from qbuild.execution.record import BuildRecorder, read_record, record_path
from qbuild.core.errors import InfraError
from qbuild.render import BuildProgress
from tests.conftest import qbuild

UNVERIFIED = """name: unverified
model: {{path: {model}}}
text: {{seq_len: 48, cte_buckets: [32], tkg_buckets: [48]}}
dtype: float32
backend: export
verify: {{prompts: ["Hi there"], new_tokens: 2, top1_min: 0.99, token_match_min: 1.0, max_logit_err: 1.0e-12}}
"""
WORKER = re.compile(r"^qbuild-worker-\d+ \(pid \d+\)$")


class _Attributes(HTMLParser):
    """Every element's attributes, for reading a page's data-* markers without a browser."""

    def __init__(self, html: str):
        super().__init__()
        self.elements: list[tuple[str, dict]] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))

    def values(self, attribute: str) -> list[str]:
        return [attrs[attribute] for _, attrs in self.elements if attribute in attrs]


def _plan(project: Path, *recipes: str) -> dict:
    args = list(recipes) or ["--all"]
    return json.loads(qbuild("plan", *args, "--json", "--store", "store", cwd=project, check=True).stdout)


# --- a built project, in a browser ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def built(tmp_path_factory, dense_project, small_checkpoints) -> dict:
    """conftest's built tiny-dense project plus "unverified" (an impossible logit threshold), whose build is the last
    one (so it failed its verify); a `qbuild bench` document of tiny-dense; and `qbuild report --all` of both."""
    root = Path(shutil.copytree(dense_project, tmp_path_factory.mktemp("report") / "project", symlinks=True))
    (root / "recipes" / "unverified.yaml").write_text(UNVERIFIED.format(model=small_checkpoints["qwen3_5"]))
    caches = root.with_name("caches")
    env = {"QBUILD_STORE": str(root / "store"), "XDG_CACHE_HOME": str(caches / "xdg"), "HF_HOME": str(caches / "hf"),
           "HF_HUB_CACHE": "", "HF_HUB_OFFLINE": "1", "QBUILD_REMOTE": ""}
    failed = qbuild("compile", "recipes/unverified.yaml", "-j", "2", cwd=root, env=env, timeout=600)
    assert failed.returncode == 1 and "verify failed" in failed.stderr, failed.stderr
    qbuild("bench", "recipes/tiny-dense.yaml", "--repeats", "1", "--warmup", "0", "--new-tokens", "2",
           "--out", "bench.json", cwd=root, env=env, check=True, timeout=600)
    proc = qbuild("report", "--all", "--bench", "bench.json", "--out", "out/report.html", "--json", cwd=root,
                  env=env, check=True, timeout=600)
    return {"root": root, "env": env, "doc": json.loads(proc.stdout), "stderr": proc.stderr,
            "html": (root / "out" / "report.html").read_text()}


def _chromium() -> str:
    """Debian's chromium (Playwright's own browser download cannot be reached); CI installs it (`make install`)."""
    exe = shutil.which("chromium")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed: `make install` installs Debian's chromium package")
        pytest.skip("Debian's chromium package is not installed (`make install` installs it as root)")
    return exe


def _verify_report(root: Path, recipe: str) -> dict:
    """The verify step's report.json of a locked recipe, read from the store."""
    lock = json.loads((root / "artifacts.lock").read_text())
    digest = lock["nodes"][lock["recipes"][recipe]["nodes"]["verify"]]["outputs"]["report.json"]["digest"]
    return json.loads((root / "store" / "cas" / digest[:2] / digest).read_text())


@pytest.mark.slow
@pytest.mark.xdist_group("report")
def test_the_report_opens_in_chromium_with_every_node_and_verify_row(built, tmp_path):
    from playwright.sync_api import sync_playwright

    root = built["root"]
    plan = _plan(root)
    passed = _verify_report(root, "tiny-dense")
    page_url = (root / "out" / "report.html").resolve().as_uri()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=_chromium())
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            problems, requests = [], []
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type in (
                "error", "warning") else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(page_url, wait_until="load")
            # Every node of the plan: a box in the drawn DAG and a row of the node table, each showing its name.
            for node in plan["nodes"]:
                box = page.locator(f'#dag svg g[id="node-{node["id"]}"]')
                assert box.is_visible(), node["name"]
                assert node["name"] in box.text_content()    # an SVG element has no innerText
                row = page.locator(f'#nodes-table tr[data-node-id="{node["id"]}"]')
                assert row.is_visible() and row.get_attribute("data-status") == node["status"]
                assert node["name"] in row.inner_text() and (node["key"] or "-")[:16] in row.inner_text()
            # All cached but the failed verify, which would be built again.
            statuses = {n["name"]: n["status"] for n in plan["nodes"]}
            assert statuses.pop("verify unverified") == "build" and set(statuses.values()) == {"cached"}
            # Every verify row: the passed recipe's prompts and metrics against their thresholds; the failed one's
            # reason.
            ok = page.locator('article.verify[data-recipe="tiny-dense"]')
            assert "passed" in ok.locator("h3").inner_text()
            for prompt in passed["prompts"]:
                row = ok.locator(f'tr[data-prompt="{prompt["index"]}"]')
                assert row.is_visible() and prompt["text"] in row.inner_text()
            for metric in ("top1", "token_match", "max_logit_err"):
                row = ok.locator(f'tr[data-metric="{metric}"]')
                assert row.is_visible() and "pass" in row.inner_text()
            assert ok.locator('tr[data-metric="top1"]').inner_text().split("\t")[2] == ">= 0.99"
            bad = page.locator('article.verify[data-recipe="unverified"]')
            assert "failed" in bad.locator("h3").inner_text()
            assert "max |logit error|" in bad.locator(".problem").inner_text()
            # The last build's steps, and both latency charts.
            assert page.locator('#timeline-table tr[data-outcome="failed"]').count() == 1
            for metric in ("ttft_ms", "tpot_ms"):
                box = page.locator(f'figure[data-chart="{metric}"] svg').bounding_box()
                assert box is not None and box["width"] > 300 and box["height"] > 200, metric
            shot = tmp_path / "report.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert problems == []
    assert requests == [page_url]      # self-contained: no script, style, font or image from anywhere
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.xdist_group("report")
def test_the_report_json_names_the_page_and_what_it_shows(built):
    doc = built["doc"]
    assert doc["report"] == str((built["root"] / "out" / "report.html").resolve())
    assert doc["recipes"] == ["tiny-dense", "unverified"] and doc["bench"] == 1 and doc["serve"] == 0
    assert doc["notes"] == []
    assert doc["verify"] == {"tiny-dense": "passed", "unverified": "failed"}
    assert doc["nodes"] == len(_plan(built["root"])["nodes"])
    assert built["stderr"] == ""


@pytest.mark.slow
@pytest.mark.xdist_group("report")
def test_the_build_record_times_each_step_and_names_its_worker(built, monkeypatch):
    """The last build (the unverified recipe's) is recorded for the lockfile: what it found in the store, what it
    built, on which local worker, and the failure; the page's timeline shows exactly those steps."""
    root = built["root"]
    monkeypatch.setenv("XDG_CACHE_HOME", built["env"]["XDG_CACHE_HOME"])   # where the fixture's builds recorded
    record, note = read_record(root / "artifacts.lock")
    assert note is None and record["lockfile"] == "artifacts.lock" and not record["interrupted"]
    steps = {s["name"]: s for s in record["steps"]}
    plan = {n["name"]: n for n in _plan(root, "recipes/unverified.yaml")["nodes"]}
    assert set(steps) == set(plan)
    assert steps["verify unverified"]["outcome"] == "failed" and "verify failed" in steps["verify unverified"]["error"]
    assert WORKER.match(steps["verify unverified"]["worker"]), steps["verify unverified"]   # a failure's worker too
    for name, step in steps.items():
        assert record["started"] <= step["start"] <= step["end"] <= record["ended"], name
        if step["outcome"] == "built":
            assert WORKER.match(step["worker"]), step
        if step["outcome"] == "cached":    # shared with tiny-dense: its build was the fixture project's
            assert step["worker"] is None and step["built_seconds"] > 0, step
    assert {s["outcome"] for s in steps.values()} == {"cached", "built", "failed"}
    page = _Attributes(built["html"])
    assert sorted(page.values("data-step-id")) == sorted(plan[name]["id"] for name in steps)


@pytest.mark.slow
@pytest.mark.xdist_group("report")
def test_a_build_refused_before_its_first_step_leaves_the_record_as_it_was(built, tmp_path, small_checkpoints,
                                                                          monkeypatch):
    """A checkpoint without weights plans, and is refused when the build checks it, before any step starts."""
    monkeypatch.setenv("XDG_CACHE_HOME", built["env"]["XDG_CACHE_HOME"])
    project = Path(shutil.copytree(built["root"], tmp_path / "project", symlinks=True))
    record_path(project / "artifacts.lock").write_bytes(record_path(built["root"] / "artifacts.lock").read_bytes())
    before = record_path(project / "artifacts.lock").read_bytes()
    empty = tmp_path / "no-weights"
    empty.mkdir()
    shutil.copy(small_checkpoints["qwen3_5"] / "config.json", empty / "config.json")
    (project / "recipes" / "broken.yaml").write_text(UNVERIFIED.replace("unverified", "broken").format(model=empty))
    proc = qbuild("compile", "recipes/broken.yaml", cwd=project,
                  env={**built["env"], "QBUILD_STORE": str(project / "store")})
    assert proc.returncode == 2 and "no-weights" in proc.stderr, proc.stderr
    assert record_path(project / "artifacts.lock").read_bytes() == before


# --- without a build, without dot -------------------------------------------------------------------------------

@pytest.fixture
def unbuilt(tmp_path, small_checkpoints) -> Path:
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "plain.yaml").write_text(UNVERIFIED.replace("unverified", "plain").format(
        model=small_checkpoints["qwen3_5"]))
    return tmp_path


def test_a_report_before_any_build_lists_every_node_and_says_what_is_missing(unbuilt):
    proc = qbuild("report", "recipes/plain.yaml", "--store", "store", "--out", "r.html", cwd=unbuilt)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{(unbuilt / 'r.html').resolve()}\n"
    assert proc.stderr.startswith("note: no build recorded for artifacts.lock yet"), proc.stderr
    html = (unbuilt / "r.html").read_text()
    page = _Attributes(html)
    plan = _plan(unbuilt, "recipes/plain.yaml")
    ids = [n["id"] for n in plan["nodes"]]
    assert page.values("data-node-id") == ids
    assert sorted(i.removeprefix("node-") for i in page.values("id") if i.startswith("node-")) == sorted(ids)
    assert page.values("data-status") == [n["status"] for n in plan["nodes"]]
    assert 'id="timeline-note"' in html and 'id="bench-note"' in html and 'id="serve-note"' in html
    assert '<span class="badge none">not verified</span>' in html


def test_without_dot_the_page_is_written_with_the_node_table_and_says_why(unbuilt):
    venv_only = str(Path(sys.executable).parent)    # no /usr/bin: Graphviz's dot is not found
    assert shutil.which("dot", path=venv_only) is None
    proc = qbuild("report", "recipes/plain.yaml", "--store", "store", "--out", "r.html", cwd=unbuilt,
                  env={"PATH": venv_only})
    assert proc.returncode == 0, proc.stderr
    assert "note: the DAG is not drawn: Graphviz's `dot` is not on PATH" in proc.stderr
    page = _Attributes((unbuilt / "r.html").read_text())
    assert len(page.values("data-node-id")) == len(_plan(unbuilt, "recipes/plain.yaml")["nodes"])
    assert "dag-note" in page.values("id") and not [i for i in page.values("id") if i.startswith("node-")]


# --- refusals --------------------------------------------------------------------------------------------------

BENCH_POINT = {"prompt_len": 16, "cte_bucket": 32, "ttft_ms": {"median": 1.5}, "tpot_ms": {"median": 0.5}}


@pytest.mark.parametrize("content, field", [
    ("{not json", "not a JSON document"),
    (json.dumps({"backend": "export"}), "points: expected the non-empty list"),
    (json.dumps({"points": [BENCH_POINT, {**BENCH_POINT, "prompt_len": "64"}]}), "points[1].prompt_len"),
    (json.dumps({"points": [{**BENCH_POINT, "tpot_ms": {"median": "fast"}}]}), "points[0].tpot_ms.median"),
])
def test_a_bad_bench_document_is_refused_naming_the_field_and_nothing_is_written(unbuilt, content, field):
    (unbuilt / "bench.json").write_text(content)
    proc = qbuild("report", "recipes/plain.yaml", "--bench", "bench.json", "--out", "r.html", cwd=unbuilt)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: bench.json: ") and field in line, line
    assert not (unbuilt / "r.html").exists() and not (unbuilt / "store").exists()


SERVE_DOC = {"model": "dense-tp2-long", "url": "http://127.0.0.1:8000/v1",
             "long_prompt": {"tokens": 448, "cold_ms": 260.5, "warm_ms": 26.0, "cold_cached_tokens": 0,
                             "warm_cached_tokens": 416, "same_answer": True},
             "image": {"size": [128, 96], "question": "What is in this picture?", "answer": "<b>noise</b>",
                       "prompt_tokens": 47, "completion_tokens": 16}}


def test_requests_to_qbuild_serve_are_shown_cold_warm_and_with_an_image(unbuilt):
    """`--serve`: the long prompt's cold and warm requests (cached tokens, time to the first token, the ratio) and the
    image chat's answer, escaped as text; `--json` counts the document."""
    (unbuilt / "serve.json").write_text(json.dumps(SERVE_DOC))
    proc = qbuild("report", "recipes/plain.yaml", "--serve", "serve.json", "--out", "r.html", "--json", cwd=unbuilt)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["serve"] == 1
    html = (unbuilt / "r.html").read_text()
    page = _Attributes(html)
    assert page.values("data-model") == ["dense-tp2-long"] and page.values("data-request") == ["cold", "warm", "image"]
    rows = {m[0]: m[1] for m in re.findall(r'<tr data-request="(\w+)">(.*?)</tr>', html, re.S)}
    assert ">0<" in rows["cold"] and "260.5 ms" in rows["cold"] and "the same token" in rows["cold"]
    assert ">416<" in rows["warm"] and "26.0 ms" in rows["warm"] and "10.0x faster" in rows["warm"]
    assert "128x96 pixels" in rows["image"] and "&lt;b&gt;noise&lt;/b&gt;" in rows["image"]
    assert 'id="serve-note"' not in html


@pytest.mark.parametrize("doc, field", [
    ({k: v for k, v in SERVE_DOC.items() if k != "image"}, "image: expected an object with size, question"),
    ({**SERVE_DOC, "long_prompt": {**SERVE_DOC["long_prompt"], "warm_ms": 0}}, "long_prompt.warm_ms: expected a "
                                                                                "positive number"),
    ({**SERVE_DOC, "long_prompt": {**SERVE_DOC["long_prompt"], "warm_cached_tokens": True}},
     "long_prompt.warm_cached_tokens: expected a whole number of tokens"),
    ({**SERVE_DOC, "image": {**SERVE_DOC["image"], "size": [128]}}, "image.size: expected [width, height]"),
    ([SERVE_DOC], "$: expected an object with model, url"),
])
def test_a_bad_serve_document_is_refused_naming_the_field_and_nothing_is_written(unbuilt, doc, field):
    (unbuilt / "serve.json").write_text(json.dumps(doc))
    proc = qbuild("report", "recipes/plain.yaml", "--serve", "serve.json", "--out", "r.html", cwd=unbuilt)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: serve.json: ") and field in line, line
    assert not (unbuilt / "r.html").exists() and not (unbuilt / "store").exists()


def test_without_recipes_or_a_lockfile_the_report_is_refused(tmp_path):
    proc = qbuild("report", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == ("error: artifacts.lock: no lockfile; name recipe files, pass --all, or point "
                                   "--lock at a lockfile")
    assert list(tmp_path.iterdir()) == []


# --- the recorder ------------------------------------------------------------------------------------------------

class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def _node(nid: str, kind: str = "compile"):
    return SimpleNamespace(id=nid, name=f"{kind} {nid}", kind=kind)


def _manifest(**meta):
    return SimpleNamespace(meta=meta)


def test_the_recorder_keeps_each_steps_outcome_times_and_worker(tmp_path):
    rec = BuildRecorder(tmp_path / "artifacts.lock", clock=_Clock())      # started at 101
    a, b, c, d, e = (_node(x) for x in "abcde")
    for event in (Event("cached", a, _manifest(seconds=4.5)),                                   # 102
                  Event("start", b), Event("start", c),                                        # 103, 104
                  Event("corrupt", c, error="input blob was corrupt"), Event("start", c),      # 105, 106
                  Event("built", b, _manifest(worker="qbuild-worker-0 (pid 7)"), seconds=5.0),  # 107
                  Event("failed", c, error="compile c: boom"),                                 # 108
                  Event("skipped", d, error="input compile c failed"),                         # 109
                  Event("start", e)):                                                          # 110
        rec.on_event(event)
    doc = rec.to_json(interrupted=True)                                                        # ended 111
    steps = {s["id"]: s for s in doc["steps"]}
    assert [s["id"] for s in doc["steps"]] == ["a", "b", "c", "d", "e"]
    assert (doc["started"], doc["ended"], doc["interrupted"]) == (101.0, 111.0, True)
    assert (steps["a"]["outcome"], steps["a"]["start"], steps["a"]["end"], steps["a"]["worker"],
            steps["a"]["built_seconds"]) == ("cached", 102.0, 102.0, None, 4.5)
    assert (steps["b"]["outcome"], steps["b"]["start"], steps["b"]["end"], steps["b"]["worker"]) == \
        ("built", 103.0, 107.0, "qbuild-worker-0 (pid 7)")
    assert (steps["c"]["outcome"], steps["c"]["start"], steps["c"]["end"], steps["c"]["retries"],
            steps["c"]["error"]) == ("failed", 106.0, 108.0, 1, "compile c: boom")
    assert (steps["d"]["outcome"], steps["d"]["error"]) == ("skipped", "input compile c failed")
    assert (steps["e"]["outcome"], steps["e"]["end"]) == ("interrupted", None)


def test_the_record_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    lock = tmp_path / "artifacts.lock"
    first = BuildRecorder(lock, clock=_Clock())
    first.on_event(Event("cached", _node("a"), _manifest()))
    first.write(interrupted=False)
    second = BuildRecorder(lock, clock=_Clock())
    second.on_event(Event("cached", _node("b"), _manifest()))

    def no_room(fd):
        raise OSError(28, "No space left on device")

    # A write that fails before its rename (here: the data never reaches the disk) leaves the last record whole.
    with monkeypatch.context() as patched, pytest.raises(InfraError, match="no space left"):
        patched.setattr(os, "fsync", no_room)
        second.write(interrupted=False)
    assert [s["id"] for s in read_record(lock)[0]["steps"]] == ["a"]
    assert [p.name for p in record_path(lock).parent.iterdir()] == [record_path(lock).name]   # no partial file left
    second.write(interrupted=False)      # the last writer wins
    assert [s["id"] for s in read_record(lock)[0]["steps"]] == ["b"]


def test_a_record_that_cannot_be_written_is_a_warning_not_a_failure(tmp_path, capsys):
    lock = tmp_path / "artifacts.lock"
    record_path(lock).parent.parent.mkdir(parents=True, exist_ok=True)
    record_path(lock).parent.write_text("a file where the record's directory would be")
    with BuildProgress(lock=tmp_path / "artifacts.lock") as progress:
        progress.on_event(Event("cached", _node("a"), _manifest()))
    err = capsys.readouterr().err
    assert err.startswith("warning: the build record was not written: "), err


def test_a_command_refused_before_any_step_writes_no_record(tmp_path):
    with pytest.raises(RuntimeError):
        with BuildProgress(lock=tmp_path / "artifacts.lock"):
            raise RuntimeError("refused before the build started")
    assert not record_path(tmp_path / "artifacts.lock").exists() and sorted(tmp_path.iterdir()) == []


@pytest.mark.parametrize("content", ["{torn", json.dumps({"version": 99, "steps": []}), json.dumps([1])])
def test_an_unreadable_record_is_shown_as_absent_with_the_reason(tmp_path, content):
    lock = tmp_path / "artifacts.lock"
    record_path(lock).parent.mkdir(parents=True)
    record_path(lock).write_text(content)
    record, note = read_record(lock)
    assert record is None and note.startswith(f"{record_path(lock)}: ")


def test_a_tokens_only_verify_is_summarized_by_its_first_tokens():
    """A bundle that returns tokens only (on-device sampling): the report's top-1 counts each prompt's first token
    once, as the verify gate does, so one long prompt that is right does not outweigh four short ones that are wrong,
    and the page names the metric and the logit gate that was not applied."""
    from qbuild.report.data import VerifyTable, summarize

    def prompt(i: int, tokens: int, right: bool) -> dict:
        return {"index": i, "text": "p", "image": False, "tokens": tokens, "top1": float(right), "max_logit_err": None,
                "token_match": 1.0 if right else 0.6, "first_mismatch": None if right else 0,
                "greedy": [7 if right else 6], "reference": [7]}

    report = {"ok": False, "thresholds": {"top1_min": 0.9, "token_match_min": 0.6, "max_logit_err": 1e-3},
              "prompts": [prompt(0, 400, True), *(prompt(i, 10, False) for i in range(1, 5))],
              "logit_gate": "not applied (tokens only)"}
    summary = summarize(report)
    assert summary["top1"] == (pytest.approx(0.2), 0.9, False) and summary["max_logit_err"] == (None, 1e-3, None)
    assert VerifyTable("r", "n", "verify r", report, "store").tokens_only
    report["prompts"][0]["max_logit_err"] = 0.0
    assert not VerifyTable("r", "n", "verify r", report, "store").tokens_only
