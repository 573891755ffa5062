"""Rendering for the CLI: plan trees, build progress, tables and the JSON documents of the plan, the build and the
store: every line a person reads. The commands print only what needs no rendering (a JSON document of their own, a
URL, a generation's text: qbuild/cli/*.py), and the error line is qbuild/cli/exits.py's; no other module prints
(tests/test_layers.py).

It imports neither the planner nor the engine (their types are only annotations here), and rich only when it draws:
a command that prints JSON, or nothing, does not pay for loading it.
"""

from __future__ import annotations

import sys
import time
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from qbuild.core import jsonio
from qbuild.core.units import human_bytes

if TYPE_CHECKING:
    from qbuild.core.progress import Tick
    from qbuild.execution.engine import BuildResult, Event
    from qbuild.execution.workspace import PinMove
    from qbuild.store.gc import GcReport
    from qbuild.store.manifest import Manifest
    from qbuild.store.remote import PushReport
    from qbuild.planning.dag import Plan
    from qbuild.planning.plan import NodeStatus

STATUS_TEXT = {"cached": "cached", "build": "to build", "waiting": "waiting", "unresolved": "not resolved"}
STATUS_STYLE = {"cached": "green", "build": "yellow", "waiting": "dim", "unresolved": "red"}


@cache
def console_err():
    from rich.console import Console

    return Console(stderr=True, highlight=False)


@cache
def console_out():
    from rich.console import Console

    return Console(highlight=False)


def _label(plan: Plan, nid: str, st: NodeStatus) -> str:
    from rich.markup import escape

    node = plan.nodes[nid]
    key = (st.key or "-" * 12)[:12]
    why = "" if st.status == "cached" else f" ({escape(st.why)})"
    return (f"[bold]{escape(node.name)}[/]  [dim]{key}[/]  [{STATUS_STYLE[st.status]}]{STATUS_TEXT[st.status]}[/]"
            f"{why}  [dim]out {human_bytes(node.est_out_bytes)}, peak {human_bytes(node.est_peak_bytes)}[/]")


def plan_tree(plan: Plan, status: dict[str, NodeStatus]) -> None:
    """One tree per recipe, rooted at its verify node; each node's children are its inputs."""
    from rich.tree import Tree

    _print_trees(console_out(), Tree, plan, status)


def _print_trees(out, Tree, plan: Plan, status: dict[str, NodeStatus]) -> None:
    from qbuild.planning.plan import written_bytes   # loaded already: the plan was made with it

    for name, pr in plan.recipes.items():
        counts = {s: sum(status[n].status == s for n in set(pr.nodes.values())) for s in STATUS_TEXT}
        unresolved = f", {counts['unresolved']} not resolved" if counts["unresolved"] else ""
        written = written_bytes(plan, name)
        root = Tree(f"[bold cyan]{name}[/] ({pr.loaded.path.name}, {pr.arch.family}, tp{pr.loaded.recipe.parallel.tp}"
                    f" ep{pr.loaded.recipe.parallel.ep}): {counts['cached']} cached, {counts['build']} to build, "
                    f"{counts['waiting']} waiting{unresolved}; writes ~{human_bytes(written.written)} "
                    f"({written.ratio:.2f}x the model's {human_bytes(written.model)})")
        shown: set[str] = set()

        def add(parent, nid: str) -> None:
            if nid in shown:
                parent.add(f"[dim]{plan.nodes[nid].name} (above)[/]")
                return
            shown.add(nid)
            branch = parent.add(_label(plan, nid, status[nid]))
            for dep in plan.nodes[nid].deps.values():
                add(branch, dep)

        add(root, pr.verify)
        if pr.kept is not None:
            add(root, pr.kept)
        out.print(root)


PLAN_FORMATS = ("tree", "json", "dot", "mermaid")


def print_plan(plan: Plan, status: dict[str, NodeStatus], fmt: str) -> None:
    """`qbuild plan`'s output on stdout, in one of PLAN_FORMATS: the trees, the JSON document, or the DAG as Graphviz
    or Mermaid text."""
    if fmt == "json":
        sys.stdout.write(jsonio.dumps(plan_json(plan, status), indent=1, sort_keys=True) + "\n")
    elif fmt == "dot":
        sys.stdout.write(plan_dot(plan, status))
    elif fmt == "mermaid":
        sys.stdout.write(plan_mermaid(plan, status))
    else:
        plan_tree(plan, status)


# The fill of a node of each status in the drawn DAG (dot, mermaid, the report).
STATUS_FILL = {"cached": "#d7f0dc", "build": "#fff1c2", "waiting": "#e9ecef", "unresolved": "#f8d3d6"}


def _node_lines(plan: Plan, nid: str, st: NodeStatus) -> list[str]:
    """What a drawn node says: its name, short key, status."""
    return [plan.nodes[nid].name, (st.key or "no key yet")[:12], STATUS_TEXT[st.status]]


def _dot_string(text: str) -> str:
    """A Graphviz double-quoted string (the DOT language: only the quote needs a backslash; a backslash is kept for
    Graphviz's own escapes, so it is doubled)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ") + '"'


def plan_dot(plan: Plan, status: dict[str, NodeStatus], extra: dict[str, list[str]] | None = None,
             link: str | None = None) -> str:
    """The DAG as a Graphviz digraph, inputs to the left of the steps that read them: each node's id is its node id,
    its label its name, short key, status (and `extra` lines), its class `status-<status> kind-<kind>`, and with
    `link`, its URL `link` + its node id (what a click on it opens)."""
    lines = ["digraph qbuild {", "  rankdir=LR;", '  node [shape=box, style="rounded,filled", fontname="Helvetica", '
             'fontsize=11];', '  edge [color="#6c757d"];']
    for nid, node in plan.nodes.items():
        st = status[nid]
        lines_of_label = _node_lines(plan, nid, st) + (extra or {}).get(nid, [])
        label = "\\n".join(_dot_string(line)[1:-1] for line in lines_of_label)   # backslash-n: Graphviz's line break
        lines.append(f'  {_dot_string(nid)} [label="{label}", id={_dot_string("node-" + nid)}, '
                     f'class="status-{st.status} kind-{node.kind}", fillcolor="{STATUS_FILL[st.status]}", '
                     f'tooltip={_dot_string(st.why or STATUS_TEXT[st.status])}'
                     + (f", URL={_dot_string(link + nid)}" if link is not None else "") + "];")
    for nid, node in plan.nodes.items():
        for dep in sorted(set(node.deps.values())):
            lines.append(f"  {_dot_string(dep)} -> {_dot_string(nid)};")
    return "\n".join(lines + ["}"]) + "\n"


def _mermaid_text(text: str) -> str:
    """Text inside a Mermaid quoted label: its entity codes for the characters the syntax or HTML would take."""
    for char, code in (("#", "#35;"), ('"', "#quot;"), ("<", "#lt;"), (">", "#gt;")):
        text = text.replace(char, code)
    return text


def plan_mermaid(plan: Plan, status: dict[str, NodeStatus]) -> str:
    """The DAG as a Mermaid flowchart: node `n<i>` (in plan order; Mermaid ids are plain words) labelled with its name,
    short key and status, in the class of its status; an edge from each input to the step that reads it."""
    ids = {nid: f"n{i}" for i, nid in enumerate(plan.nodes)}
    lines = ["flowchart LR"]
    for nid in plan.nodes:
        st = status[nid]
        label = "<br/>".join(_mermaid_text(line) for line in _node_lines(plan, nid, st))
        lines.append(f'  {ids[nid]}["{label}"]:::{st.status}')
    for nid, node in plan.nodes.items():
        for dep in sorted(set(node.deps.values())):
            lines.append(f"  {ids[dep]} --> {ids[nid]}")
    lines += [f"  classDef {name} fill:{fill},stroke:#6c757d" for name, fill in STATUS_FILL.items()]
    return "\n".join(lines) + "\n"


def plan_json(plan: Plan, status: dict[str, NodeStatus]) -> dict:
    from qbuild import backends
    from qbuild.planning.plan import written_bytes
    from qbuild.recipe.params import to_json

    nodes = []
    for nid, node in plan.nodes.items():
        st = status[nid]
        nodes.append({"id": nid, "kind": node.kind, "name": node.name, "recipes": sorted(node.recipes),
                      "key": st.key, "deps": dict(sorted(node.deps.items())), "status": st.status, "why": st.why,
                      "params": to_json(node.params), "est_out_bytes": node.est_out_bytes,
                      "est_peak_bytes": node.est_peak_bytes, "resources": node.resources})
        if node.kind == "compile":
            nodes[-1].update(backends.get(node.params.backend).describe_compile(node.params))
    recipes = {name: {"file": str(pr.loaded.path), "family": pr.arch.family, "backend": pr.loaded.recipe.backend,
                      "port": _port_json(pr), "nodes": dict(sorted(pr.nodes.items())),
                      "bytes": _bytes_json(written_bytes(plan, name))}
               for name, pr in plan.recipes.items()}
    return {"version": 1, "recipes": recipes, "nodes": nodes}


def _bytes_json(w) -> dict:
    """What a recipe's build writes beyond its checkpoint, estimated (plan.written_bytes)."""
    return {"model": w.model, "written": w.written, "ratio": round(w.ratio, 3)}


def _port_json(pr) -> dict | None:
    """The port a recipe resolves to (lineage, module and class names, where its source is found); None where its
    backend runs none."""
    from qbuild import backends

    return backends.get(pr.loaded.recipe.backend).port_info(pr.loaded, pr.arch)


def print_explain(plan: Plan, status: dict[str, NodeStatus], why: dict[str, str], chosen: list[str],
                  as_json: bool) -> None:
    """`qbuild explain`'s output: for each chosen node, its status and why it would rebuild (or "cached")."""
    rows = [{"id": nid, "name": plan.nodes[nid].name, "status": status[nid].status, "why": why[nid]}
            for nid in dict.fromkeys(chosen)]
    if as_json:
        print(jsonio.dumps(rows, indent=1))
        return
    for row in rows:
        print(f"{row['name']} [{row['id'][:8]}]: {row['why']}")


def print_pin_moves(moves: list[PinMove], as_json: bool, progress: str = "auto") -> None:
    """What `qbuild lock update` (or `compile --update`) did to each recipe's Hub pin: JSON on stdout, a `pin` event per
    recipe on stderr with `--progress json` (compile's), or one line per recipe on stderr."""
    docs = [{"recipe": m.recipe, "repo": m.pin.repo, "requested": m.pin.requested, "revision": m.pin.revision,
             "before": m.before.revision if m.before else None, "moved": m.moved} for m in moves]
    if as_json:
        print(jsonio.dumps(docs, indent=1, sort_keys=True))
        return
    if progress == "json":
        for doc in docs:
            _json_line({"event": "pin", "step": "compile", **doc})
        if not moves:
            note_json("compile")("no Hub models to pin")
        return
    if not moves:
        _err_line("no Hub models to pin")
    for m in moves:
        where = f"{m.recipe}: model {m.pin.repo}@{m.pin.requested}"
        if not m.moved:
            _err_line(f"{where}: {m.pin.revision[:8]} (unchanged)")
        elif m.before is None or (m.before.repo, m.before.requested) != (m.pin.repo, m.pin.requested):
            _err_line(f"{where}: pinned to {m.pin.revision[:8]}")
        else:
            _err_line(f"{where}: {m.before.revision[:8]} -> {m.pin.revision[:8]}")


def serve_text(serve: dict) -> None:
    """How a bundle is served (`qbuild serve --dry-run`, and `qbuild pull` for a bundle served by another program):
    its facts as comments, then the environment and command line, as one line a shell runs. Data, so on stdout."""
    import shlex

    for key, value in serve.items():
        if key not in ("env", "command"):
            print(f"# {key}: {value if isinstance(value, (str, int)) else jsonio.dumps(value)}")
    if "command" in serve:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(serve.get("env", {}).items()))
        print(f"{env} {shlex.join(serve['command'])}".lstrip())


def print_build_result(plan: Plan, result: BuildResult, progress: BuildProgress, as_json: bool,
                       extra: dict | None = None) -> None:
    """`qbuild compile`'s output: the result document (with `extra` entries) on stdout, or the summary line (always
    the summary event with --progress json)."""
    if as_json:
        print(jsonio.dumps({**result_json(plan, result), **(extra or {})}, indent=1, sort_keys=True))
    if not as_json or progress.json:
        progress.summary(plan, result)


def result_json(plan: Plan, result: BuildResult) -> dict:
    """`qbuild compile --json`: every node keyed by its id (names are not unique: recipes can share a step), and
    the names of the nodes by outcome, for a reader that only counts or greps."""
    def names(ids):
        return sorted(plan.nodes[n].name for n in ids)

    outcome = {n: "not run" for n in plan.nodes}
    for kind, ids in (("built", result.built), ("cached", result.cached), ("failed", result.failed),
                      ("skipped", result.skipped), ("deferred", result.deferred)):
        outcome.update(dict.fromkeys(ids, kind))
    nodes = {}
    for nid, status in sorted(outcome.items()):
        nodes[nid] = {"name": plan.nodes[nid].name, "kind": plan.nodes[nid].kind, "status": status}
        if nid in result.failed:
            nodes[nid]["error"] = result.failed[nid]
    return {"ok": result.ok, "nodes": nodes, "built": names(result.built), "cached": names(result.cached),
            "failed": {n: {"name": plan.nodes[n].name, "error": e} for n, e in sorted(result.failed.items())},
            "skipped": names(result.skipped), "deferred": names(result.deferred),
            "bundles": {name: result.manifests[pr.bundle].digest if pr.bundle in result.manifests else None
                        for name, pr in sorted(plan.recipes.items())}}


PROGRESS_MODES = ("auto", "plain", "json")


class BuildProgress:
    """A build's events and its steps' progress on stderr, in one of PROGRESS_MODES (docs/progress.md):
    - auto: on a TTY, rich's Progress with a row per running step (bytes or seconds done of the total, rate, ETA);
      elsewhere, as plain;
    - plain: a line per event, and per running step at most one progress line every LINE_EVERY_S (from its start);
    - json: one JSON object per line for every event and every progress report (stdout keeps the --json document).
    `on_progress` is called from the executor's threads."""

    def __init__(self, verbose: bool = False, lock: Path | None = None, mode: str = "auto", clock=time.monotonic):
        import threading

        from qbuild.core.progress import LineThrottle

        self.json = mode == "json"
        self.tty = mode == "auto" and sys.stderr.isatty()
        self.verbose = verbose        # also print what each built or failed step's libraries printed
        self._bars = None             # rich's Progress, on a TTY
        self._tasks: dict[str, object] = {}      # node id -> its row in the bars
        self._lines = LineThrottle(clock)
        self._lock = threading.Lock()
        self.started = time.monotonic()
        # The build's record beside the lockfile (qbuild.execution.record), which `qbuild report` draws its timeline from.
        self.recorder = None
        if lock is not None:
            from qbuild.execution.record import BuildRecorder

            self.recorder = BuildRecorder(lock)

    def __enter__(self) -> "BuildProgress":
        if self.tty:
            from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self._bars = Progress(SpinnerColumn("dots"), TextColumn("{task.description}"), BarColumn(bar_width=20),
                                  TextColumn("{task.fields[amount]}"), TextColumn("{task.fields[rate]}"),
                                  TextColumn("{task.fields[eta]}"), TimeElapsedColumn(), console=console_err(),
                                  refresh_per_second=8, transient=True)
            self._bars.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bars is not None:
            self._bars.stop()
        if self.recorder is not None and self.recorder.steps:   # a command refused before any step writes nothing
            self._write_record(interrupted=exc[0] is not None)

    def _write_record(self, interrupted: bool) -> None:
        """Replace the lockfile's build record. A record that cannot be written is a warning: the build it describes
        succeeded or failed on its own."""
        from qbuild.core.errors import QbuildError

        try:
            self.recorder.write(interrupted)
        except QbuildError as e:
            _err_line(f"warning: the build record was not written: {e}")

    def on_event(self, e: Event) -> None:
        if self.recorder is not None:
            self.recorder.on_event(e)
        with self._lock:
            self._track(e)
        if self.json:
            return _json_line(event_json(e, self.verbose))
        name = e.node.name
        line = {"start": f"start  {name}", "built": f"built  {name} ({e.seconds:.1f}s)",
                "failed": f"FAILED {name}: {e.error}",
                "corrupt": f"CORRUPT input of {name}: {e.error}", "missing": f"MISSING input of {name}: {e.error}",
                "skipped": f"skip   {name}: {e.error}"}.get(e.kind)
        if e.kind == "cached":
            line = None  # quiet when things are fine
        if line:
            console_err().print(line, markup=False, highlight=False, soft_wrap=True)
        if self.verbose and e.output:
            console_err().print("\n".join(f"  | {text}" for text in e.output), markup=False, highlight=False,
                                soft_wrap=True)

    def _track(self, e: Event) -> None:
        """A running step's row (TTY) and line throttle, opened at its start and closed at its end."""
        nid = e.node.id
        if e.kind == "start":
            self._lines.started(nid)
            if self._bars is not None and nid not in self._tasks:
                self._tasks[nid] = self._bars.add_task(e.node.name, total=None, amount="", rate="", eta="")
            return
        self._lines.ended(nid)
        task = self._tasks.pop(nid, None)
        if task is not None:
            self._bars.remove_task(task)

    def on_progress(self, node, report: Tick) -> None:
        """What a running step reported (engine.build's on_progress)."""
        with self._lock:
            if self.json:
                return _json_line(progress_json(report, node.name, node.id, node.kind))
            amount, rate, eta = progress_text(report)
            what = "" if report.what == node.kind else f": {report.what}"    # "compile x: compile" says it twice
            task = self._tasks.get(node.id)
            if task is not None:
                if report.unit == "s" and report.total is None:
                    amount = ""     # elapsed only: the row's own clock shows it, ticking between reports
                self._bars.update(task, description=node.name + what, total=report.total, completed=report.done,
                                  amount=amount, rate=rate, eta=eta)
                self._bars.refresh()
            elif self._bars is None and self._lines.due(node.id):
                _err_line(f"  {node.name}{what} " + ", ".join(x for x in (amount, rate, eta) if x))

    def summary(self, plan: Plan, result: BuildResult) -> None:
        took = time.monotonic() - self.started
        if self.json:
            return _json_line({"event": "summary", "built": len(result.built), "cached": len(result.cached),
                               "failed": len(result.failed), "skipped": len(result.skipped),
                               "deferred": len(result.deferred), "seconds": round(took, 3)})
        msg = (f"{len(result.built)} built, {len(result.cached)} cached, {len(result.failed)} failed, "
               f"{len(result.skipped)} skipped in {took:.1f}s")
        if result.deferred:
            msg += f"; {len(result.deferred)} left unbuilt (--skip-device)"
        if self.tty:
            console_err().print(msg, markup=False, highlight=False)
        else:
            # Words and numbers, which rich would write unchanged: a no-op build does not load rich for one line.
            print(msg, file=sys.stderr)


def event_json(e: Event, verbose: bool = False) -> dict:
    """A build event as `--progress json` writes it: {"event", "node", "id", "step"}, with "seconds" (built),
    "error" (failed, skipped, corrupt, missing) and, with -v, "output" (what the step's libraries printed)."""
    doc: dict = {"event": e.kind, "node": e.node.name, "id": e.node.id, "step": e.node.kind}
    if e.kind == "built":
        doc["seconds"] = round(e.seconds, 3)
    if e.error is not None:
        doc["error"] = e.error
    if verbose and e.output:
        doc["output"] = e.output
    return doc


def progress_json(report: Tick, node: str | None, nid: str | None, step: str) -> dict:
    """A progress report as `--progress json` writes it: {"event": "progress", "node", "id", "step", "what", "done",
    "total" (null: not known), "unit" ("B" or "s"), "rate" (units per second, or null)}."""
    return {"event": "progress", "node": node, "id": nid, "step": step, **report.to_json()}


def progress_text(report: Tick) -> tuple[str, str, str]:
    """(amount, rate, ETA) of a report as a person reads them: "1.5 MiB/4.0 MiB", "12.0 MiB/s", "ETA 0:03"; for
    seconds, "0:42/~3:10" (elapsed, and how long the last such step took) or "0:42 elapsed", no rate, the time left by
    that measure. Empty strings where a part is not known."""
    if report.unit == "s":
        amount = _clock(report.done) + (" elapsed" if report.total is None else f"/~{_clock(report.total)}")
        left = None if report.total is None else report.total - report.done
        return amount, "", f"ETA ~{_clock(left)}" if left is not None and left > 0 else ""
    amount = human_bytes(report.done) + ("" if report.total is None else f"/{human_bytes(report.total)}")
    rate = f"{human_bytes(report.rate)}/s" if report.rate else ""
    eta = ""
    if report.total is not None and report.rate:
        eta = f"ETA {_clock(max(0.0, report.total - report.done) / report.rate)}"
    return amount, rate, eta


def _clock(seconds: float) -> str:
    """0:42, 12:05, 1:02:03."""
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _json_line(doc: dict) -> None:
    """One JSON object on one line of stderr, written at once (threads report concurrently)."""
    sys.stderr.write(jsonio.dumps(doc) + "\n")
    sys.stderr.flush()


# --- transfers and gc ------------------------------------------------------------------------------------------

class TransferDisplay:
    """Transfer progress on stderr: a rich bar with bytes/s on a TTY (unless `bars` is False, e.g. under the build's
    live display), plain lines with rates elsewhere. Thread-safe; implements store.remote.Progress."""

    LINE_EVERY_S = 5.0

    def __init__(self, bars: bool | None = None):
        import threading

        self.bars = sys.stderr.isatty() if bars is None else bars
        self._lock = threading.Lock()
        self._bar = None
        self._task = None
        self.verb, self.files, self.total, self.done, self.started, self._last_line = "", 0, 0, 0, 0.0, 0.0
        self.files_done = 0

    def begin(self, verb: str, files: int, total_bytes: int) -> None:
        self.verb, self.files, self.total, self.done, self.files_done = verb, files, total_bytes, 0, 0
        self.started = self._last_line = time.monotonic()
        if not files:
            return
        if self.bars:
            from rich.progress import (BarColumn, DownloadColumn, Progress as Bar, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)

            self._bar = Bar(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                            TimeRemainingColumn(), console=console_err(), transient=True)
            self._bar.start()
            self._task = self._bar.add_task(f"{verb} {_files(files)}", total=total_bytes)
        else:
            self._line(f"{verb} {_files(files)}, {human_bytes(total_bytes)}")
        self.started = self._last_line = time.monotonic()   # the rate counts transfer time, not setup

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            if self._bar is not None:
                self._bar.update(self._task, advance=nbytes)
            elif self.files and time.monotonic() - self._last_line >= self.LINE_EVERY_S:
                self._last_line = time.monotonic()
                self._line(f"  {self.verb}: {human_bytes(self.done)} of {human_bytes(self.total)} ({self._rate()})")

    def file_done(self, name: str) -> None:
        with self._lock:
            self.files_done += 1

    def end(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        if self.files and self.files_done == self.files:   # a transfer that failed is reported by its error
            self._line(f"{self.verb}ed {_files(self.files)}, {human_bytes(self.done)} in "
                       f"{time.monotonic() - self.started:.1f}s ({self._rate()})")

    def _rate(self) -> str:
        return f"{human_bytes(int(self.done / max(time.monotonic() - self.started, 1e-6)))}/s"

    @staticmethod
    def _line(text: str) -> None:
        _err_line(text)


def _files(n: int) -> str:
    return f"{n} file" if n == 1 else f"{n} files"


def transfer_display(mode: str, step: str, bars: bool | None = None):
    """How a command (`step`: compile, publish, pull) shows its store's transfers (store.remote.Progress), in one of
    PROGRESS_MODES: auto, a TransferDisplay (bars on a TTY unless `bars` is False); plain, its lines; json, one
    progress_json line per report, with no node (throttled as a step's: qbuild.core.progress)."""
    if mode == "json":
        from qbuild.core.progress import StepProgress

        return StepProgress(lambda report: _json_line(progress_json(report, None, None, step))).transfers()
    return TransferDisplay(bars=False if mode == "plain" else bars)


def pushed_text(report: PushReport, url: str, progress: str = "auto") -> None:
    """After `qbuild compile --push`: what the push itself uploaded (nothing is said when it uploaded nothing); with
    `--progress json`, a `pushed` event."""
    if progress == "json":
        _json_line({"event": "pushed", "step": "compile", "remote": url, **report.to_json()})
    elif report.manifests_uploaded:
        _err_line(f"pushed {report.manifests_uploaded} entries to {url} ({human_bytes(report.bytes_uploaded)})")


def print_published(names: list[str], url: str, report: PushReport, as_json: bool, progress: str = "auto") -> None:
    """`qbuild publish`'s output: the report as JSON on stdout, or one summary line on stderr; with `--progress
    json` the line is a `summary` event, and stderr holds JSON lines only (it is written with `--json` too, as a
    build's summary event is)."""
    doc = {"recipes": names, "remote": url, **report.to_json()}
    if as_json:
        print(jsonio.dumps(doc, sort_keys=True))
    if progress == "json":
        _json_line({"event": "summary", "step": "publish", **doc})
    if as_json or progress == "json":
        return
    repaired = f", {report.blobs_repaired} of them replacing missing or corrupt remote copies" \
        if report.blobs_repaired else ""
    _err_line(f"published {', '.join(names)} to {url}: {report.blobs_uploaded} blobs uploaded "
              f"({human_bytes(report.bytes_uploaded)}{repaired}), {report.blobs_present} already there; "
              f"{report.manifests_uploaded} manifests written, {report.manifests_present} already there")


def print_pulled(recipe: str, dest, manifest: Manifest, serve: dict | None, as_json: bool,
                 progress: str = "auto") -> None:
    """`qbuild pull`'s output: the bundle laid out (JSON on stdout, or a line on stderr) and how to serve it; with
    `--progress json` the line is a `summary` event, and stderr holds JSON lines only."""
    doc = {"recipe": recipe, "dir": str(dest), "digest": manifest.digest, "files": len(manifest.outputs),
           "bytes": manifest.size}
    if serve is not None:
        doc["serve"] = serve
    if as_json:
        print(jsonio.dumps(doc, sort_keys=True))
    if progress == "json":
        _json_line({"event": "summary", "step": "pull", **doc})
    if as_json:
        return
    if progress == "json":   # the event holds the summary; how to serve it is data, on stdout as without the option
        if serve is not None:
            serve_text(serve)
        return
    _err_line(f"{dest}: {len(manifest.outputs)} files ({human_bytes(manifest.size)}), bundle "
              f"{manifest.digest[:16]} verified")
    if serve is not None:
        serve_text(serve)


def note_json(step: str):
    """How a command writes a note (a recipe changed since it was locked, ...) with `--progress json`: a `note`
    event, so that stderr holds JSON lines only."""
    return lambda text: _json_line({"event": "note", "step": step, "message": text})


def _err_line(text: str) -> None:
    console_err().print(text, markup=False, highlight=False, soft_wrap=True)


def print_gc(reports: list[GcReport], wheres: list[str], as_json: bool) -> None:
    """`qbuild gc`'s output: one line per removal on stdout (or the reports as JSON), one summary per store on
    stderr. `wheres` names each report's store."""
    if as_json:
        print(jsonio.dumps([r.to_json() for r in reports], sort_keys=True))
        return
    verb = "would remove" if reports[0].dry_run else "removed"
    for report in reports:
        for r in report.removed:
            label = f" ({r.kind})" if r.kind else ""
            # a cache group is named by its folder, a partial write by its file
            name = r.name if r.what in ("cache", "partial") else r.name[:16]
            print(f"{verb} {r.what} {name}{label} {human_bytes(r.size)} [{r.where}]")
    for report, where in zip(reports, wheres):
        manifests = sum(r.what == "manifest" for r in report.removed)
        caches = sum(r.what == "cache" for r in report.removed)
        partials = sum(r.what == "partial" for r in report.removed)
        blobs = len(report.removed) - manifests - caches - partials
        _err_line(f"{where}: {verb} {manifests} manifests and {blobs} blobs"
                  + (f" and {caches} compile cache groups" if caches else "")
                  + (f" and {partials} abandoned partial writes" if partials else "")
                  + f" ({human_bytes(report.bytes_freed)}); kept {report.kept_manifests} manifests, "
                  f"{report.kept_blobs} blobs"
                  + (f", {report.kept_cache} compile cache groups" if report.kept_cache else "")
                  + (f", {report.young_orphans} unnamed blobs younger than --grace" if report.young_orphans else ""))


# --- run and bench ---------------------------------------------------------------------------------------------

def generation_json(gen) -> dict:
    return {"token_ids": gen.token_ids, "text": gen.text, "ttft_ms": round(gen.ttft_ms, 3),
            "tpot_ms": None if gen.tpot_ms is None else round(gen.tpot_ms, 3), "prompt_tokens": len(gen.prompt_ids),
            "cte_bucket": gen.cte_bucket}


def generation_text(gen) -> None:
    """The generated text on stdout; the timings on stderr."""
    print(gen.text)
    tpot = "-" if gen.tpot_ms is None else f"{gen.tpot_ms:.1f} ms"
    console_err().print(f"{len(gen.prompt_ids)} prompt tokens (bucket {gen.cte_bucket}), {len(gen.token_ids)} "
                        f"generated; TTFT {gen.ttft_ms:.1f} ms, TPOT {tpot}", markup=False, highlight=False)


def bench_table(doc: dict) -> None:
    """`qbuild bench`'s table on stdout: one row per prompt length, the median TTFT and TPOT and the decode rate."""
    print(f"{'prompt':>6}  {'bucket':>6}  {'TTFT ms':>9}  {'TPOT ms':>9}  {'tok/s':>8}")
    for p in doc["points"]:
        print(f"{p['prompt_len']:>6}  {p['cte_bucket']:>6}  {p['ttft_ms']['median']:>9.1f}  "
              f"{p['tpot_ms']['median']:>9.2f}  {p['decode_tok_s']:>8.1f}")


# --- report ----------------------------------------------------------------------------------------------------

def report_written(path: Path, shown: dict, notes: list[str], as_json: bool) -> None:
    """After `qbuild report`: the page's path on stdout (or a JSON document naming it, with `shown`: what it shows),
    and what it could not show on stderr."""
    for note in notes:
        _err_line(f"note: {note}")
    where = str(path.resolve())
    if as_json:
        print(jsonio.dumps({"report": where, **shown, "notes": notes}, indent=1, sort_keys=True))
    else:
        print(where)
