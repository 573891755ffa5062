"""The DAG drawn by Graphviz's `dot` (Debian's `graphviz` package) as SVG for the page.

Where `dot` is not installed, the page is still written without the drawing (its node table lists every node), and
the reason is returned to be shown on the page and said on stderr.
"""

from __future__ import annotations

import shutil
import subprocess

from qbuild.core.errors import InfraError

DOT_TIMEOUT_S = 300      # a plan of every shipped recipe lays out in well under a second
MISSING = ("the DAG is not drawn: Graphviz's `dot` is not on PATH (install Graphviz, e.g. `apt-get install "
           "graphviz`); the node table lists every node")


def draw(dot_text: str) -> tuple[str | None, str | None]:
    """(the SVG element, None), or (None, why it is not drawn)."""
    exe = shutil.which("dot")
    if exe is None:
        return None, MISSING
    try:
        proc = subprocess.run([exe, "-Tsvg"], input=dot_text.encode(), capture_output=True, timeout=DOT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise InfraError(f"{exe} -Tsvg: {e}") from None
    if proc.returncode != 0:
        last = (proc.stderr.decode(errors="replace").strip().splitlines() or ["no message"])[-1]
        raise InfraError(f"{exe} -Tsvg exited {proc.returncode}: {last}")
    svg = proc.stdout.decode()
    # The XML prolog, doctype and comments before the element mean nothing inside an HTML page.
    return svg[svg.index("<svg"):], None
