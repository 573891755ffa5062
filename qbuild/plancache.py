"""The plan cache: a command's plan with its statuses, kept in the store beside every input planning read for it.

When none of those inputs changed since a `qbuild plan` (or a no-op `qbuild compile`) recorded its answer, the
recorded answer is the answer. The inputs, each checked on every use:

- the invocation: command, working directory, recipe arguments, --all, --lock, --store, the interpreter, sys.path;
- the environment variables that enter a key, a status or where something lives (ENV_PREFIXES, ENV_NAMES), kept
  as a digest so that no value (a token) is written to disk;
- the qbuild source: a content digest over every file of the package (stat signatures first, content on a change);
- the installed distributions (their versions enter keys): the metadata entries of every sys.path directory;
- files by stat signature (size, mtime_ns, ctime_ns, inode, device, mode), or their absence: the recipes and every
  base in their `extends` chains, the lockfile, ./qbuild.yaml, the HF cache refs and config.json a recipe resolved
  through, the manifests the statuses were read from, and each local checkpoint file. Small text files also carry
  a content digest, so a file rewritten with the same bytes still matches. Paths are kept both as named and as
  resolved, and the stat of a named path follows its symlinks, so retargeting a link (a `current` checkpoint)
  is a change;
- directory listings: ./recipes for --all, each local checkpoint directory, the HF cache dirs a model resolved in;
- the blobs of every cached entry (a manifest whose blobs are gone is a miss for the planner);
- and every other file the command opened for reading, and every directory it listed, while it planned: an audit
  hook (PEP 578) notes them from the start of the command, so an input the planner starts reading later (a port's
  sources, say) is a witness without a change here. Python's own files and installed packages are left to the
  distributions above, qbuild's to the source digest.

Any difference is a miss, and the caller plans in full. A timestamp only tells changes apart once the clock has
moved past it, so a file changed less than RACY_NS before the recording command started (or during it) makes that
command record nothing: its stat signature could still change unseen, and what planning read of it is unknown.

This module imports nothing heavy at module level: a lookup must not cost more than the interpreter's start.
Entries are JSON (never pickle), written by stage + atomic rename like every state write in the store, and the plan
is serialised generically from the dataclass fields of Plan / Node / NodeStatus / PlannedRecipe / Manifest and the
fields of the recipe models, so fields added to them carry through without changes here. A cached answer decodes
into plain attribute objects with those fields, which the renderers read like the real ones.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path, PurePath
from types import SimpleNamespace

from . import jsonio

FORMAT = 1
CACHE_DIR = "plancache"
RACY_NS = 1_000_000_000
# Variables that enter a key, a status or where something lives: the store and remote (QBUILD_*), the HF cache
# (HF_HOME, HF_HUB_CACHE), the stat cache and default store (XDG_CACHE_HOME, HOME), where Python finds qbuild and the
# toolchain (PYTHONPATH). A prefix takes in variables added later under it.
ENV_PREFIXES = ("QBUILD_", "HF_", "HUGGINGFACE_")
ENV_NAMES = ("XDG_CACHE_HOME", "HOME", "PYTHONPATH", "PYTHONHOME")
SWITCH = "QBUILD_PLAN_CACHE"        # "off": neither use nor record the cache (it changes no answer, so no key)
SOURCE_ROOT = Path(__file__).resolve().parent


class Uncacheable(Exception):
    """The answer or one of its inputs cannot be recorded faithfully; the command just records nothing."""


def enabled() -> bool:
    return os.environ.get(SWITCH, "").lower() not in ("off", "0", "false", "no")


# --- the invocation and where its entry lives ---------------------------------------------------------------------

def invocation(command: str, recipes: list[str], all_: bool, as_json: bool, lock: str | os.PathLike,
               store: str | os.PathLike | None) -> dict:
    """What selects an entry: the same command line in the same directory with the same interpreter. (--json has
    an entry of its own, so that a plan's trees are kept with the plan they print.)"""
    return {"format": FORMAT, "command": command, "cwd": os.getcwd(), "recipes": list(recipes), "all": bool(all_),
            "json": bool(as_json), "lock": str(Path(lock)), "store": None if store is None else str(Path(store)),
            "python": sys.version, "executable": sys.executable, "sys_path": list(sys.path)}


def entry_path(store_root: str | os.PathLike, inv: dict) -> Path:
    from blake3 import blake3

    name = blake3(json.dumps(inv, sort_keys=True).encode()).hexdigest(length=16)
    return Path(store_root) / CACHE_DIR / f"{name}.json"


def environment() -> str:
    """A digest of the variables planning depends on (some, like HF_TOKEN, are secrets: only the digest is kept)."""
    from blake3 import blake3

    env = {k: v for k, v in sorted(os.environ.items()) if (k.startswith(ENV_PREFIXES) or k in ENV_NAMES) and k != SWITCH}
    return blake3(json.dumps(env).encode()).hexdigest(length=16)


# --- stat signatures, digests and the source --------------------------------------------------------------------

def signature(path: str) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev, st.st_mode]


def content_digest(path: str) -> str | None:
    from blake3 import blake3

    try:
        with open(path, "rb") as f:
            return blake3(f.read()).hexdigest(length=16)
    except OSError:
        return None


def listing(path: str) -> list[str] | None:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return None


# What makes a distribution (or an import hook) visible on a sys.path directory: installing, upgrading or removing
# a package adds or renames one of these, whatever else the directory holds (a working directory's own files).
_DIST_SUFFIXES = (".dist-info", ".egg-info", ".egg-link", ".pth")


def distributions() -> list:
    """[sys.path entry, its distribution metadata names (None: not a directory)] for every sys.path entry."""
    out = []
    for entry in sys.path:
        try:
            names = sorted(n for n in os.listdir(entry or ".") if n.endswith(_DIST_SUFFIXES))
        except OSError:
            names = None
        out.append([entry, names])
    return out


def _source_files() -> list[tuple[str, list[int]]]:
    """(relative path, stat signature) of every file of the qbuild package, bytecode caches aside."""
    out = []
    root = str(SOURCE_ROOT)
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for name in sorted(files):
            full = os.path.join(d, name)
            sig = signature(full)
            if sig is not None:
                out.append((os.path.relpath(full, root), sig))
    return out


def _source_digest(files: list[tuple[str, list[int]]]) -> str:
    from blake3 import blake3

    h = blake3()
    for rel, _ in files:
        h.update(f"{rel}\0{content_digest(os.path.join(SOURCE_ROOT, rel))}\n".encode())
    return h.hexdigest(length=16)


# --- generic serialisation ----------------------------------------------------------------------------------------

_TAGS = ("__tuple__", "__path__", "__record__", "__dict__", "__items__")


def encode(obj):
    """A JSON-able form of a plan, its statuses or manifests: dataclasses and pydantic models by their fields."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [encode(v) for v in obj]
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v) for v in obj]}
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            return {"__items__": [[encode(k), encode(v)] for k, v in obj.items()]}
        if len(obj) == 1 and next(iter(obj)) in _TAGS:   # a data dict that would read as a tag: kept as pairs
            return {"__dict__": [[k, encode(v)] for k, v in obj.items()]}
        return {k: encode(v) for k, v in obj.items()}
    if isinstance(obj, PurePath):
        return {"__path__": str(obj)}
    names = _field_names(obj)
    if names is None or any(n in _TAGS for n in names):
        raise Uncacheable(f"cannot record a {type(obj).__name__}")
    return {"__record__": [type(obj).__name__, {n: encode(getattr(obj, n)) for n in names}]}


def _field_names(obj) -> list[str] | None:
    import dataclasses

    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [f.name for f in dataclasses.fields(obj)]
    model_fields = getattr(type(obj), "model_fields", None)     # a pydantic model
    return list(model_fields) if isinstance(model_fields, dict) else None


def _decode_object(d: dict):
    if len(d) == 1:
        (tag, v), = d.items()
        if tag == "__tuple__":
            return tuple(v)
        if tag == "__path__":
            return Path(v)
        if tag == "__record__":
            return SimpleNamespace(**v[1])
        if tag in ("__dict__", "__items__"):
            return {(tuple(k) if isinstance(k, list) else k): val for k, val in v}
    return d


def decode(text: str | bytes):
    return json.loads(text, object_hook=_decode_object)


# --- what planning read -------------------------------------------------------------------------------------------

_reads: tuple[set[str], set[str]] | None = None     # (files opened for reading, directories listed) while recording
_hooked = False


def start_recording() -> None:
    """Note, from now on, every file this process opens for reading and every directory it lists."""
    global _reads, _hooked
    if not _hooked:
        sys.addaudithook(_audit)     # audit hooks cannot be removed: one for the process, idle when not recording
        _hooked = True
    _reads = (set(), set())


def stop_recording() -> tuple[set[str], set[str]] | None:
    """What was read since start_recording() (absolute paths), or None if nothing was recording."""
    global _reads
    reads, _reads = _reads, None
    if reads is None:
        return None
    return {os.path.abspath(f) for f in reads[0]}, {os.path.abspath(d) for d in reads[1]}


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT


def _audit(event: str, args: tuple) -> None:
    reads = _reads
    if reads is None or event not in ("open", "os.listdir", "os.scandir"):
        return
    try:        # an audit hook that raises would fail the operation it audits
        path = args[0]
        if isinstance(path, int):
            return
        path = "." if path is None else os.fsdecode(path)
        if event == "open":
            mode, flags = args[1], args[2]
            if not ((mode and any(c in mode for c in "wax+")) or (flags or 0) & _WRITE_FLAGS):
                reads[0].add(path)
        else:
            reads[1].add(path)
    except Exception:
        pass


def add_reads(inputs: "Inputs", reads: tuple[set[str], set[str]], store_root) -> None:
    """Add what the command read to `inputs`, but for what other witnesses cover (qbuild's source, the interpreter
    and installed packages, the sys.path directories), the plan cache's own entries, and kernel pseudo-files."""
    skip = tuple(os.path.join(p, "") for p in {str(SOURCE_ROOT), sys.prefix, sys.base_prefix, sys.exec_prefix,
                                                sys.base_exec_prefix, str(Path(store_root) / CACHE_DIR),
                                                "/proc", "/sys", "/dev"})
    sys_path = {os.path.abspath(p or ".") for p in sys.path}
    files, dirs = reads
    for f in files:
        if not f.startswith(skip) and f not in inputs.absent and f"{os.sep}__pycache__{os.sep}" not in f:
            inputs.file(f, digest=False)
    for d in dirs:
        if not os.path.join(d, "").startswith(skip) and d not in sys_path:
            inputs.dir(d)


class Inputs:
    """The inputs of one answer, gathered after planning from what it produced."""

    def __init__(self):
        self.files: dict[str, bool] = {}     # path -> whether to keep a content digest (small text files)
        self.absent: set[str] = set()        # files planning found missing (the manifests of nodes to build)
        self.dirs: set[str] = set()
        self.blobs: set[str] = set()

    def file(self, path, digest: bool) -> None:
        key = os.path.abspath(path)
        self.files[key] = self.files.get(key, False) or digest

    def dir(self, path) -> None:
        self.dirs.add(os.path.abspath(path))


def planning_inputs(plan, recipe_files: list[Path], lock_path, all_: bool, root: Path | None = None) -> Inputs:
    """Every file and directory that building `plan` from `recipe_files` (as the command line named them) read:
    recipes and bases, checkpoints, the HF cache, the lock, ./qbuild.yaml, and with --all the recipes directory."""
    from .recipe import PathSource
    from .source import checkpoint_files, hf_cached_snapshot, hf_repo_dir
    from .workspace import RECIPES_DIR

    root = Path(root or os.getcwd())
    inputs = Inputs()
    if all_:
        inputs.dir(root / RECIPES_DIR)
    inputs.file(lock_path, digest=True)
    inputs.file(root / "qbuild.yaml", digest=True)
    for f in recipe_files:
        files, model_dirs = recipe_chain(root / f)
        for path in files:
            inputs.file(path, digest=True)
        for path in model_dirs:
            inputs.file(path, digest=False)   # a directory: its stat follows links to the one planning listed
    for pr in plan.recipes.values():
        if pr.loaded.recipe.backend == "neuron" and pr.loaded.recipe.port.path is not None:
            inputs.file(pr.loaded.port_dir, digest=False)   # a port put in place later turns "not found" into its files
        model = pr.loaded.recipe.model
        if isinstance(model, PathSource):
            inputs.dir(pr.loaded.source_dir)
            for f in checkpoint_files(pr.loaded.source_dir):
                inputs.file(f, digest=False)      # by stat signature, as the stat cache keys their digests
            continue
        repo_dir = hf_repo_dir(model.hf)
        for d in (repo_dir, repo_dir / "refs", repo_dir / "snapshots"):
            inputs.dir(d)
        inputs.file(repo_dir / "refs" / model.revision, digest=True)
        cached = hf_cached_snapshot(model.hf, model.revision)
        if cached is not None:
            inputs.dir(cached[1])
            inputs.file(cached[1] / "config.json", digest=True)
    return inputs


def recipe_chain(path: Path) -> tuple[list[Path], list[Path]]:
    """The files qbuild.recipe reads for a recipe, along its `extends` chain, each as named and as resolved; and the
    checkpoint directories (`model: {path: ...}`) those files name, relative to each as qbuild.recipe takes them."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)   # the files parsed once already; only faster here
    files: list[Path] = []
    model_dirs: list[Path] = []
    named = Path(os.path.abspath(path))
    while True:
        file = named.resolve()
        if file in files:
            break
        files += [named, file]
        try:
            doc = yaml.load(file.read_text(), Loader=loader)
        except (OSError, yaml.YAMLError) as e:
            raise Uncacheable(f"{file}: {e}") from None
        if not isinstance(doc, dict):
            break
        model = doc.get("model")
        if isinstance(model, dict) and isinstance(model.get("path"), str):
            model_dirs += [named.parent / model["path"], file.parent / model["path"]]
        parent = doc.get("extends")
        if not isinstance(parent, str):
            break
        named = file.parent / parent
    return files, model_dirs


def add_manifest(inputs: Inputs, store, key: str, manifest) -> None:
    """A status read from the store: the manifest and each of its blobs, or the manifest's absence."""
    if manifest is None:
        inputs.absent.add(os.path.abspath(store.manifest_path(key)))
        return
    inputs.file(store.manifest_path(key), digest=True)
    for out in manifest.outputs.values():
        inputs.blobs.add(str(store.blob_path(out["digest"])))


# --- recording ----------------------------------------------------------------------------------------------------

def _racy(sig: list[int] | None, path: str, started_ns: int) -> bool:
    """Whether `path` changed too recently for its stat signature to be trusted (or planning's view of it known).

    A missing file is judged by its nearest existing ancestor directory, whose timestamps change when an entry
    is removed: planning may have read it before it went."""
    while sig is None:
        parent = os.path.dirname(path)
        if parent == path:
            return False
        path, sig = parent, signature(parent)
    return max(sig[1], sig[2]) >= started_ns - RACY_NS


def save(store_root, inv: dict, answer: dict, inputs: Inputs, started_ns: int, dists_at_start: list | None = None) \
        -> bool:
    """Record `answer` (objects to encode) for the invocation, unless an input changed since `started_ns` - RACY_NS
    or the installed distributions differ from `dists_at_start` (taken when the command started).

    Returns whether an entry was written. Digests are taken before stat signatures, so a change between the two
    shows as a recent timestamp."""
    from .store.local import atomic_write

    dists = distributions()
    if dists_at_start is not None and dists != dists_at_start:
        return False
    # Timestamps first: a file changed since the command started (the usual case right after an edit) ends it here.
    if any(_racy(signature(path), path, started_ns) for path in inputs.files):
        return False
    files = []
    for path, digest in sorted(inputs.files.items()):
        d = content_digest(path) if digest else None
        sig = signature(path)
        if _racy(sig, path, started_ns):
            return False
        files.append([path, sig, d])
    dirs = []
    for path in sorted(inputs.dirs):
        names = listing(path)
        if _racy(signature(path), path, started_ns):
            return False
        dirs.append([path, names])
    # Planning saw these missing (a node to build) and those present (a cached node): still so, or no entry.
    if any(os.path.lexists(a) for a in inputs.absent) or not all(os.path.isfile(b) for b in inputs.blobs):
        return False
    source = _source_files()
    if any(_racy(sig, os.path.join(SOURCE_ROOT, rel), started_ns) for rel, sig in source):
        return False
    entry = {"invocation": inv, "env": environment(), "distributions": dists,
             "source": {"digest": _source_digest(source), "files": source}, "files": files, "dirs": dirs,
             "absent": sorted(inputs.absent), "blobs": sorted(inputs.blobs), "answer": encode(answer)}
    atomic_write(entry_path(store_root, inv), jsonio.dumps(entry, compact=True).encode())
    return True


# --- pruning ------------------------------------------------------------------------------------------------------

def entries_witnessing(store_root, gone: set[str]) -> list[Path]:
    """The entries that recorded any of `gone` (absolute paths of files removed from the store: manifests, blobs) as
    present: none of them can answer any more. An unreadable entry is left to be replaced by the next full run."""
    stale = []
    for path in sorted((Path(store_root) / CACHE_DIR).glob("*.json")):
        try:
            entry = json.loads(path.read_bytes())
            witnessed = {f[0] for f in entry["files"]} | set(entry["blobs"])
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            continue
        if not witnessed.isdisjoint(gone):
            stale.append(path)
    return stale


# --- looking up ---------------------------------------------------------------------------------------------------

def load(store_root, inv: dict, dists: list | None = None) -> dict | None:
    """The recorded answer of the invocation if every input it recorded still matches, else None. `dists` is
    distributions() when the caller already has it."""
    try:
        with open(entry_path(store_root, inv), "rb") as f:
            raw = f.read()
    except OSError:
        return None
    try:
        entry = decode(raw)
    except ValueError:
        return None         # a torn or foreign file is a miss; the next full run replaces it atomically
    if not isinstance(entry, dict) or entry.get("invocation") != inv or entry.get("env") != environment():
        return None
    if entry["distributions"] != (distributions() if dists is None else dists):
        return None
    if not (_files_match(entry["files"]) and _dirs_match(entry["dirs"]) and _source_matches(entry["source"])):
        return None
    if any(os.path.lexists(a) for a in entry["absent"]) or not all(os.path.isfile(b) for b in entry["blobs"]):
        return None
    return entry["answer"]


def _files_match(files: list) -> bool:
    for path, sig, digest in files:
        now = signature(path)
        if now == sig:
            continue
        # Rewritten with the same bytes (an editor's save, a checkout): the same input for planning.
        if digest is None or now is None or sig is None or content_digest(path) != digest:
            return False
    return True


def _dirs_match(dirs: list) -> bool:
    return all(listing(path) == names for path, names in dirs)


def _source_matches(source: dict) -> bool:
    files = _source_files()
    if [[rel, sig] for rel, sig in files] == source["files"]:
        return True
    return [rel for rel, _ in files] == [rel for rel, _ in source["files"]] and _source_digest(files) == source["digest"]
