"""What a report shows, gathered as plain data: each node of the plan with its status, key and size, its step in the
last build's record, each recipe's verify report, and the bench and serve documents given. page.py renders it.

Sizes and verify reports come from the store entry of the node's current key where the store has it, else from the
lockfile's entry of the node (what was locked, which the plan may no longer match), and are shown as such.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from qbuild.core.errors import UserError
from qbuild.core.userfile import read_small_file
from qbuild.render import STATUS_TEXT

if TYPE_CHECKING:
    from qbuild.planning.lock import Lock
    from qbuild.planning.dag import Plan
    from qbuild.planning.plan import NodeStatus
    from qbuild.store.remote import Store

MAX_BENCH_BYTES = 16 << 20     # a bench document holds a few points: kilobytes
MISSING_EXTRA = "qbuild report draws with jinja2 and pygal, which are not installed: pip install 'qbuild[report]'"


@dataclass
class NodeRow:
    id: str
    name: str
    kind: str
    recipes: list[str]
    status: str                    # the plan's: cached, build, waiting, unresolved
    why: str
    key: str | None
    digest: str | None             # its output tree's digest, where known
    size: int                      # bytes of its outputs (or the planner's estimate, see size_source)
    size_source: str               # "store" (this key's entry), "lockfile" (the locked entry), "estimate"
    step: dict | None = None       # its step in the last build's record


@dataclass
class VerifyTable:
    recipe: str
    node_id: str
    name: str
    report: dict | None            # the verify step's report.json
    source: str                    # where the report came from: "store", "lockfile", or "" (none)
    summary: dict = field(default_factory=dict)    # metric -> (value, threshold, passed), over every prompt
    problem: str | None = None     # why there is no report (the verify failed, or was not built)
    verdict: str = "not verified"  # "passed", "failed", or "not verified"

    @property
    def tokens_only(self) -> bool:
        """The bundle returned tokens and no logits: its top-1 is its first token's, and no logit error gated it."""
        return bool(self.report) and bool(self.report["prompts"]) and \
            all(p.get("max_logit_err") is None for p in self.report["prompts"])


@dataclass
class BenchDoc:
    file: str
    label: str
    doc: dict                      # `qbuild bench --json`'s document (qbuild/model/runtime/bench.py to_json)


@dataclass
class ServeDoc:
    file: str
    doc: dict                      # `demo/serve_client.py --out`'s document: a long prompt twice, an image chat


@dataclass
class ReportData:
    title: str
    lock_path: Path
    generated: float
    recipes: list[dict]
    nodes: list[NodeRow]
    verifies: list[VerifyTable]
    benches: list[BenchDoc]
    serves: list[ServeDoc]
    record: dict | None            # the last build's record (qbuild/execution/record.py), or None
    record_note: str | None        # why there is no record, where there is none
    other_steps: int = 0           # steps of that build that belong to nodes not in this report

    def shown(self) -> dict:
        """What the page shows, in brief (`qbuild report --json`)."""
        return {"recipes": [r["name"] for r in self.recipes], "nodes": len(self.nodes),
                "verify": {v.recipe: v.verdict for v in self.verifies}, "bench": len(self.benches),
                "serve": len(self.serves)}


def read_bench(path: Path) -> BenchDoc:
    """A `qbuild bench --json` document, checked for the fields the charts read (UserError naming the field)."""
    try:
        doc = json.loads(read_small_file(path, MAX_BENCH_BYTES, "the bench document"))
    except ValueError as e:
        raise UserError(f"{path}: not a JSON document: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("points"), list) or not doc["points"]:
        raise UserError(f"{path}: points: expected the non-empty list `qbuild bench --json` writes")
    for i, point in enumerate(doc["points"]):
        where = f"{path}: points[{i}]"
        if not isinstance(point, dict) or not _count(point.get("prompt_len")):
            raise UserError(f"{where}.prompt_len: expected a positive whole number")
        for metric in ("ttft_ms", "tpot_ms"):
            value = point.get(metric)
            if not isinstance(value, dict) or not _finite(value.get("median")):
                raise UserError(f"{where}.{metric}.median: expected a number")
    parts = [str(doc[k]) for k in ("family", "backend", "dtype") if isinstance(doc.get(k), (str, int))]
    if isinstance(doc.get("tp"), int):
        parts.append(f"tp{doc['tp']}")
    return BenchDoc(str(path), f"{path.name} ({' '.join(parts)})" if parts else path.name, doc)


# The fields of a serve document the page shows (what demo/serve_client.py writes), and how each is checked.
SERVE_FIELDS = {"model": str, "url": str,
                "long_prompt": {"tokens": "count", "cold_ms": "number", "warm_ms": "number",
                                "cold_cached_tokens": "tokens", "warm_cached_tokens": "tokens", "same_answer": bool},
                "image": {"size": "size", "question": str, "answer": str, "prompt_tokens": "count",
                          "completion_tokens": "tokens"}}


def read_serve(path: Path) -> ServeDoc:
    """A document of requests to `qbuild serve` (`demo/serve_client.py --out`: a long prompt cold and warm, an image
    chat), checked for the fields the page shows (UserError naming the field)."""
    try:
        doc = json.loads(read_small_file(path, MAX_BENCH_BYTES, "the serve document"))
    except ValueError as e:
        raise UserError(f"{path}: not a JSON document: {e}") from None
    _check_fields(path, "", doc, SERVE_FIELDS)
    return ServeDoc(str(path), doc)


def _check_fields(path: Path, where: str, value, expected) -> None:
    if isinstance(expected, dict):
        if not isinstance(value, dict):
            raise UserError(f"{path}: {where or '$'}: expected an object with {', '.join(expected)}")
        for key, inner in expected.items():
            _check_fields(path, f"{where}.{key}" if where else key, value.get(key), inner)
        return
    ok = {str: lambda v: isinstance(v, str), bool: lambda v: isinstance(v, bool), "count": _count,
          "tokens": lambda v: _count(v) or v == 0 and not isinstance(v, bool),
          "number": lambda v: _finite(v) and v > 0,
          "size": lambda v: isinstance(v, list) and len(v) == 2 and all(_count(x) for x in v)}[expected](value)
    if not ok:
        what = {str: "a string", bool: "true or false", "count": "a positive whole number",
                "tokens": "a whole number of tokens", "number": "a positive number",
                "size": "[width, height] in pixels"}[expected]
        raise UserError(f"{path}: {where}: expected {what}")


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def gather(plan: Plan, status: dict[str, NodeStatus], store: Store, lock: Lock, lock_path: Path,
           record: dict | None, record_note: str | None, benches: list[BenchDoc],
           serves: list[ServeDoc]) -> ReportData:
    steps = {s.get("id"): s for s in record["steps"] if isinstance(s, dict)} if record else {}
    nodes = [_node_row(plan, nid, status[nid], lock, steps.get(nid)) for nid in plan.nodes]
    recipes = [_recipe_summary(name, pr, status, lock) for name, pr in plan.recipes.items()]
    verifies = [_verify_table(plan, name, pr.verify, status[pr.verify], store, lock, steps.get(pr.verify))
                for name, pr in plan.recipes.items()]
    other = sum(1 for sid in steps if sid not in plan.nodes)
    return ReportData(title=", ".join(plan.recipes), lock_path=lock_path, generated=time.time(), recipes=recipes,
                      nodes=nodes, verifies=verifies, benches=benches, serves=serves, record=record,
                      record_note=record_note,
                      other_steps=other)


def _node_row(plan: Plan, nid: str, st: NodeStatus, lock: Lock, step: dict | None) -> NodeRow:
    node = plan.nodes[nid]
    row = NodeRow(id=nid, name=node.name, kind=node.kind, recipes=sorted(node.recipes), status=st.status,
                  why=st.why, key=st.key, digest=None, size=node.est_out_bytes, size_source="estimate", step=step)
    locked = lock.nodes.get(nid)
    if st.manifest is not None:
        row.digest, row.size, row.size_source = st.manifest.digest, st.manifest.size, "store"
    elif locked is not None:
        row.digest = locked.digest
        row.size = sum(o.size for o in locked.outputs.values())
        row.size_source = "lockfile"
    return row


def _recipe_summary(name: str, pr, status: dict[str, NodeStatus], lock: Lock) -> dict:
    recipe = pr.loaded.recipe
    entry = lock.recipes.get(name)
    counts: dict[str, int] = {}
    for nid in set(pr.nodes.values()):
        counts[status[nid].status] = counts.get(status[nid].status, 0) + 1
    return {"name": name, "file": str(pr.loaded.path), "family": pr.arch.family, "backend": recipe.backend,
            "tp": recipe.parallel.tp, "ep": recipe.parallel.ep, "counts": counts,
            "bundle": entry.bundle if entry else None, "verified": entry.verified if entry else None,
            "verify_failure": entry.verify_failure if entry else None}


def _verify_table(plan: Plan, recipe: str, nid: str, st: NodeStatus, store: Store, lock: Lock,
                  step: dict | None) -> VerifyTable:
    table = VerifyTable(recipe=recipe, node_id=nid, name=plan.nodes[nid].name, report=None, source="")
    if st.manifest is not None and "report.json" in st.manifest.outputs:
        table.report, table.source = _read_blob(store, st.manifest.outputs["report.json"], remote=True), "store"
    else:
        node = lock.nodes.get(nid)
        entry = node.outputs_json().get("report.json") if node is not None else None
        if entry is not None and store.local.has_blob(entry["digest"]):
            table.report, table.source = _read_blob(store, entry, remote=False), "lockfile"
    if table.report is not None:
        table.summary = summarize(table.report)
        table.verdict = "passed" if table.report.get("ok") else "failed"
        return table
    failure = lock.recipes[recipe].verify_failure if recipe in lock.recipes else None
    if step is not None and step.get("outcome") == "failed":
        failure = step.get("error") or failure
    if failure:
        table.verdict, table.problem = "failed", failure
    elif step is not None and step.get("outcome") == "skipped":
        table.problem = f"{plan.nodes[nid].name} was skipped in the last build: {step.get('error')}"
    else:
        table.problem = f"{plan.nodes[nid].name} is {STATUS_TEXT[st.status]}: {st.why}"
    return table


def _read_blob(store: Store, entry: dict, remote: bool) -> dict | None:
    if remote:
        store.ensure_blobs({"report.json": entry})
    try:
        doc = json.loads(store.blob_path(entry["digest"]).read_bytes())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("prompts"), list) else None


def summarize(report: dict) -> dict:
    """metric -> (value over every prompt, its threshold, whether it passes), as the verify step's gate computes them
    (qbuild/steps/verify.py `failures`, whose functions it calls): top-1 weighted by the positions each prompt was
    measured at, token match averaged over prompts, the largest logit error (None where the bundle returned tokens
    only: no logits, nothing checked)."""
    from dataclasses import fields

    from qbuild.steps.verify import PromptReport, token_match, top1_agreement

    prompts, thresholds = report["prompts"], report.get("thresholds") or {}
    if not prompts:
        return {}
    names = {f.name for f in fields(PromptReport)}
    reports = [PromptReport(**{k: v for k, v in p.items() if k in names}) for p in prompts]
    top1, match = top1_agreement(reports), token_match(reports)
    errs = [p["max_logit_err"] for p in prompts if p.get("max_logit_err") is not None]
    err = max(errs) if errs else None
    return {"top1": (top1, thresholds.get("top1_min"), _at_least(top1, thresholds.get("top1_min"))),
            "token_match": (match, thresholds.get("token_match_min"),
                            _at_least(match, thresholds.get("token_match_min"))),
            "max_logit_err": (err, thresholds.get("max_logit_err"),
                              None if thresholds.get("max_logit_err") is None or err is None
                              else math.isfinite(err) and err <= thresholds["max_logit_err"])}


def _at_least(value: float, bound) -> bool | None:
    return None if bound is None else value >= bound    # a NaN value fails, as in the gate
