"""fetch: pin a model source to a snapshot (files and digests), downloading from the Hub when needed.

Output: snapshot.json = {source, repo, revision (commit), files: {name: {digest, size}}}. Hub files are named by
the Hub's own digests (sha256 of LFS files, git blob sha1 of small ones), read from the cache layout, so nothing
is hashed twice. Local files carry the BLAKE3 digests the planner computed.
"""

from __future__ import annotations

import os
from pathlib import Path

from qbuild.core import jsonio
from qbuild.build.actions import RunContext
from qbuild.core.errors import InfraError, UserError
from qbuild.recipe.params import FetchParams, FetchPath
from qbuild.recipe.source import CHECKPOINT_PATTERNS, check_checkpoint, checkpoint_files, hf_cache_dir


def run(ctx: RunContext) -> None:
    p: FetchParams = ctx.params
    if isinstance(p, FetchPath):
        snapshot = _local(Path(ctx.context["path"]), p.files)
    else:
        snapshot = _hub(p.repo, ctx.context.get("requested_revision", p.revision), ctx)
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


def _offline() -> bool:
    # Read at call time: huggingface_hub reads it once at import, which may predate this process's settings.
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _hub(repo: str, revision: str, ctx: RunContext) -> dict:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        local = Path(snapshot_download(repo, revision=revision, allow_patterns=list(CHECKPOINT_PATTERNS),
                                        cache_dir=hf_cache_dir(), local_files_only=_offline()))
    except RepositoryNotFoundError:
        raise UserError(f"model.hf: {repo} not found on the Hub (or not visible with the current token)") from None
    except LocalEntryNotFoundError:
        raise InfraError(f"model.hf: {repo}@{revision} is not in the HF cache and the Hub cannot be reached "
                         "(HF_HUB_OFFLINE or no network)") from None
    except HfHubHTTPError as e:
        raise InfraError(f"model.hf: {repo}@{revision}: Hub error {e.response.status_code if e.response else ''}") \
            from None
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
    ctx.log(f"fetched {repo}@{local.name[:12]}: {len(files)} files")
    return {"source": "hf", "repo": repo, "revision": local.name, "files": files}
