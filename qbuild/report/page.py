"""The report page: ReportData rendered through page.html.j2 (Jinja2, every value escaped) into one HTML document
that needs nothing else to be read: its CSS and drawings are inline, it loads no script, font or image."""

from __future__ import annotations

import time
from pathlib import Path

import qbuild
from qbuild.render import STATUS_FILL, STATUS_TEXT, human_bytes
from qbuild.core.errors import InfraError
from qbuild.report.data import MISSING_EXTRA, NodeRow, ReportData

TEMPLATE = Path(__file__).with_name("page.html.j2")
OUTCOME_FILL = {"built": "#f0b429", "cached": "#5fb572", "failed": "#d64545", "skipped": "#adb5bd",
                "interrupted": "#9b59b6"}


def render(data: ReportData, dag_svg: str | None, dag_note: str | None, charts: dict[str, str]) -> str:
    try:
        import jinja2
    except ImportError:
        raise InfraError(MISSING_EXTRA) from None

    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True,
                             lstrip_blocks=True, keep_trailing_newline=True)
    env.filters.update(bytes=human_bytes, clock=_clock, seconds=_seconds, metric=_metric)
    template = env.from_string(TEMPLATE.read_text())
    return template.render(data=data, version=qbuild.__version__, status_text=STATUS_TEXT, status_fill=STATUS_FILL,
                           outcome_fill=OUTCOME_FILL, dag_svg=_markup(dag_svg), dag_note=dag_note,
                           charts={k: _markup(v) for k, v in charts.items()}, timeline=timeline(data),
                           size_text=size_text, step_text=step_text)


def _markup(svg: str | None):
    """An SVG element the page takes as it is: dot and pygal wrote it, escaping every text they were given."""
    import markupsafe

    return None if svg is None else markupsafe.Markup(svg)


def size_text(row: NodeRow) -> str:
    return {"store": human_bytes(row.size), "lockfile": f"{human_bytes(row.size)} (locked)",
            "estimate": f"~{human_bytes(row.size)} (estimate)"}[row.size_source]


def step_text(step: dict | None) -> str:
    """A node's part in the last build, in a few words."""
    if step is None:
        return "not in the last build"
    outcome = step.get("outcome", "?")
    if outcome == "built" and _number(step.get("start")) and _number(step.get("end")):
        return f"built in {_seconds(step['end'] - step['start'])}"
    if outcome == "cached" and _number(step.get("built_seconds")):
        return f"cached (built earlier in {_seconds(step['built_seconds'])})"
    return str(outcome)


def timeline(data: ReportData) -> dict | None:
    """The last build's steps of this report's nodes, in start order, each with its bar's offset and width as
    percentages of the build's span: {"start", "end", "span", "rows": [...]}; None without a record."""
    if data.record is None:
        return None
    rows_by_id = {row.id: row for row in data.nodes}
    steps = [s for s in data.record["steps"] if isinstance(s, dict) and s.get("id") in rows_by_id
             and _number(s.get("start"))]
    t0 = data.record.get("started") if _number(data.record.get("started")) else min(
        (s["start"] for s in steps), default=0.0)
    t1 = max([t0] + [s["end"] for s in steps if _number(s.get("end"))] + [s["start"] for s in steps])
    span = max(t1 - t0, 1e-3)
    rows = []
    for s in sorted(steps, key=lambda s: s["start"]):
        end = s["end"] if _number(s.get("end")) else t1
        node = rows_by_id[s["id"]]
        rows.append({"step": s, "name": node.name, "recipes": node.recipes, "offset": (s["start"] - t0) / span * 100,
                     "width": max((end - s["start"]) / span * 100, 0.4), "from": s["start"] - t0,
                     "to": end - t0, "worker": _worker(s)})
    return {"start": t0, "end": t1, "span": span, "rows": rows}


def _worker(step: dict) -> str:
    if step.get("worker"):
        return str(step["worker"])
    return "store" if step.get("outcome") == "cached" else "-" if step.get("outcome") == "skipped" else "unknown"


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(t))


def _seconds(s: float) -> str:
    return f"{s:.2f}s" if s < 10 else f"{s:.1f}s" if s < 600 else f"{s / 60:.1f}min"


def _metric(value) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)
