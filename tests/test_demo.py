"""`make demo`: what it installs and runs, and the tiny recipes it serves. The requests its last step sends
(demo/serve_client.py) are tested against a served long-prompt VL bundle in tests/test_long_context.py, and the report
that shows them in tests/test_report.py."""

from __future__ import annotations

import subprocess

import yaml

from tests.conftest import REPO

FAMILIES = {"qwen3_5", "qwen3_5_moe", "qwen3_next"}


def _dry_run(target: str) -> str:
    """The commands `make TARGET` would run (`make -n` runs none of them)."""
    proc = subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_the_demo_installs_graphviz_and_no_browser_and_the_test_lane_installs_chromium():
    demo, test = _dry_run("demo"), _dry_run("test")
    assert "for p in graphviz;" in demo and "chromium" not in demo
    assert "for p in chromium;" in test


def test_the_demo_serves_the_long_prompt_recipe_to_its_client_and_reports_what_it_got():
    demo = _dry_run("demo")
    assert "qbuild serve recipes/tiny/dense-tp2-long.yaml" in demo
    assert 'demo/serve_client.py "$(cat .qbuild/serve.url)" --out .qbuild/serve-demo.json' in demo
    assert "--serve .qbuild/serve-demo.json" in demo


def test_each_family_has_a_tiny_recipe_with_chunked_prefill_and_the_prefix_cache():
    """One `-long` recipe per family (every family qbuild knows chunks and caches on the CPU backends), each a tiny
    recipe whose prompts run past its context bucket in pieces, with a prefix cache."""
    families = {}
    for path in sorted((REPO / "recipes" / "tiny").glob("*-long.yaml")):
        recipe = yaml.safe_load(path.read_text())
        text = recipe["text"]
        assert "chunked_prefill" in text and "prefix_cache" in text, path.name
        assert text["seq_len"] > max(text["cte_buckets"]), path.name
        families[path.name] = recipe["model"]["path"].rsplit("/", 1)[-1]
    assert sorted(families.values()) == sorted(FAMILIES), families
    assert "vision" in yaml.safe_load((REPO / "recipes" / "tiny" / "dense-tp2-long.yaml").read_text())
