"""TTFT and TPOT against prompt length, drawn by pygal as SVG, one line per bench document.

The prompt lengths are the x axis' categories (bench sweeps 16, 64, 256, ...: evenly spaced, they read as a log
scale); the y axis starts at 0, so that a line's height is its size. No JavaScript: pygal's tooltip script would be
fetched from its site, which a page meant to open anywhere must not do.
"""

from __future__ import annotations

from qbuild.core.errors import InfraError
from qbuild.report.data import MISSING_EXTRA, BenchDoc

METRICS = {"ttft_ms": "TTFT (ms, median)", "tpot_ms": "TPOT (ms, median)"}


def draw(benches: list[BenchDoc]) -> dict[str, str]:
    """metric -> the chart's SVG element, for each of METRICS."""
    try:
        import pygal
    except ImportError:
        raise InfraError(MISSING_EXTRA) from None

    lengths = sorted({p["prompt_len"] for b in benches for p in b.doc["points"]})
    out = {}
    for metric, title in METRICS.items():
        chart = pygal.Line(js=[], disable_xml_declaration=True, explicit_size=True, width=640, height=360,
                           title=title, x_title="prompt tokens", y_title="ms", include_x_axis=True,
                           show_x_guides=True, legend_at_bottom=True, legend_at_bottom_columns=1,
                           truncate_legend=-1,
                           classes=["pygal-chart", f"chart-{metric}"])
        chart.x_labels = [str(n) for n in lengths]
        for bench in benches:
            by_len = {p["prompt_len"]: p[metric]["median"] for p in bench.doc["points"]}
            chart.add(bench.label, [by_len.get(n) for n in lengths])
        out[metric] = chart.render(is_unicode=True)
    return out
