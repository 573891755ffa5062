"""`qbuild report`: one self-contained HTML page about a lockfile's or recipes' build: the DAG with each node's status,
key and size (drawn by Graphviz's `dot`), the last build's timeline (from the build record, qbuild.execution.record), the
verify reports against their thresholds, TTFT / TPOT charts of `qbuild bench` documents (drawn by pygal), and the
answers of requests to `qbuild serve` (a long prompt cold and warm, an image chat: `make demo`'s last step).

data gathers what the page shows; graph and charts draw it as SVG; page renders the HTML (Jinja2). Nothing here
prints, and nothing here is imported on the planning path: the CLI imports it inside the command.

May import: qbuild.render and every layer below it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from qbuild.execution.record import read_record
from qbuild.render import plan_dot
from qbuild.report import charts, graph, page
from qbuild.report.data import BenchDoc, ReportData, ServeDoc, gather, read_bench, read_serve

if TYPE_CHECKING:
    from qbuild.planning.lock import Lock
    from qbuild.planning.dag import Plan
    from qbuild.planning.plan import NodeStatus
    from qbuild.store.remote import Store

__all__ = ["BenchDoc", "ReportData", "ServeDoc", "make", "read_bench", "read_serve"]


def make(plan: Plan, status: dict[str, NodeStatus], store: Store, lock: Lock, lock_path: Path,
         benches: list[BenchDoc], serves: list[ServeDoc] | None = None) -> tuple[str, ReportData, list[str]]:
    """(the page's HTML, what it shows, notes on what it could not show: no `dot`, no build record)."""
    record, record_note = read_record(lock_path)
    data = gather(plan, status, store, lock, lock_path, record, record_note, benches, serves or [])
    extra = {row.id: [page.size_text(row), page.step_text(row.step)] for row in data.nodes}
    dag_svg, dag_note = graph.draw(plan_dot(plan, status, extra, link="#row-"))
    html = page.render(data, dag_svg, dag_note, charts.draw(benches) if benches else {})
    return html, data, [note for note in (dag_note, record_note) if note]
