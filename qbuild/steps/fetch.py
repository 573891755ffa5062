"""fetch: pin a model source to a snapshot (files and digests), downloading from the Hub when needed.

Output: snapshot.json = {source, repo, revision (commit), files: {name: {digest, size}}}. A hub model is fetched at
exactly the commit its key holds (the planner never keys one on a branch), from the HF cache when that commit is
there, and a snapshot of any other commit is refused. Hub files are named by the Hub's own digests (sha256 of LFS
files, git blob sha1 of small ones), as the HF cache names their blobs, and their bytes are hashed to check that
name (through the stat cache, so once per file). Where the lock already holds the files of the pinned commit (the
plan puts them in the node's Source, as locked_files), a snapshot whose files differ is refused: a mirror that serves
other bytes for a pinned commit must not move the lock. Local files carry the BLAKE3 digests the planner
computed. A download reports its bytes to the step's progress, and huggingface_hub draws no bars of its own
(qbuild.hub.bars).
"""

from __future__ import annotations

from pathlib import Path

from qbuild.core import jsonio
from qbuild.core.errors import InfraError, UserError
from qbuild.core.hashing import is_commit
from qbuild.core.units import GIB
from qbuild.model.sizes import weight_bytes
from qbuild.hub.bars import HubBars
from qbuild.hub.snapshot import check_checkpoint, checkpoint_files
from qbuild.hub.hf import (CHECKPOINT_PATTERNS, hf_cache_dir, hf_repo_dir, hf_served_commit, hub_endpoint,
                           hub_offline, hub_snapshot_files)
from qbuild.planning.step import Context, LockedFiles, PlannedNode, Step
from qbuild.recipe.params import FetchHub, FetchParams, FetchPath


class Fetch(Step):
    kind = "fetch"
    params = (FetchPath, FetchHub)

    @classmethod
    def plan(cls, recipe) -> None:
        """A local checkpoint is identified by its files' digests, never its path; a hub model by its commit (the
        requested revision stands in, unkeyed, where none is known: the node is unresolved)."""
        hub = recipe.hub
        params = FetchHub("hf", hub.repo, hub.commit or hub.requested) if hub is not None else \
            FetchPath("path", recipe.env.checkpoint_digests(recipe.loaded.source_dir))
        recipe.add(PlannedNode("fetch", cls.kind, f"fetch {recipe.model_label}", params, {},
                               weight_bytes(recipe.arch, "bfloat16", "none") + recipe.sizes.vision, GIB // 4,
                               recipe.source, unresolved=hub.unresolved if hub else None))

    @classmethod
    def run(cls, ctx: Context) -> None:
        p: FetchParams = ctx.params
        if isinstance(p, FetchPath):
            snapshot = _local(Path(ctx.source.path), p.files)
        else:
            snapshot = _hub(p.repo, p.revision, ctx)
        (ctx.out / "snapshot.json").write_text(jsonio.dumps(snapshot, indent=1, sort_keys=True))


def _local(root: Path, planned: dict[str, str]) -> dict:
    from qbuild.core.hashing import default_stat_cache

    cache = default_stat_cache()
    files = {}
    present = {p.name: p for p in checkpoint_files(root)}
    if set(present) != set(planned):
        changed = sorted(set(present) ^ set(planned))
        raise UserError(f"{root}: files changed since planning ({', '.join(changed)}); run the command again")
    for name, digest in sorted(planned.items()):
        actual = "blake3:" + cache.digest(present[name])
        if actual != digest:
            raise UserError(f"{present[name]}: content changed since planning; run the command again")
        files[name] = {"digest": digest, "size": present[name].stat().st_size}
    return {"source": "path", "repo": None, "revision": None, "files": files}


def _hub(repo: str, commit: str, ctx: Context) -> dict:
    if not is_commit(commit):
        raise UserError(f"model.hf: {repo}@{commit} is not a commit; a fetch is keyed on the commit its revision "
                        "resolves to (see `qbuild plan`)")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    offline = hub_offline()
    # huggingface_hub's request hook obeys its import-time copy of HF_HUB_OFFLINE; this step obeys the one of now.
    constants.HF_HUB_OFFLINE = offline
    progress = ctx.progress
    bars = HubBars(None if progress is None else lambda total: progress.meter("download", "B", total),
                   hf_repo_dir(repo), commit, CHECKPOINT_PATTERNS)
    try:
        local = Path(snapshot_download(repo, revision=commit, allow_patterns=list(CHECKPOINT_PATTERNS),
                                        cache_dir=hf_cache_dir(), local_files_only=offline, endpoint=hub_endpoint(),
                                        tqdm_class=bars))
    except RevisionNotFoundError:
        raise UserError(f"model.hf: {repo}@{commit[:12]}: the Hub has no such commit") from None
    except RepositoryNotFoundError:
        raise UserError(f"model.hf: {repo} not found on the Hub (or not visible with the current token)") from None
    except LocalEntryNotFoundError:
        raise InfraError(f"model.hf: {repo}@{commit[:12]} is not in the HF cache and the Hub cannot be reached "
                         "(HF_HUB_OFFLINE or no network)") from None
    except HfHubHTTPError as e:
        raise InfraError(f"model.hf: {repo}@{commit[:12]}: Hub error {getattr(e.response, 'status_code', '')}") \
            from None
    _check_commit(repo, commit, local)
    files = hub_snapshot_files(local)
    _check_locked(repo, commit, files, ctx.source.locked_files)
    if not any(n.endswith(".safetensors") for n in files):
        raise UserError(f"model.hf: {repo}@{commit[:12]} has no safetensors weights (pickled weights are never "
                        "loaded)")
    # A download the planner could not check yet is checked before its snapshot is recorded.
    check_checkpoint(local, {name: local / name for name in files})
    ctx.log(f"fetched {repo}@{commit[:12]}: {len(files)} files")
    return {"source": "hf", "repo": repo, "revision": commit, "files": files}


def _check_commit(repo: str, commit: str, local: Path) -> None:
    """Refuse a snapshot of another commit than the key's. huggingface_hub files each download under the commit the
    server names in X-Repo-Commit, and returns the requested commit's directory regardless
    (huggingface_hub/_snapshot_download.py, file_download.py `_hf_hub_download_to_cache_dir`, 2.4.0): a server that
    answers another commit (a mirror that serves only a branch's head) leaves that directory missing or partial."""
    served = hf_served_commit(repo, commit)
    if served is not None:
        # The record stays until removed, so a partial directory from an earlier honest download is refused too.
        raise InfraError(f"model.hf: {repo}: asked for commit {commit[:12]}, the Hub served {served[:12]}; refusing "
                         f"a snapshot of another commit than the key's (remove {hf_repo_dir(repo) / 'refs' / commit} "
                         "once the Hub serves the commit)")
    if local.name != commit or not local.is_dir():
        raise InfraError(f"model.hf: {repo}: asked for commit {commit[:12]}, got no snapshot of it at {local}; "
                         "refusing a snapshot of another commit than the key's")


def _check_locked(repo: str, commit: str, files: dict[str, dict], locked: LockedFiles | None) -> None:
    """Refuse a snapshot of the pinned commit whose files differ from those the lock holds for that commit (None
    where it holds none). A commit names one tree, so other bytes for it come from a server that is not the Hub's
    honest copy (a mirror, a proxy): infrastructure, as a remote serving other bytes is. Moving them into the lock is
    `qbuild compile --update`'s to do."""
    if not locked:
        return
    want, got = locked.files, {name: meta["digest"] for name, meta in files.items()}
    for name in sorted(set(want) | set(got)):
        if want.get(name) != got.get(name):
            raise InfraError(f"model.hf: {repo}@{commit[:12]}: {name}: the Hub served "
                             f"{_short(got.get(name))}, {locked.lock} holds {_short(want.get(name))} for this "
                             "commit; refusing other files for a pinned commit (a mirror or proxy serving other "
                             "bytes?); run `qbuild compile --update` to accept them")


def _short(digest: str | None) -> str:
    if digest is None:
        return "no such file"
    algo, _, hexdigest = digest.partition(":")
    return f"{algo}:{hexdigest[:12]}"
