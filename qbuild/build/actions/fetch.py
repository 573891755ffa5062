"""fetch: pin a model source to a snapshot (files and digests), downloading from the Hub when needed.

Output: snapshot.json = {source, repo, revision (commit), files: {name: {digest, size}}}. A hub model is fetched at
exactly the commit its key holds (the planner never keys one on a branch), from the HF cache when that commit is
there, and a snapshot of any other commit is refused. Hub files are named by the Hub's own digests (sha256 of LFS
files, git blob sha1 of small ones), read from the cache layout, so nothing is hashed twice. Local files carry the
BLAKE3 digests the planner computed.
"""

from __future__ import annotations

import os
from pathlib import Path

from qbuild.core import jsonio
from qbuild.build.actions import RunContext
from qbuild.core.errors import InfraError, UserError
from qbuild.recipe.params import FetchParams, FetchPath
from qbuild.recipe.source import (CHECKPOINT_PATTERNS, check_checkpoint, checkpoint_files, hf_cache_dir,
                                  hf_repo_dir, hf_served_commit, hub_endpoint, hub_offline, is_commit)


def run(ctx: RunContext) -> None:
    p: FetchParams = ctx.params
    if isinstance(p, FetchPath):
        snapshot = _local(Path(ctx.context["path"]), p.files)
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


def _hub(repo: str, commit: str, ctx: RunContext) -> dict:
    if not is_commit(commit):
        raise UserError(f"model.hf: {repo}@{commit} is not a commit; a fetch is keyed on the commit its revision "
                        "resolves to (see `qbuild plan`)")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    offline = hub_offline()
    # huggingface_hub's request hook obeys its import-time copy of HF_HUB_OFFLINE; this step obeys the one of now.
    constants.HF_HUB_OFFLINE = offline
    try:
        local = Path(snapshot_download(repo, revision=commit, allow_patterns=list(CHECKPOINT_PATTERNS),
                                        cache_dir=hf_cache_dir(), local_files_only=offline, endpoint=hub_endpoint()))
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
    files = {}
    for path in sorted(local.iterdir()):
        if not path.is_file() or not any(path.match(p) for p in CHECKPOINT_PATTERNS):
            continue
        blob = Path(os.path.realpath(path)).name
        algo = "sha256" if len(blob) == 64 else "git-sha1"
        files[path.name] = {"digest": f"{algo}:{blob}", "size": path.stat().st_size}
    if not any(n.endswith(".safetensors") for n in files):
        raise UserError(f"model.hf: {repo}@{revision} has no safetensors weights (pickled weights are never loaded)")
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
