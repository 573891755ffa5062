"""The command line's fast path: `qbuild plan` and a no-op `qbuild compile` answered from the plan cache.

cli.py calls `answer_and_exit(__name__)` before it imports typer. When this process is the qbuild command line,
its arguments are a plan or compile this module reads exactly as the full command line would, and the plan cache
(qbuild.plancache) holds an answer whose inputs are all unchanged, the answer is printed by the renderers the full
path uses and the process exits. A plan the cache cannot answer is planned here in full, still without typer (the
largest import of `qbuild plan` after the planner's own). Anything else returns: another command, a flag not read
here (the full command line reports usage errors), a remote, a compile that misses, a plan that fails (the full
command line runs it again and reports the error its own way). The full path records a fresh answer
(`remember_plan`, `remember_compile`) for the next run.

Nothing here imports pydantic, typer, rich, yaml, torch or boto3 on the way to a cached answer: a plan's trees are
replayed as the text rich printed for the same width and encoding, and rich is loaded only to draw on a terminal
(or at a width not seen before), exactly as the full path draws there.
"""

from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

from . import plancache, planserver

# Taken when cli.py starts, before anything planning reads: a change after it is never recorded as seen.
STARTED_NS = time.time_ns()
# plancache.distributions() when the command line started (None until then): an install during the run is seen.
_dists_at_start: list | None = None

_FLAGS = {"plan": {"--all", "--json"},
          "compile": {"--all", "--json", "--keep-going", "--frozen", "--strict"}}
# Options with a value. A remote (--remote, $QBUILD_REMOTE, ./qbuild.yaml) is never answered from the cache: its
# entries are not local files. --mem, --push and --address are left to the full path, which parses and checks them.
_VALUES = {"plan": {"--store", "--lock"},
           "compile": {"--store", "--lock", "--jobs", "-j", "--executor"}}


def answer_and_exit(module_name: str) -> None:
    """Exit with the cached answer when this process is `qbuild plan|compile ...` and the cache has one."""
    if not _is_command_line(module_name):
        return
    code = answer(sys.argv[1:])
    if code is not None:
        sys.exit(code)


def _is_command_line(module_name: str) -> bool:
    """`python -m qbuild.cli` runs cli.py as __main__; the `qbuild` script imports it from its own __main__. Any
    other importer (tests, workers re-importing a parent's main module) never takes the fast path."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None) or ""
    return module_name == "__main__" or os.path.basename(main_file) == "qbuild"


def parse(argv: list[str]) -> tuple[str, list[str], set[str], dict[str, str]] | None:
    """(command, recipe arguments, flags, option values) of a plan or compile command line, or None for anything
    this parser does not read exactly as click does (an unknown or short-joined option, `--`, an empty or
    dash-leading value, a jobs count that is not a plain positive integer, an executor other than local)."""
    if not argv or argv[0] not in _FLAGS:
        return None
    command, args = argv[0], argv[1:]
    flags, options = _FLAGS[command], _VALUES[command]
    recipes: list[str] = []
    seen: set[str] = set()
    values: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        if arg in flags:
            seen.add(arg)
        elif arg in options or (eq and name.startswith("--") and name in options):
            if not eq:
                if i + 1 == len(args):
                    return None
                i += 1
                value = args[i]
            if not value or value.startswith("-"):
                return None
            values[name] = value          # the last of a repeated option wins, as in click
        elif arg and not arg.startswith("-"):
            recipes.append(arg)
        else:
            return None
        i += 1
    jobs = values.pop("-j", None) or values.pop("--jobs", None)
    if jobs is not None and not (jobs.isascii() and jobs.isdigit() and int(jobs) >= 1):
        return None
    if values.pop("--executor", "local") != "local":
        return None
    return command, recipes, seen, values


def answer(argv: list[str]) -> int | None:
    """Print the cached answer of a plan or compile command line and return its exit code; None on any miss."""
    global _dists_at_start
    parsed = parse(argv)
    if parsed is None or not plancache.enabled():
        return None
    command, recipes, flags, values = parsed
    plancache.start_recording()       # what this command reads from here on is what its answer depends on
    _dists_at_start = plancache.distributions()
    try:
        inv = plancache.invocation(command, recipes, "--all" in flags, "--json" in flags,
                                   values.get("--lock", "artifacts.lock"), values.get("--store"))
        root = _store_root(values.get("--store"))
    except OSError:
        return None         # no working directory, say: the full command line reports it
    cached = plancache.load(root, inv, _dists_at_start)
    if cached is None:
        if command != "plan" or not _local_only():
            return None
        reached, code = planserver.ask(argv, STARTED_NS)
        if code is not None:
            return code
        code = _plan_in_full(recipes, "--all" in flags, "--json" in flags, values)
        if not reached:
            planserver.start()      # for the next plan that misses
        return code
    from . import render

    if command == "plan":
        render.print_plan(cached["plan"], cached["status"], "--json" in flags, cached.get("trees"))
    else:
        _print_noop_build(cached["plan"], cached["manifests"], "--json" in flags)
    return 0


def _store_root(flag: str | None):
    """Where the store is: --store, else $QBUILD_STORE, else the per-user cache (qbuild.store.default_store_path,
    which imports the store). Only the lookup uses this: an entry is written where the full path's store is, and
    records the environment and options that chose it, so a root computed differently here can only miss."""
    from pathlib import Path

    if flag:
        return Path(flag).resolve()
    if os.environ.get("QBUILD_STORE"):
        return Path(os.environ["QBUILD_STORE"]).resolve()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return (Path(base) / "qbuild" / "store").resolve()


def _plan_in_full(recipes: list[str], all_: bool, as_json: bool, values: dict[str, str]) -> int | None:
    """`qbuild plan` as cli.plan runs it, for a local store. None where the full command line must run it: a remote
    is configured, or planning raised (it wrote nothing a second run could trip over, and the command line reports
    errors its own way)."""
    if not _local_only():
        return None
    from pathlib import Path

    from .render import print_plan
    from .store import StoreSpec, default_store_path
    from .workspace import Workspace

    store, lock = values.get("--store"), Path(values.get("--lock", "artifacts.lock"))
    root = Path(store) if store else default_store_path()
    ws = Workspace(StoreSpec(local=str(root.resolve())), lock_path=lock)
    try:
        plan, status = ws.plan(ws.load(recipes, all_))
    except Exception:
        return None
    trees = print_plan(plan, status, as_json)
    remember_plan(ws, recipes, all_, as_json, lock, store, plan, status, trees)
    return 0


def _local_only() -> bool:
    """No remote is configured: only then is a plan answered here (a remote's entries are not local files)."""
    return not (os.environ.get("QBUILD_REMOTE") or os.path.exists("qbuild.yaml"))


def plan_request(argv: list[str], started_ns: int) -> int | None:
    """`argv` planned in full, as the command line that started at `started_ns` plans it on a cache miss (for the
    resident planner's children, qbuild.planserver); None where the full command line must run it."""
    global STARTED_NS, _dists_at_start
    parsed = parse(argv)
    if parsed is None or parsed[0] != "plan" or not plancache.enabled():
        return None
    _, recipes, flags, values = parsed
    STARTED_NS = started_ns
    plancache.start_recording()
    _dists_at_start = plancache.distributions()
    return _plan_in_full(recipes, "--all" in flags, "--json" in flags, values)


def _print_noop_build(plan, manifests: dict, as_json: bool) -> None:
    """What `qbuild compile` prints when every node is cached: the engine's "cached" event for each node in plan
    order, then the result."""
    from .render import BuildProgress, print_build_result

    result = SimpleNamespace(manifests=manifests, built=[], cached=list(plan.nodes), failed={}, skipped=[],
                             deferred=[], ok=True)
    with BuildProgress() as progress:
        for nid, node in plan.nodes.items():
            progress.on_event(SimpleNamespace(kind="cached", node=node, manifest=manifests[nid], error=None,
                                              seconds=0.0))
    print_build_result(plan, result, progress, as_json)


# --- recording, from the full path --------------------------------------------------------------------------------

def remember_plan(ws, recipes: list[str], all_: bool, as_json: bool, lock, store, plan, status: dict,
                  trees: dict[str, str] | None = None) -> bool:
    """Record what `qbuild plan` answered, with its inputs (and the text it printed, JSON or plain-text trees, which
    depends on nothing else: the same plan at the same width prints the same); returns whether an entry was written."""
    if not _recordable(ws):
        return False
    store_obj = ws.store

    def manifests(inputs):
        for st in status.values():
            if st.key is not None:
                plancache.add_manifest(inputs, store_obj, st.key, st.manifest)

    answer = {"plan": plan, "status": status, "trees": trees or {}}
    return _remember(ws, "plan", recipes, all_, as_json, lock, store, plan, answer, manifests)


def remember_compile(ws, recipes: list[str], all_: bool, as_json: bool, lock, store, plan, result) -> bool:
    """Record a compile that built nothing. Its lockfile is then current: had this run rewritten it, the file's new
    timestamp keeps the entry from being written, and the next no-op records it."""
    if not _recordable(ws) or result.built or not result.ok or set(result.manifests) != set(plan.nodes):
        return False
    store_obj = ws.store

    def manifests(inputs):
        for m in result.manifests.values():
            plancache.add_manifest(inputs, store_obj, m.key, m)

    answer = {"plan": plan, "manifests": result.manifests}
    return _remember(ws, "compile", recipes, all_, as_json, lock, store, plan, answer, manifests)


def _recordable(ws) -> bool:
    return plancache.enabled() and ws.store_spec.remote is None


def _remember(ws, command, recipes, all_, as_json, lock, store, plan, answer, add_manifests) -> bool:
    """Record the answer, if this process noted what it read from its start (plancache.start_recording)."""
    from .errors import InfraError

    reads = plancache.stop_recording()
    if reads is None:
        return False
    try:
        inputs = plancache.planning_inputs(plan, ws.recipe_files(recipes, all_), ws.lock_path, all_, ws.root)
        add_manifests(inputs)
        plancache.add_reads(inputs, reads, ws.store_spec.local)
        inv = plancache.invocation(command, recipes, all_, as_json, lock, store)
        return plancache.save(ws.store_spec.local, inv, answer, inputs, STARTED_NS, _dists_at_start)
    except (plancache.Uncacheable, OSError, InfraError):
        return False     # the answer stands; the next run plans in full again
