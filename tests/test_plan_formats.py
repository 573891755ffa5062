"""`qbuild plan --format tree|json|dot|mermaid`: --json is --format json; the dot text is a graph Graphviz lays out with
every node and edge of the plan; the Mermaid text is a well-formed flowchart of the same graph (checked by its
structure: there is no Mermaid renderer here)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.conftest import qbuild

RECIPE = """\
name: {name}
model: {{path: {path}}}
parallel: {{tp: {tp}}}
text: {{seq_len: 128, cte_buckets: [32, 64]}}
dtype: float32
backend: export
"""
SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture
def recipes(tmp_path, small_checkpoints) -> list[Path]:
    """Two recipes of one checkpoint (tp1, tp2: they share fetch, convert, reference and the compiles), whose
    directory name holds every character the dot and Mermaid syntaxes give a meaning to: the fetch node's name
    carries it."""
    ck = tmp_path / 'ck "quoted" <b>#1 \\ back'
    shutil.copytree(small_checkpoints["qwen3_5"], ck)
    files = []
    for tp in (1, 2):
        f = tmp_path / f"r-tp{tp}.yaml"
        f.write_text(RECIPE.format(name=f"r-tp{tp}", path=json.dumps(str(ck)), tp=tp))
        files.append(f)
    return files


def _plan_json(recipes: list[Path], *flags: str) -> dict:
    return json.loads(qbuild("plan", *flags, *map(str, recipes), check=True).stdout)


def _edges(doc: dict) -> set[tuple[str, str]]:
    return {(dep, n["id"]) for n in doc["nodes"] for dep in n["deps"].values()}


def test_json_is_an_alias_of_format_json_and_tree_the_default(recipes):
    as_json = qbuild("plan", "--json", *map(str, recipes), check=True).stdout
    assert qbuild("plan", "--format", "json", *map(str, recipes), check=True).stdout == as_json
    tree = qbuild("plan", *map(str, recipes), check=True, env={"COLUMNS": "200"}).stdout
    assert qbuild("plan", "--format", "tree", *map(str, recipes), check=True, env={"COLUMNS": "200"}).stdout == tree
    assert "verify r-tp1" in tree and not tree.startswith("{")


def test_json_with_another_format_is_refused(recipes):
    proc = qbuild("plan", "--json", "--format", "dot", *map(str, recipes))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == ["error: --json and --format dot: --json is --format json; give one "
                                                "of them"]


def test_an_unknown_format_is_a_usage_error_naming_the_choices(recipes):
    proc = qbuild("plan", "--format", "svg", *map(str, recipes))
    assert proc.returncode == 2 and "Invalid value for '--format'" in proc.stderr
    for choice in ("tree", "json", "dot", "mermaid"):
        assert repr(choice) in proc.stderr, proc.stderr


def test_dot_output_is_laid_out_by_graphviz_with_every_node_and_edge(recipes):
    doc = _plan_json(recipes, "--json")
    dot_text = qbuild("plan", "--format", "dot", *map(str, recipes), check=True).stdout
    proc = subprocess.run(["dot", "-Tsvg"], input=dot_text, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    svg = ET.fromstring(proc.stdout)
    drawn = {g.get("id"): g for g in svg.iter(f"{SVG}g") if "node" in (g.get("class") or "").split()}
    assert set(drawn) == {f"node-{n['id']}" for n in doc["nodes"]}
    for n in doc["nodes"]:
        g = drawn[f"node-{n['id']}"]
        assert {f"status-{n['status']}", f"kind-{n['kind']}"} <= set(g.get("class").split())
        text = [t.text for t in g.iter(f"{SVG}text")]
        assert text[0] == n["name"] and text[-1] == {"build": "to build"}.get(n["status"], n["status"]), text
        assert text[1] == (n["key"] or "no key yet")[:12]
    edges = {tuple(g.find(f"{SVG}title").text.split("->")) for g in svg.iter(f"{SVG}g") if g.get("class") == "edge"}
    assert edges == _edges(doc)
    assert any('"quoted" <b>#1 \\ back' in n["name"] for n in doc["nodes"])   # the names that needed escaping


MERMAID_NODE = re.compile(r'^  (n\d+)\["([^"]*)"\]:::(\w+)$')
MERMAID_EDGE = re.compile(r"^  (n\d+) --> (n\d+)$")
MERMAID_CLASS = re.compile(r"^  classDef (\w+) fill:#[0-9a-f]{6},stroke:#[0-9a-f]{6}$")


def _mermaid_text(label: str) -> str:
    """A Mermaid label read back: its entity codes as characters, its line breaks as newlines."""
    for code, char in (("#quot;", '"'), ("#lt;", "<"), ("#gt;", ">"), ("#35;", "#")):
        label = label.replace(code, char)
    return label.replace("<br/>", "\n")


def test_mermaid_output_is_a_well_formed_flowchart_of_the_plan(recipes):
    doc = _plan_json(recipes, "--json")
    lines = qbuild("plan", "--format", "mermaid", *map(str, recipes), check=True).stdout.splitlines()
    assert lines[0] == "flowchart LR"
    nodes, edges, classes = {}, set(), set()
    for line in lines[1:]:
        if m := MERMAID_NODE.match(line):
            assert m[1] not in nodes, f"{m[1]} declared twice"
            nodes[m[1]] = (_mermaid_text(m[2]), m[3])
        elif m := MERMAID_EDGE.match(line):
            edges.add((m[1], m[2]))
        elif m := MERMAID_CLASS.match(line):
            classes.add(m[1])
        else:
            pytest.fail(f"not a node, edge or classDef line: {line!r}")
    # Nodes are named n<i> in plan order: their labels and classes are the plan's nodes', and so are the edges.
    assert len(nodes) == len(doc["nodes"])
    ids = {n["id"]: f"n{i}" for i, n in enumerate(doc["nodes"])}
    for n in doc["nodes"]:
        label, cls = nodes[ids[n["id"]]]
        assert label.split("\n")[0] == n["name"] and cls == n["status"]
    assert edges == {(ids[a], ids[b]) for a, b in _edges(doc)}
    assert {cls for _, cls in nodes.values()} <= classes
