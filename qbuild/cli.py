"""The qbuild command line: parse flags, call the library, render. stdout carries data; stderr the rest."""

import errno
import os
import signal
import sys


def _interrupted_outside_a_command(signum, frame) -> None:
    # Ctrl-C while the modules load or after the command returned: nothing is half-written there, and a
    # KeyboardInterrupt raised in an import or in the exit path would print a traceback instead of the one line.
    os.write(2, b"interrupted\n")
    os._exit(130)


# Only where this module is the program (`qbuild`, `python -m qbuild.cli`): a process that imports it as a library
# keeps its own Ctrl-C.
if __name__ == "__main__" or os.path.basename((sys.argv or [""])[0]) == "qbuild":
    signal.signal(signal.SIGINT, _interrupted_outside_a_command)
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

import qbuild
from qbuild.backends import NAMES as BACKEND_NAMES
from qbuild.core import jsonio
from qbuild.core.errors import QbuildError, UserError
from qbuild.model.families import FAMILIES

app = typer.Typer(add_completion=True, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Build, verify and publish compiled Qwen3.5 / Qwen3-Next artifacts from YAML recipes.")
recipe_app = typer.Typer(no_args_is_help=True, help="Validate recipes and print their schema.")
lock_app = typer.Typer(no_args_is_help=True, help="Check the lockfile against the store; move its Hub pins.")
store_app = typer.Typer(no_args_is_help=True, help="Inspect and repair the local store.")
app.add_typer(recipe_app, name="recipe")
app.add_typer(lock_app, name="lock")
app.add_typer(store_app, name="store")

# Enums make click check the value and name the choices in --help and in its usage error.
BackendName = Enum("BackendName", {name: name for name in BACKEND_NAMES}, type=str)
ExecutorName = Enum("ExecutorName", {name: name for name in ("local", "ray")}, type=str)

StoreOpt = typer.Option(None, "--store", envvar="QBUILD_STORE",
                        help="local store directory [default: $XDG_CACHE_HOME/qbuild/store, or ~/.cache/qbuild/store]")
LockOpt = typer.Option(Path("artifacts.lock"), "--lock", help="lockfile path")
JsonOpt = typer.Option(False, "--json", help="machine-readable output on stdout")
AllOpt = typer.Option(False, "--all", help="every recipe in ./recipes")
BackendOpt = typer.Option(None, "--backend",
                          help="build on this backend instead of the recipe's (e.g. a CPU proof of a neuron recipe; "
                               "locked as <name>@<backend>)")
RemoteOpt = typer.Option(None, "--remote", metavar="s3://BUCKET/PREFIX", envvar="QBUILD_REMOTE",
                         help="remote store to read through [default: remote: in ./qbuild.yaml]")
AllowUnverifiedOpt = typer.Option(False, "--allow-unverified", help="use a locked bundle whose verify did not pass")
StrictOpt = typer.Option(False, "--strict",
                         help="refuse a locked recipe whose recipe file changed since it was locked (or whose change "
                              "cannot be told here) instead of naming the change")


def _version(value: bool) -> None:
    if value:
        print(f"qbuild {qbuild.__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="print the version and exit")) -> None:
    """Takes --version before any command runs; the commands do the work."""


def _workspace(store: Optional[Path], lock: Path, remote: Optional[str] = None, push: bool = False,
               backend: Optional[BackendName] = None, transfers=None):
    """The command's Workspace; `transfers` (a render.TransferDisplay) shows what its remote-backed store moves."""
    from qbuild.store import StoreSpec, default_store_path, resolve_remote
    from qbuild.execution.workspace import Workspace

    root = store or default_store_path()
    url = resolve_remote(remote)
    if push and url is None:
        raise UserError("--push needs a remote: pass --remote s3://bucket/prefix, set QBUILD_REMOTE, "
                        "or add remote: to ./qbuild.yaml")
    if url is not None:
        from qbuild.store.s3 import parse_remote

        parse_remote(url)  # a malformed URL is a one-line error before any work starts
    spec = StoreSpec(local=str(root.resolve()), remote=url, push=push)
    return Workspace(spec, lock_path=lock, backend=None if backend is None else backend.value, progress=transfers)


def _err(msg: str) -> None:
    from qbuild.render import console_err

    console_err().print(msg, markup=False, highlight=False, soft_wrap=True)


# --- plan ------------------------------------------------------------------------------------------------------

KeepOpt = typer.Option(False, "--keep-intermediates",
                       help="also write out each recipe's converted (unsharded) weights into the store, for debugging; "
                            "a build otherwise only describes them (docs/bytes.md)")
PlanFormat = Enum("PlanFormat", {name: name for name in ("tree", "json", "dot", "mermaid")}, type=str)


@app.command()
def plan(recipes: list[str] = typer.Argument(None, help="recipe files"), all_: bool = AllOpt,
         fmt: Optional[PlanFormat] = typer.Option(None, "--format",
                                                  help="tree (default), json, or the DAG as Graphviz dot or Mermaid "
                                                       "text [default: tree]"),
         json_: bool = typer.Option(False, "--json", help="the same as --format json"),
         keep_intermediates: bool = KeepOpt, store: Optional[Path] = StoreOpt, lock: Path = LockOpt,
         remote: Optional[str] = RemoteOpt, backend: Optional[BackendName] = BackendOpt) -> None:
    """Show what would be built and why, as a tree per recipe (downloads nothing; a remote is only asked)."""
    from qbuild.render import print_plan

    if json_ and fmt not in (None, PlanFormat.json):
        raise UserError(f"--json and --format {fmt.value}: --json is --format json; give one of them")
    ws = _workspace(store, lock, remote, backend=backend)
    ws.keep_intermediates = keep_intermediates
    the_plan, status = ws.plan(ws.load(recipes or [], all_))
    print_plan(the_plan, status, "json" if json_ else (fmt or PlanFormat.tree).value)


# --- report ----------------------------------------------------------------------------------------------------

@app.command()
def report(recipes: list[str] = typer.Argument(None, help="recipe files [default: every recipe of the lockfile]"),
           all_: bool = AllOpt,
           out: Path = typer.Option(Path(".qbuild/report.html"), "--out", help="the HTML file to write"),
           bench: list[Path] = typer.Option(None, "--bench", metavar="FILE",
                                            help="a `qbuild bench --json` (or --out) document to chart; repeatable"),
           json_: bool = JsonOpt, store: Optional[Path] = StoreOpt, lock: Path = LockOpt,
           remote: Optional[str] = RemoteOpt, backend: Optional[BackendName] = BackendOpt) -> None:
    """Write one self-contained HTML page: the DAG with each node's status, key and size, the last build's
    timeline, the verify reports against their thresholds, and TTFT / TPOT charts of bench results."""
    from qbuild import report as reportmod
    from qbuild.render import report_written
    from qbuild.store import atomic_write, lock as lockmod

    benches = [reportmod.read_bench(f) for f in bench or []]   # a bad document is refused before any work
    if out.is_dir():
        raise UserError(f"--out {out}: is a directory; name the HTML file to write")
    ws = _workspace(store, lock, remote, backend=backend)
    doc = lockmod.read(lock)
    if recipes or all_:
        loaded = ws.load(recipes or [], all_)
    elif not lock.exists():
        raise UserError(f"{lock}: no lockfile; name recipe files, pass --all, or point --lock at a lockfile")
    else:
        loaded = reportmod.locked_recipes(doc, lock, None if backend is None else backend.value)
    the_plan, status = ws.plan(loaded)
    html, data, notes = reportmod.make(the_plan, status, ws.store, doc, lock, benches)
    atomic_write(out, html.encode())
    report_written(out, data.shown(), notes, json_)


# --- compile ---------------------------------------------------------------------------------------------------

@app.command()
def compile(ctx: typer.Context, recipes: list[str] = typer.Argument(None, help="recipe files"), all_: bool = AllOpt,
            jobs: Optional[int] = typer.Option(None, "-j", "--jobs", min=1,
                                               help="steps run at once (default: 1 locally, 256 in flight on Ray)"),
            mem: Optional[str] = typer.Option(None, "--mem", help="memory budget for concurrent steps, e.g. 20G"),
            keep_going: bool = typer.Option(False, "--keep-going", help="build what does not depend on a failure"),
            frozen: bool = typer.Option(False, "--frozen", help="fail instead of changing the lockfile (CI)"),
            update: bool = typer.Option(False, "--update",
                                        help="first resolve these recipes' Hub revisions again and move their pins "
                                             "(as `qbuild lock update`), then accept outputs (and a pinned commit's "
                                             "files) that differ from the lock's under its keys"),
            strict: bool = typer.Option(False, "--strict", help="fail, naming the step, instead of building anything"),
            push: bool = typer.Option(False, "--push", help="upload what was built (and anything the remote lacks)"),
            skip_device: bool = typer.Option(False, "--skip-device",
                                             help="leave steps that need a Neuron device (verifying a neuron bundle) "
                                                  "unbuilt on a host without one, instead of failing, and the "
                                                  "steps only they need (its reference)"),
            keep_intermediates: bool = KeepOpt, json_: bool = JsonOpt, store: Optional[Path] = StoreOpt, lock: Path = LockOpt,
            remote: Optional[str] = RemoteOpt, backend: Optional[BackendName] = BackendOpt,
            verbose: bool = typer.Option(False, "-v", "--verbose",
                                         help="also show what each step's libraries printed (warnings, progress)"),
            executor: ExecutorName = typer.Option(ExecutorName.local, "--executor",
                                                  help="where steps run: a local process pool, or a Ray cluster "
                                                       "(needs a remote; see docs/ray.md)"),
            address: Optional[str] = typer.Option(
                None, "--address", metavar="auto|HOST:PORT|ray://HOST:PORT", envvar="RAY_ADDRESS",
                help="Ray cluster for --executor ray [default: auto: the cluster `ray start` runs on this "
                     "machine]")) -> None:
    """Build what is not cached: fetch, convert, shard, compile per bucket, package, reference, verify."""
    from qbuild.execution.engine import BuildOptions, raise_for
    from qbuild.render import BuildProgress, TransferDisplay, print_build_result
    from qbuild.core.units import parse_size

    if update and frozen:
        raise UserError("--update and --frozen: --update changes the lockfile's pins, --frozen forbids any change")
    explicit_budget = None if mem is None else parse_size(mem, "--mem", allow_zero=False)
    ws = _workspace(store, lock, remote, push=push, backend=backend, transfers=TransferDisplay(bars=False))
    ws.keep_intermediates = keep_intermediates
    # $RAY_ADDRESS is meant for Ray: a local build ignores it; only an --address given here must go with Ray.
    source = ctx.get_parameter_source("address")
    address_given = source is not None and source.name == "COMMANDLINE"
    factory, jobs, default_mem = _executor(executor.value, address, address_given, jobs, ws)
    loaded = ws.load(recipes or [], all_)
    budget = explicit_budget if mem is not None else default_mem
    options = BuildOptions(jobs=jobs, mem_budget=budget, keep_going=keep_going, strict=strict,
                           skip_device=skip_device,
                           mem_source=f"--mem {mem}" if mem is not None else "90% of this host's memory; --mem sets it")
    if update:
        from qbuild.render import print_pin_moves

        print_pin_moves(ws.update_pins(loaded), False)
    with BuildProgress(verbose=verbose, lock=lock) as progress:
        the_plan, result, rebuilt = ws.compile(loaded, options, factory, progress.on_event, frozen=frozen,
                                               update=update)
    pushed = _push_results(ws, result) if push else None
    extra = {"pushed": pushed.to_json()} if pushed is not None else {}
    if rebuilt is not None:
        extra["rebuilt_for_platform"] = rebuilt.to_json()
    print_build_result(the_plan, result, progress, json_, extra or None)
    if rebuilt is not None:
        _err(rebuilt.line())
    raise_for(result, the_plan)


RAY_JOBS = 256      # steps in flight on a Ray cluster by default; Ray queues them by their declared resources


def _executor(name: str, address: Optional[str], address_given: bool, jobs: Optional[int], ws):
    """(executor factory, jobs, default memory budget) for --executor. Ray is imported only when a step runs."""
    if name == "local":
        if address_given:
            raise UserError("--address: only used with --executor ray")
        from qbuild.execution.executors.local import LocalExecutor

        jobs = jobs or 1
        return (lambda: LocalExecutor(jobs)), jobs, _default_mem()
    if name == "ray":
        from qbuild.execution.executors.ray import RayExecutor, require_remote

        require_remote(ws.store_spec)
        address = address or "auto"
        # No default budget: each Ray task reserves its own memory estimate on the worker that runs it.
        return (lambda: RayExecutor(ws.store, address, ws.registry)), jobs or RAY_JOBS, None
    raise AssertionError(f"--executor {name}: click lets only the ExecutorName choices through")


def _push_results(ws, result):
    """After a --push build: everything the build produced or found must be on the remote (the workers pushed what
    they built; this uploads cached entries the remote lacks, and fails with exit 3 if the remote is gone)."""
    from qbuild.render import pushed_text
    from qbuild.store.remote import push_manifests

    store = ws.store
    report = push_manifests(store.local, store.remote, list(result.manifests.values()), store.progress)
    pushed_text(report, store.remote.url)
    return report


def _default_mem() -> int:
    """90% of physical memory: the budget concurrent steps share unless --mem says otherwise."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.9)


# --- explain ---------------------------------------------------------------------------------------------------

@app.command()
def explain(target: str = typer.Argument(..., help="a recipe file, or a node id (prefix) / name from `qbuild plan`"),
            recipes: list[str] = typer.Option(None, "--recipe", help="recipes to search for a node (default: --all)"),
            json_: bool = JsonOpt, store: Optional[Path] = StoreOpt, lock: Path = LockOpt,
            remote: Optional[str] = RemoteOpt, backend: Optional[BackendName] = BackendOpt) -> None:
    """Say why a node (or each node of a recipe) would rebuild: the key fields that changed, or "cached"."""
    ws = _workspace(store, lock, remote, backend=backend)
    if target.endswith((".yaml", ".yml")) or Path(target).is_file():
        loaded = ws.load([target])
        the_plan, status = ws.plan(loaded)
        chosen = list(the_plan.recipes[loaded[0].name].nodes.values())
    else:
        the_plan, status = ws.plan(ws.load(recipes or [], all_=not recipes))
        chosen = [nid for nid, n in the_plan.nodes.items() if nid.startswith(target) or n.name == target
                  or (status[nid].key or "").startswith(target)]
        if not chosen:
            raise UserError(f"{target}: no node of the planned recipes has this id, key or name; see `qbuild plan`")
    from qbuild.render import print_explain

    print_explain(the_plan, status, ws.explain(the_plan, status), chosen, json_)


# --- publish, pull, gc -----------------------------------------------------------------------------------------

PublishWhat = Enum("PublishWhat", {name: name for name in ("bundles", "all")}, type=str)


@app.command()
def publish(recipes: list[str] = typer.Argument(None, help="recipe names (or files) as in the lockfile"),
            all_: bool = typer.Option(False, "--all", help="every recipe in the lockfile"),
            verify_remote: bool = typer.Option(False, "--verify-remote",
                                               help="read back every blob the remote has for these recipes, check "
                                                    "its digest, and upload again any missing or corrupt one"),
            what: PublishWhat = typer.Option(PublishWhat.all, "--what",
                                             help="all: every locked step; bundles: what pull and a rebuild "
                                                  "elsewhere need (all but the reference logits; docs/bytes.md)"),
            remote: Optional[str] = RemoteOpt, json_: bool = JsonOpt, store: Optional[Path] = StoreOpt,
            lock: Path = LockOpt) -> None:
    """Upload the locked artifacts of recipes to the remote: blobs it lacks first, then each manifest."""
    from qbuild.store import lock as lockmod
    from qbuild.render import TransferDisplay, print_published
    from qbuild.store.transfer import publish as publish_locked, recipe_names

    ws = _workspace(store, lock, remote, transfers=TransferDisplay())
    if ws.store_spec.remote is None:
        raise UserError("publish needs a remote: pass --remote s3://bucket/prefix, set QBUILD_REMOTE, "
                        "or add remote: to ./qbuild.yaml")
    doc = lockmod.read(lock)
    names = recipe_names(doc, lock, recipes or [], all_)
    report = publish_locked(ws.store, doc, lock, names, verify_remote=verify_remote, what=what.value)
    print_published(names, ws.store.remote.url, report, json_)


@app.command()
def pull(recipe: str = typer.Argument(..., help="recipe name (or file) as in the lockfile"),
         to: Path = typer.Option(..., "--to", help="directory to lay the bundle out in (new or empty)"),
         remote: Optional[str] = RemoteOpt, json_: bool = JsonOpt, store: Optional[Path] = StoreOpt,
         lock: Path = LockOpt,
         allow_unverified: bool = typer.Option(False, "--allow-unverified",
                                               help="lay out a bundle whose verify did not pass"),
         strict: bool = StrictOpt) -> None:
    """Lay out a recipe's locked bundle in a directory (from the remote when not local); every digest is checked."""
    from qbuild.store import lock as lockmod
    from qbuild.render import TransferDisplay, print_pulled
    from qbuild.store.transfer import pull_bundle

    _check_new_dir(to, "the --to directory", "pull into a new or empty one")
    ws = _workspace(store, lock, remote, transfers=TransferDisplay())
    if not lock.exists():
        raise UserError(f"{lock}: no lockfile; pull lays out what a lockfile names")
    doc = lockmod.read(lock)
    _name_a_changed_recipe(ws, doc, lock, lockmod.resolve_recipe(doc, lock, recipe), strict)
    # Root ignores the read-only bit that protects the store's blobs, so a root-owned bundle must not share their
    # inodes: an edit to a bundle file would change the store's copy (and every other bundle made from it).
    manifest = pull_bundle(ws.store, doc, lock, recipe, to, share=os.geteuid() != 0,
                           allow_unverified=allow_unverified)
    print_pulled(recipe, to, manifest, _serve_instructions(to), json_)


def _serve_instructions(bundle: Path) -> dict | None:
    """How to serve a pulled bundle (a neuron bundle with vLLM), as its backend says; None where it names none."""
    from qbuild import backends
    from qbuild.store.bundle import MANIFEST, read_manifest

    if not (bundle / MANIFEST).is_file():   # a bundle of test-defined steps records no backend
        return None
    manifest = read_manifest(bundle)
    return backends.server(manifest["backend"]).serve_instructions(bundle.resolve(), manifest)


def _name_a_changed_recipe(ws, doc: dict, lock: Path, name: str, strict: bool) -> str | None:
    """Name, in a note on stderr, how a locked recipe's file changed since it was locked (qbuild.planning.drift), or
    with --strict refuse it; returns the note (None: unchanged, or no recipe file here to compare)."""
    from qbuild.planning.drift import recipe_change

    change = recipe_change(doc, lock, name, ws.stat_cache, ws.backends)
    if change is None:
        return None
    if strict:
        raise UserError(f"{change.line()}; --strict refuses the locked one")
    _err(f"note: {change.line()}")
    return change.line()


@app.command("gc")
def gc_cmd(dry_run: bool = typer.Option(False, "--dry-run", help="print what would be removed; remove nothing"),
           keep_size: str = typer.Option("10G", "--keep-size", metavar="SIZE",
                                         help="unlocked entries and Neuron compile cache kept locally, most "
                                              "recently used first; the cache's budget also on the remote (e.g. 20G, "
                                              "0)"),
           grace: str = typer.Option("1h", "--grace", metavar="AGE",
                                     help="entries written this recently are kept, as is everything a running "
                                          "build holds (e.g. 30m, 2h, 0)"),
           remote: Optional[str] = typer.Option(None, "--remote", metavar="s3://BUCKET/PREFIX",
                                                help="also remove remote entries no given lockfile references "
                                                     "(only when passed here, never from config)"),
           locks: list[Path] = typer.Option(None, "--lock", help="lockfiles whose artifacts are kept (repeatable) "
                                                                 "[default: artifacts.lock]"),
           json_: bool = JsonOpt, store: Optional[Path] = StoreOpt) -> None:
    """Remove store entries no lockfile references (beyond --keep-size locally; all of them on --remote)."""
    from qbuild import backends
    from qbuild.store.gc import gc_local, gc_remote
    from qbuild.render import print_gc
    from qbuild.core.units import parse_duration, parse_size

    budget, grace_s = parse_size(keep_size, "--keep-size"), parse_duration(grace, "--grace")
    if remote is not None:
        from qbuild.store.s3 import parse_remote

        parse_remote(remote)   # a bad URL is refused before the local store is touched
    lock_paths = locks or [Path("artifacts.lock")]
    missing = [str(p) for p in lock_paths if not p.exists()]
    if missing:
        raise UserError(f"{missing[0]}: no such lockfile; gc keeps only what lockfiles reference, so it needs them")
    from qbuild.store import LocalStore, default_store_path

    # Each gc reads the lockfiles itself, after the leases of the builds running: read here, before them, they would
    # miss what a build that ended in between locked (qbuild/store/gc.py).
    caches = backends.side_caches()
    reports = [gc_local(LocalStore((store or default_store_path()).resolve()), lock_paths, budget, dry_run=dry_run,
                        grace_s=grace_s, caches=caches)]
    # Deleting shared artifacts needs an explicit --remote; $QBUILD_REMOTE and qbuild.yaml never do it.
    if remote is not None:
        from qbuild.store.s3 import S3Remote

        reports.append(gc_remote(S3Remote(remote, probe=True), lock_paths, keep_size=budget, dry_run=dry_run,
                                 grace_s=grace_s, caches=caches))
    print_gc(reports, ["local store", remote], json_)


# --- lock, store, recipe ---------------------------------------------------------------------------------------

@lock_app.command("check")
def lock_check(recipes: list[str] = typer.Argument(None, help="recipe names or files (default: every locked one)"),
               store: Optional[Path] = StoreOpt, lock: Path = LockOpt, json_: bool = JsonOpt,
               strict: bool = StrictOpt) -> None:
    """Verify that the lockfile agrees with itself, and that every artifact it names is in the store with the right
    digest; name each recipe whose file changed since it was locked."""
    from qbuild.store import lock as lockmod

    ws = _workspace(store, lock)
    if not lock.exists():
        raise UserError(f"{lock}: no lockfile; run `qbuild compile` first")
    doc = lockmod.read(lock)
    names = [lockmod.resolve_recipe(doc, lock, r) for r in recipes] if recipes else None
    changed = [note for name in (names or sorted(doc["recipes"]))
               if (note := _name_a_changed_recipe(ws, doc, lock, name, strict)) is not None]
    problems = ws.check_lock(names)
    if json_:
        print(jsonio.dumps({"ok": not problems, "problems": problems, "changed": changed}))
    for p in problems:
        _err(p)
    if problems:
        raise typer.Exit(1)
    if not json_:
        _err(f"{lock}: every locked artifact is in the store with the right digest")


@lock_app.command("update")
def lock_update(recipes: list[str] = typer.Argument(None, help="recipe names or files (default: every locked one)"),
                lock: Path = LockOpt, json_: bool = JsonOpt) -> None:
    """Resolve the recipes' Hub revisions (branches, tags) again and move their pins; nothing else changes."""
    from qbuild.render import print_pin_moves
    from qbuild.recipe.schema import load_recipe
    from qbuild.store import lock as lockmod

    ws = _workspace(None, lock)   # it plans nothing and opens no store: it only asks the Hub
    doc = lockmod.read(lock)
    if recipes:
        loaded = [_locked_or_file(doc, lock, r, load_recipe) for r in recipes]
    else:
        if not doc["recipes"]:
            raise UserError(f"{lock}: no locked recipes; name the recipe files to pin")
        # A recipe whose file is gone keeps its pin (a name given on the command line is refused instead): one
        # deleted recipe must not stop the others' pins from moving.
        present = [name for name in sorted(doc["recipes"]) if lockmod.recipe_file(doc["recipes"][name], lock).is_file()]
        for name in sorted(set(doc["recipes"]) - set(present)):
            _err(f"note: {name}: locked from {lockmod.recipe_file(doc['recipes'][name], lock)}, which no longer "
                 "exists; its pin stays as it is")
        if not present:
            raise UserError(f"{lock}: the file of every locked recipe is gone; name the recipe files to pin")
        loaded = [_locked_recipe(doc, lock, name, load_recipe) for name in present]
    print_pin_moves(ws.update_pins(loaded), json_)


def _locked_or_file(doc: dict, lock: Path, arg: str, load_recipe):
    """A recipe a command-line argument names: a locked recipe (by name or file), else a recipe file."""
    from qbuild.store import lock as lockmod

    try:
        return _locked_recipe(doc, lock, lockmod.resolve_recipe(doc, lock, arg), load_recipe)
    except UserError:
        if not Path(arg).is_file():
            raise
        return load_recipe(Path(arg))


def _locked_recipe(doc: dict, lock: Path, name: str, load_recipe):
    """A locked recipe, loaded from the file the lock records, under its locked name (`<name>@<backend>` for a build
    on another backend, which shares the recipe's model)."""
    from qbuild.store import lock as lockmod

    path = lockmod.recipe_file(doc["recipes"][name], lock)
    if not path.is_file():
        raise UserError(f"{lock}: recipe {name!r} was locked from {path}, which no longer exists")
    loaded = load_recipe(path)
    backend = name.partition("@")[2]
    return loaded.with_backend(backend) if backend else loaded


@store_app.command("verify")
def store_verify(repair: bool = typer.Option(False, "--repair", help="drop corrupt entries, orphaned staging and "
                                                                     "incomplete compile cache entries"),
                 store: Optional[Path] = StoreOpt, json_: bool = JsonOpt) -> None:
    """Check every blob's digest and every manifest; with --repair, remove what is broken so it gets rebuilt."""
    from qbuild import backends

    ws = _workspace(store, Path("artifacts.lock"))
    # The backends' side caches are checked here, not by LocalStore.verify, whose module every build step imports:
    # a cache's remote code (and boto3) stays out of their keys.
    problems = ws.store.local.verify(repair=repair)
    problems += [p for cache in backends.side_caches() for p in cache.verify(ws.store.local, repair)]
    if json_:
        print(jsonio.dumps({"ok": not problems, "problems": problems, "repaired": repair}))
    for p in problems:
        _err(("repaired: " if repair else "") + p)
    if problems and not repair:
        raise typer.Exit(1)


@recipe_app.command("validate")
def recipe_validate(files: list[Path] = typer.Argument(..., help="recipe files"), json_: bool = JsonOpt) -> None:
    """Validate recipes against the schema and against their model's architecture."""
    from qbuild import backends
    from qbuild.planning.plan import validate_recipe
    from qbuild.hub.checkpoint import load_arch
    from qbuild.recipe.schema import load_recipe

    results, failed = [], []
    for f in files:
        try:
            loaded = load_recipe(f)
            arch = load_arch(loaded)
            validate_recipe(loaded, arch, backends)
        except QbuildError as e:
            failed.append(e)
            results.append({"file": str(f), "ok": False, "error": str(e)})
            continue
        results.append({"file": str(f), "ok": True, "name": loaded.name, "family": arch.family})
        if not json_:
            _err(f"{f}: ok")
    if json_:   # the document for every file, also when some are bad (then the exit code is theirs)
        print(jsonio.dumps({"ok": not failed, "recipes": results}))
    for e in failed:
        _err(f"error: {e}")
    if failed:
        raise typer.Exit(max(e.exit_code for e in failed))


@recipe_app.command("schema")
def recipe_schema() -> None:
    """Print the recipe JSON Schema (for editors)."""
    from qbuild.backends import NAMES
    from qbuild.recipe.schema import recipe_json_schema

    print(jsonio.dumps(recipe_json_schema(NAMES), indent=1, sort_keys=True))


@app.command()
def tiny(family: str = typer.Argument(..., help=" | ".join(FAMILIES)),
         out: Path = typer.Argument(..., help="directory to write the checkpoint into (new or empty)"),
         seed: int = typer.Option(0, min=0, help="random seed (0 or more)"),
         fused_experts: bool = typer.Option(False, help="MoE experts in the fused 3D form"),
         force: bool = typer.Option(False, "--force", help="replace what a non-empty directory holds"),
         json_: bool = JsonOpt) -> None:
    """Write a tiny random checkpoint of a family (seeded, with a tokenizer) for tests and demos."""
    from qbuild.model.tinymodel import install_tiny_checkpoint

    if family not in FAMILIES:
        raise UserError(f"family: {family!r} is not one of {', '.join(FAMILIES)}")
    _check_new_dir(out, "the checkpoint directory", None)   # install refuses a non-empty one unless replace
    install_tiny_checkpoint(out, family, replace=force, seed=seed, fused_experts=fused_experts)
    if json_:
        print(jsonio.dumps({"family": family, "path": str(out), "seed": seed, "fused_experts": fused_experts}))
    else:
        _err(f"wrote a tiny {family} checkpoint to {out}")


def _check_new_dir(path: Path, what: str, if_not_empty: str | None) -> None:
    """Refuse, before any work, a directory a command would create or fill when it cannot be one: it or a parent is
    a file, or it already holds something (then `if_not_empty` says what to do; None allows it)."""
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"{path}: {what} would be under {parent}, which is not a directory")
            break
    if path.exists() and not path.is_dir():
        raise UserError(f"{path}: {what} exists and is not a directory")
    if if_not_empty is not None and path.is_dir() and any(path.iterdir()):
        raise UserError(f"{path}: {what} is not empty; {if_not_empty}")


# --- run, bench ------------------------------------------------------------------------------------------------

@contextmanager
def _runtime(target: str, store: Optional[Path], lock: Path, remote: Optional[str], allow_unverified: bool,
             strict: bool) -> Iterator:
    """A Runtime for a pulled bundle directory, or for a recipe's locked bundle laid out in a temporary directory,
    refused like `pull` refuses it (unverified, or with --strict a recipe changed since it was locked). Errors about
    the latter name the recipe, never the temporary directory the user did not choose."""
    import tempfile

    from qbuild.backends import load_runtime

    if Path(target).is_dir():
        yield load_runtime(Path(target))
        return
    from qbuild.store import lock as lockmod
    from qbuild.store.transfer import pull_bundle

    if not lock.exists():
        raise UserError(f"{target}: neither a bundle directory nor, without a lockfile ({lock}), a locked recipe")
    ws = _workspace(store, lock, remote)
    doc = lockmod.read(lock)
    _name_a_changed_recipe(ws, doc, lock, lockmod.resolve_recipe(doc, lock, target), strict)
    with tempfile.TemporaryDirectory(prefix="qbuild-run-") as tmp:
        bundle = Path(tmp) / "bundle"
        try:
            # Hardlinks are fine here: nothing writes to this layout, and it is removed afterwards.
            pull_bundle(ws.store, doc, lock, target, bundle, share=True, allow_unverified=allow_unverified)
            yield load_runtime(bundle, verify_digests=False)  # pull checked every digest
        except QbuildError as e:
            e.args = (str(e).replace(str(bundle), f"{target} (its locked bundle)"),)
            raise


def _check_prompt_flags(prompt: Optional[str], prompt_ids: Optional[str]) -> None:
    if prompt is not None and prompt_ids is not None:
        raise UserError("--prompt and --prompt-ids: give one of them, not both")
    if prompt is None and prompt_ids is None:
        raise UserError("give --prompt TEXT or --prompt-ids 1,2,3")


def _prompt_ids(runtime, prompt: Optional[str], prompt_ids: Optional[str]) -> list[int]:
    if prompt_ids is None:
        return runtime.encode(prompt)
    try:
        ids = [int(x) for x in prompt_ids.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--prompt-ids: {prompt_ids!r} is not a comma-separated list of token ids") from None
    vocab = runtime.arch.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:   # an id outside the embedding table would fail deep inside the graph
        raise UserError(f"--prompt-ids: token id {bad[0]} is outside this model's vocabulary (0..{vocab - 1})")
    return ids


@app.command()
def run(target: str = typer.Argument(..., help="a bundle directory (from `qbuild pull`), or a locked recipe"),
        prompt: Optional[str] = typer.Option(None, "--prompt", help="prompt text"),
        prompt_ids: Optional[str] = typer.Option(None, "--prompt-ids", help="prompt token ids, e.g. 1,2,3"),
        image: Optional[Path] = typer.Option(None, "--image", help="an image file (VL bundles)"),
        max_new_tokens: int = typer.Option(32, "--max-new-tokens", min=1, help="greedy tokens to generate"),
        json_: bool = JsonOpt, store: Optional[Path] = StoreOpt, lock: Path = LockOpt,
        remote: Optional[str] = RemoteOpt, allow_unverified: bool = AllowUnverifiedOpt,
        strict: bool = StrictOpt) -> None:
    """Generate greedily with a bundle's compiled graphs; report TTFT and TPOT."""
    from qbuild.render import generation_json, generation_text

    _check_prompt_flags(prompt, prompt_ids)
    if image is not None and not image.is_file():
        raise UserError(f"--image: {image} is not a file")
    if image is not None:   # refused before a bundle is loaded for it
        from qbuild.model.runtime.images import check_image

        check_image(image)
    with _runtime(target, store, lock, remote, allow_unverified, strict) as runtime:
        gen = runtime.generate(_prompt_ids(runtime, prompt, prompt_ids), max_new_tokens, image=image)
    if json_:
        print(jsonio.dumps(generation_json(gen), sort_keys=True))
    else:
        generation_text(gen)


@app.command()
def bench(target: str = typer.Argument(..., help="a bundle directory (from `qbuild pull`), or a locked recipe"),
          repeats: int = typer.Option(5, "--repeats", min=1, help="timed runs per prompt length"),
          warmup: int = typer.Option(1, "--warmup", min=0, help="untimed runs first"),
          new_tokens: Optional[int] = typer.Option(
              None, "--new-tokens", min=2,
              help="tokens generated per run; more than the KV cache holds after the longest prompt is refused "
                   "[default: 16, or as many as it holds]"),
          out: Optional[Path] = typer.Option(None, "--out", help="also write the JSON document here"),
          json_: bool = JsonOpt, store: Optional[Path] = StoreOpt, lock: Path = LockOpt,
          remote: Optional[str] = RemoteOpt, allow_unverified: bool = AllowUnverifiedOpt,
          strict: bool = StrictOpt) -> None:
    """Sweep prompt lengths 16, 64, 256, ... up to the largest CTE bucket; print TTFT / TPOT statistics."""
    from qbuild.render import bench_table
    from qbuild.model.runtime.bench import bench as run_bench, to_json

    if out is not None:   # refused before the bundle is laid out and the sweep runs
        _check_new_dir(out.parent, "the --out file's directory", None)
        if out.is_dir():
            raise UserError(f"--out {out}: is a directory; name a file")
    with _runtime(target, store, lock, remote, allow_unverified, strict) as runtime:
        doc = to_json(run_bench(runtime, repeats=repeats, warmup=warmup, new_tokens=new_tokens), runtime.manifest)
    text = jsonio.dumps(doc, indent=1, sort_keys=True)
    if out is not None:
        from qbuild.store import atomic_write

        atomic_write(out, (text + "\n").encode())
    if json_:
        print(text)
    else:
        bench_table(doc)


# --- serve -----------------------------------------------------------------------------------------------------

@app.command()
def serve(target: str = typer.Argument(..., help="a bundle directory (from `qbuild pull`), or a locked recipe"),
          server_args: Optional[list[str]] = typer.Argument(
              None, metavar="VLLM_ARGS",
              help="after --, arguments handed to vLLM as they are (a neuron bundle): --chat-template, "
                   "--enable-auto-tool-choice --tool-call-parser NAME, --reasoning-parser NAME, ...; the lengths, "
                   "parallelism and cache flags come from the bundle and are refused here"),
          host: str = typer.Option("127.0.0.1", "--host", help="address to listen on"),
          port: int = typer.Option(8000, "--port", min=0, max=65535, help="port to listen on (0: any free one)"),
          dry_run: bool = typer.Option(False, "--dry-run",
                                       help="print how the bundle would be served (for a neuron bundle the exact vLLM "
                                            "command and environment) and exit; a recipe's bundle is then laid out "
                                            "in a temporary directory that is gone afterwards"),
          ready_file: Optional[Path] = typer.Option(None, "--ready-file",
                                                    help="write the server's base URL to this file once it answers "
                                                         "requests"),
          allow_unverified: bool = typer.Option(False, "--allow-unverified",
                                                help="serve a locked recipe whose verify did not pass"),
          api_key: Optional[str] = typer.Option(None, "--api-key", envvar="QBUILD_API_KEY", show_default=False,
                                                help="require `Authorization: Bearer KEY` on every request (prefer "
                                                     "the environment variable: a command line is visible to other "
                                                     "users)"),
          allow_image_urls: bool = typer.Option(False, "--allow-image-urls",
                                                help="fetch the http(s) image URLs chat requests name (a VL CPU "
                                                     "bundle); without it only data: URLs are taken, since a fetch "
                                                     "reaches whatever the server's network reaches"),
          json_: bool = JsonOpt, store: Optional[Path] = StoreOpt, lock: Path = LockOpt,
          remote: Optional[str] = RemoteOpt, strict: bool = StrictOpt) -> None:
    """Serve a bundle's OpenAI-compatible endpoint (/v1/models, /v1/completions, /v1/chat/completions) until Ctrl-C:
    qbuild's runtime for a CPU bundle, vLLM with the Neuron plugin for a neuron bundle."""
    from qbuild import backends
    from qbuild.backends.base import ServeOptions
    from qbuild.render import serve_text
    from qbuild.store import atomic_write
    from qbuild.store.bundle import read_manifest

    if ready_file is not None:
        _check_new_dir(ready_file.parent, "the --ready-file's directory", None)
        if ready_file.is_dir():
            raise UserError(f"--ready-file {ready_file}: is a directory")

    def on_ready(url: str) -> None:
        print(jsonio.dumps({"url": url}) if json_ else url, flush=True)
        _err(f"serving {options.name} at {url} (Ctrl-C stops it)")
        if ready_file is not None:
            atomic_write(ready_file, (url + "\n").encode())

    with _served_bundle(target, store, lock, remote, allow_unverified, strict) as (bundle, name, checked):
        manifest = read_manifest(bundle)
        if manifest.get("backend") not in backends.NAMES:
            raise UserError(f"{bundle}/bundle.json: backend {manifest.get('backend')!r} is not one of "
                            f"{', '.join(backends.NAMES)}; only a bundle qbuild built can be served")
        backend = backends.server(manifest["backend"])
        options = ServeOptions(name=name, host=host, port=port, log=_err, on_ready=on_ready, digests_checked=checked,
                               server_args=tuple(server_args or ()), api_key=api_key,
                               allow_image_urls=allow_image_urls)
        if dry_run:
            doc = backend.serve_command(bundle, manifest, options)
            if json_:
                print(jsonio.dumps(doc, indent=1, sort_keys=True))
            else:
                serve_text(doc)
            return
        if options.open_to_others:
            _err(f"warning: --host {host} takes requests from other machines and no --api-key is set: anyone who can "
                 "reach it can use the model; set QBUILD_API_KEY (or --api-key)")
        code = backend.serve(bundle, manifest, options)
    raise typer.Exit(code)


@contextmanager
def _served_bundle(target: str, store: Optional[Path], lock: Path, remote: Optional[str],
                   allow_unverified: bool, strict: bool) -> Iterator[tuple[Path, str, bool]]:
    """(bundle directory, the model name clients send, whether every file was checked against its digest just now):
    a pulled bundle directory as it is, named by its directory; or a locked recipe's bundle, named by the recipe,
    laid out in a temporary directory for as long as it is served. Like `pull`, serving a recipe refuses an
    unverified bundle unless allowed, and names a recipe changed since it was locked (--strict: refuses it). Errors
    name the recipe, never the temporary directory."""
    import tempfile

    if Path(target).is_dir():
        bundle = Path(target).resolve()
        yield bundle, bundle.name, False
        return
    from qbuild.store import lock as lockmod
    from qbuild.store.transfer import pull_bundle

    if not lock.exists():
        raise UserError(f"{target}: neither a bundle directory nor, without a lockfile ({lock}), a locked recipe")
    ws = _workspace(store, lock, remote)
    doc = lockmod.read(lock)
    name = lockmod.resolve_recipe(doc, lock, target)
    _name_a_changed_recipe(ws, doc, lock, name, strict)
    with tempfile.TemporaryDirectory(prefix="qbuild-serve-") as tmp:
        bundle = Path(tmp) / name
        try:
            # As `pull` lays a bundle out: root gets copies, so that no server process can change the store's blobs.
            pull_bundle(ws.store, doc, lock, name, bundle, share=os.geteuid() != 0,
                        allow_unverified=allow_unverified)
            yield bundle, name, True
        except QbuildError as e:
            e.args = (str(e).replace(str(bundle), f"{target} (its locked bundle)"),)
            raise


class OutputError(QbuildError):
    """stdout cannot take what a command prints (a full disk, /dev/full, a closed pipe): the environment's failure."""

    exit_code = 3

    def __init__(self, e: OSError):
        super().__init__(f"stdout: cannot write the output: {e.strerror or e}")
        self.broken_pipe = isinstance(e, BrokenPipeError)


class _GuardedOutput:
    """sys.stdout, whose write errors become OutputError: print(), rich and the JSON writers all write through it,
    so a failed write is one line naming stdout wherever it happens."""

    def __init__(self, stream):
        self._stream = stream   # None where the process started with stdout closed (`>&-`)

    def write(self, text: str) -> int:
        try:
            if self._stream is None:
                raise OSError(errno.EBADF, "stdout is closed")
            return self._stream.write(text)
        except OSError as e:
            raise OutputError(e) from None

    def flush(self) -> None:
        try:
            if self._stream is not None:
                self._stream.flush()
        except OSError as e:
            raise OutputError(e) from None

    def isatty(self) -> bool:
        return self._stream is not None and self._stream.isatty()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _check_cwd() -> None:
    """Every command resolves paths against the working directory; a deleted one fails each differently, deep inside
    (pathlib, torch's own loader), so it is refused first."""
    try:
        os.getcwd()
    except OSError as e:
        from qbuild.core.errors import InfraError

        raise InfraError(f"the current directory is gone ({e.strerror}: it was deleted or unmounted); cd to an "
                         "existing directory and run the command again") from None


def main() -> None:
    stdout = sys.stdout
    sys.stdout = _GuardedOutput(stdout)
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _check_cwd()
        # Without standalone mode, click returns a command's typer.Exit code instead of raising it.
        code = app(standalone_mode=False)
        sys.stdout.flush()   # output to a file is block-buffered: a full disk shows here, not at interpreter exit
    except KeyboardInterrupt:   # outside the command's own call, which typer turns into Exit(130)
        code = 130
    except Exception as e:
        code = _exit_code(e)
    signal.signal(signal.SIGINT, _interrupted_outside_a_command)
    if code == 130:
        # typer turns KeyboardInterrupt into Exit(130) and, outside standalone mode, returns it without a word;
        # no qbuild command exits 130 itself.
        _err("interrupted")
    sys.stdout = stdout
    # The command is done: a Ctrl-C now changes nothing, and the interpreter's shutdown would die of it silently
    # (it puts back the default handler of every signal it handles, but not of an ignored one).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code if isinstance(code, int) else 0)


def _exit_code(e: Exception) -> int:
    """The one mapping from an exception to a line on stderr and an exit code. Anything unknown is a bug: it raises,
    with its traceback."""
    from typer.exceptions import TyperException

    if isinstance(e, OutputError):
        # What could not be written stays in stdout's buffer; the interpreter would try again at exit and fail.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):   # no descriptor behind it
            pass
        if e.broken_pipe:   # the reader stopped reading (`| head`): quiet, as a tool killed by SIGPIPE
            return 128 + signal.SIGPIPE
    if isinstance(e, QbuildError):
        if os.environ.get("QBUILD_DEBUG"):
            raise e
        _err(f"error: {e}")
        return e.exit_code
    if isinstance(e, typer.Exit):
        return e.exit_code
    if isinstance(e, typer.Abort):   # click raises it on EOF at a prompt
        _err("aborted")
        return 130
    # click's usage errors (unknown flag or command, missing or out-of-range value), from the copy of click that
    # typer vendors (they are not click.ClickException): the usage line, the help hint and one error line.
    if isinstance(e, TyperException) and hasattr(e, "show"):
        e.show()
        return 2
    raise e


if __name__ == "__main__":
    main()
