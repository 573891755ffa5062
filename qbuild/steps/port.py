"""port: the NxDI contrib port's source, copied into the store so that every machine compiles the same code.

Output: the port's Python files (tests excluded, as qbuild.core.files.python_sources selects them) under their
paths relative to the port directory. A neuron compile puts this tree on sys.path
(qbuild.backends.neuron.ports.Lineage.module_dir), so a Ray worker or a CI runner compiles exactly what was planned, and
a changed port changes the keys of what it affects: shard, compile, package.

Two forms (the neuron backend's params):
- a pinned git source (PortGit: url, full commit, subdir): fetched here with the git CLI into a bare clone per URL
  under the store (`<store>/git/`), the commit's tree checked against `rev`, the subdir's files read from it. The
  node's key is (url, rev, subdir), known without the network; its output digest is the tree digest of the files.
- a local directory (PortFiles, or PortMissing where it was not found): copied, each file checked against the digest
  the planner took.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
import tempfile
from contextlib import contextmanager
from pathlib import Path

from qbuild.core.errors import InfraError, UserError
from qbuild.core.urls import carries_credentials, without_credentials as _shown
from qbuild.core.userdir import cache_dir
from qbuild.planning.step import Context, Step

GIT_DIR = "git"                 # under the store root: one bare clone per URL


class Port(Step):
    """Planned by the backend that compiles with a port (PlanningBackend.plan's sources), its params of that backend."""

    kind = "port"
    params = object

    @classmethod
    def plan(cls, recipe) -> None:
        # A port's files are copied, never run here: its key holds the code of its params' forms, not the backend's.
        recipe.add_backend_nodes(cls, runs_backend=False)

    @classmethod
    def run(cls, ctx: Context) -> None:
        if hasattr(ctx.params, "rev"):      # a git port: pinned by a commit (url, rev, subdir)
            _from_git(ctx)
        else:
            _from_directory(ctx)


def _from_directory(ctx: Context) -> None:
    files = ctx.params.planned_files()
    from qbuild.core.hashing import default_stat_cache

    root = Path(ctx.source.path)
    cache = default_stat_cache()
    for rel, digest in sorted(files.items()):
        src = root / rel
        if not src.is_file() or "blake3:" + cache.digest(src) != digest:
            raise UserError(f"{src}: changed since planning; run the command again")
        dst = ctx.out / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
    ctx.log(f"port {root.name}: {len(files)} files")


# --- the git form ----------------------------------------------------------------------------------------------------

def _from_git(ctx: Context) -> None:
    from qbuild.core.files import python_sources

    url, rev, subdir = ctx.params.url, ctx.params.rev, ctx.params.subdir.strip("/")
    if carries_credentials(url):   # the recipe schema refuses these; nothing may write one into the git config
        raise UserError(f"port: {_shown(url)}: the URL carries credentials; remove them: git takes them "
                        "from its credential helper (git config credential.helper) or GIT_ASKPASS")
    repo = _clone_dir(ctx, url)
    with _locked(repo):
        _fetch(repo, url, rev)
        tree = _archive(repo, url, rev, subdir)
    with tempfile.TemporaryDirectory(dir=ctx.scratch) as tmp:
        _extract(tree, Path(tmp))
        files = python_sources(Path(tmp))
        if not files:
            raise UserError(f"port: {subdir} at {rev} of {_shown(url)} holds no Python files; check port.subdir")
        for src in files:
            dst = ctx.out / src.relative_to(tmp)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
    ctx.log(f"port {subdir} @ {rev[:12]} from {_shown(url)}: {len(files)} files")


def _clone_dir(ctx: Context, url: str) -> Path:
    """The bare clone of `url`: under the store the build writes to, else the user's cache directory."""
    from qbuild.core.hashing import digest_bytes

    if ctx.store is not None:
        base = Path(ctx.store.local) / GIT_DIR
    else:
        base = cache_dir(GIT_DIR)
    return base / f"{digest_bytes(url.encode())[:24]}.git"


@contextmanager
def _locked(repo: Path):
    """One process at a time fetches into a clone (git's own ref locks would fail the second one, not wait)."""
    from filelock import FileLock

    repo.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{repo}.lock"):
        yield


def _git(repo: Path, *args: str, failing: str | None = None) -> subprocess.CompletedProcess:
    """Run git in `repo`. A failure raises InfraError `port: <failing>: <git's last line>`, or returns the completed
    process where `failing` is None."""
    # Never prompt (a fetch without credentials must fail, not wait on a terminal nobody watches), and end a transfer
    # that stalls instead of hanging the build.
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}
    env.setdefault("GIT_SSH_COMMAND", "ssh -o BatchMode=yes")
    try:
        proc = subprocess.run(["git", "-c", "http.lowSpeedLimit=1000", "-c", "http.lowSpeedTime=60",
                               "-C", str(repo), *args], env=env, capture_output=True)
    except FileNotFoundError:
        raise InfraError("port: the git command is not installed here; a port pinned by `git` is fetched with it")\
            from None
    if proc.returncode != 0 and failing is not None:
        lines = [ln.strip() for ln in proc.stderr.decode("utf-8", "replace").splitlines() if ln.strip()]
        raise InfraError(f"port: {failing}: {lines[-1].removeprefix('fatal: ') if lines else 'git said nothing'}")
    return proc


def _fetch(repo: Path, url: str, rev: str) -> None:
    """Make `rev` present in the bare clone at `repo`: only that commit, fetched by its id (git protocol v2 lets a
    client ask for any commit a ref reaches, pull-request refs included), then checked to be exactly `rev`."""
    if not (repo / "HEAD").is_file():
        repo.mkdir(parents=True, exist_ok=True)
        _git(repo, "init", "--bare", "--quiet", failing=f"cannot create the git cache {repo}")
    _git(repo, "config", "remote.origin.url", url, failing=f"cannot configure the git cache {repo}")
    if _git(repo, "cat-file", "-e", f"{rev}^{{commit}}").returncode != 0:
        fetched = _git(repo, "fetch", "--quiet", "--no-tags", "--depth", "1", "origin", rev)
        if fetched.returncode != 0:
            _fetch_failed(repo, url, rev, fetched.stderr.decode("utf-8", "replace"))
    got = _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").stdout.decode().strip()
    if got != rev:
        raise InfraError(f"port: commit {rev} is not in {_shown(url)} (the fetch brought {got or 'nothing'})")


def _fetch_failed(repo: Path, url: str, rev: str, stderr: str) -> None:
    """Raise why `rev` could not be fetched: a recipe error (exit 2) where the repository answers and git's refusal
    names the commit (it is in none of the repository's refs: a typo, or a commit that was never pushed), else the
    repository's or the network's failure (exit 3), with git's first fatal line."""
    if rev in stderr and _git(repo, "ls-remote", "origin", "HEAD").returncode == 0:
        raise UserError(f"port: commit {rev} is not in {_shown(url)} (no ref of it reaches that commit); check "
                        "port.rev")
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    first_fatal = next((ln for ln in lines if ln.startswith("fatal: ")), lines[-1] if lines else "git said nothing")
    raise InfraError(f"port: cannot fetch commit {rev} from {_shown(url)}: {first_fatal.removeprefix('fatal: ')}")


def _archive(repo: Path, url: str, rev: str, subdir: str) -> bytes:
    """The tar of `subdir` as commit `rev` has it (paths relative to it)."""
    kind = _git(repo, "cat-file", "-t", f"{rev}:{subdir}")
    if kind.returncode != 0 or kind.stdout.decode().strip() != "tree":
        raise UserError(f"port: {subdir} is not a directory of {_shown(url)} at {rev}; check port.subdir")
    return _git(repo, "archive", "--format=tar", f"{rev}:{subdir}", failing=f"cannot read {subdir} at {rev}").stdout


def _extract(tree: bytes, dest: Path) -> None:
    """The regular files of a git archive under `dest` (links and other members are skipped: a port is Python
    source, and the store refuses links)."""
    from qbuild.core.files import safe_join

    with tarfile.open(fileobj=io.BytesIO(tree)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            target = safe_join(dest, member.name)
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
