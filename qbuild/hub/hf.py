"""The Hugging Face Hub and its cache on this machine: the HF cache read without importing huggingface_hub (a
snapshot by commit, never through a branch's ref), the Hub's answers (the commit a branch resolves to, config.json at
a commit, kept in qbuild's own config cache), and the bytes of a cached snapshot checked against the digests the Hub
named them by."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from qbuild.core.errors import InfraError, QbuildError, UserError
from qbuild.core.hashing import default_stat_cache, git_blob_sha1, is_commit
from qbuild.core.files import atomic_write
from qbuild.core.userdir import cache_dir
from qbuild.core.userfile import read_small_file


# Files a build needs from a checkpoint; pickled weights (*.bin, *.pt) are never fetched or loaded.
CHECKPOINT_PATTERNS = ("*.json", "*.safetensors", "tokenizer*", "*.txt", "*.jinja", "*.model")
WEIGHT_INDEX = "model.safetensors.index.json"
# A published index is a few MiB at most (one line per tensor); the cap only stops a device or a runaway file.
MAX_INDEX_BYTES = 64 << 20


# --- the Hugging Face cache, read without importing huggingface_hub ---------------------------------------------



def hf_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hub"


def hf_repo_dir(repo: str, cache: Path | None = None) -> Path:
    """The HF cache directory of a model repo (holding refs/ and snapshots/)."""
    return (cache or hf_cache_dir()) / ("models--" + repo.replace("/", "--"))


def hf_cached_snapshot(repo: str, commit: str) -> Path | None:
    """The snapshot directory of `repo` at `commit` in the local HF cache. Only a commit: a branch's ref in the cache
    says what this machine downloaded last, which must never decide what a build uses."""
    if not is_commit(commit):
        return None
    snap = hf_repo_dir(repo) / "snapshots" / commit
    return snap if snap.is_dir() else None


def hf_served_commit(repo: str, commit: str, cache: Path | None = None) -> str | None:
    """What the Hub answered when asked for `commit`, where it answered another commit: huggingface_hub records the
    X-Repo-Commit of a download under refs/<requested revision> whenever the two differ
    (huggingface_hub/file_download.py `_cache_commit_hash_for_specific_revision`, 2.4.0)."""
    ref = hf_repo_dir(repo, cache) / "refs" / commit
    served = ref.read_text().strip() if ref.is_file() else None
    return served if served and served != commit else None


# --- the Hugging Face Hub, through huggingface_hub ---------------------------------------------------------------

DEFAULT_HUB = "https://huggingface.co"
HUB_TIMEOUT_S = 10.0   # seconds to wait for the Hub to answer one API request


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE), read when asked: huggingface_hub reads it once at import, which may
    predate this process's settings (constants.py HF_HUB_OFFLINE, 2.4.0)."""
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_endpoint() -> str:
    """HF_ENDPOINT, read when asked (huggingface_hub reads it at import), passed to every call explicitly."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_HUB).rstrip("/")


def _hub_online() -> None:
    """Make huggingface_hub's offline switch what the environment says now: its request hook refuses every request
    while its import-time copy is set (utils/_http.py `hf_request_event_hook`, 2.4.0). Callers check offline first."""
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = hub_offline()


def hub_error(e: Exception, what: str) -> QbuildError:
    """One line for a failed Hub request: a repo or revision the Hub does not have (or will not show with this token) is
    the recipe's to fix (UserError); an unreachable or failing Hub is infrastructure (InfraError)."""
    import httpx2
    from huggingface_hub.errors import (HfHubHTTPError, OfflineModeIsEnabled, RemoteEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    if isinstance(e, RevisionNotFoundError):
        return UserError(f"the Hub has no revision {what}")
    if isinstance(e, RemoteEntryNotFoundError):
        return UserError(f"the Hub has no such file at {what}")
    if isinstance(e, RepositoryNotFoundError):
        return UserError("no such repo on the Hub, or not visible with the current token")
    if isinstance(e, OfflineModeIsEnabled):
        return InfraError("offline")
    if isinstance(e, HfHubHTTPError):
        status = getattr(e.response, "status_code", None)
        if status in (401, 403):
            return UserError(f"the Hub refused access ({status}); check the token")
        return InfraError(f"Hub error {status}" if status else "Hub error")
    if isinstance(e, (httpx2.HTTPError, OSError)):
        return InfraError(f"Hub unreachable at {hub_endpoint()}: {type(e).__name__}")
    raise e


def resolve_hub_revision(repo: str, revision: str) -> str:
    """The commit the Hub resolves `revision` (a branch or tag) of `repo` to: HfApi.model_info(...).sha, with the
    endpoint, token and offline switch of this moment. Raises the reason as InfraError (offline, unreachable) or
    UserError (no such repo or revision)."""
    if hub_offline():
        raise InfraError("offline")
    _hub_online()
    from huggingface_hub import HfApi

    try:
        sha = HfApi(endpoint=hub_endpoint()).model_info(repo, revision=revision, timeout=HUB_TIMEOUT_S).sha
    except Exception as e:   # huggingface_hub raises httpx2, OSError and its own HTTP errors; hub_error sorts them
        raise hub_error(e, revision) from None
    if not sha or not is_commit(sha):
        raise InfraError(f"the Hub answered no commit for {revision}")
    return sha


def config_cache_dir() -> Path:
    """qbuild's own HF-layout cache of config.json files by commit. Planning downloads a config.json here, never into
    the HF cache: a snapshot there holding only config.json would pass for the whole checkpoint offline."""
    return cache_dir("hf-configs")


def hub_config_path(repo: str, commit: str) -> Path | None:
    """config.json of `repo` at `commit` on this machine: in its HF cache snapshot, or in qbuild's config cache."""
    for cache in (hf_cache_dir(), config_cache_dir()):
        path = hf_repo_dir(repo, cache) / "snapshots" / commit / "config.json"
        if path.is_file():
            return path
    return None


def download_hub_config(repo: str, commit: str) -> Path:
    """Download config.json of `repo` at `commit` into qbuild's config cache, in one request: no retries (planning
    should say at once that the Hub cannot be reached) and no HF cache entry. Refuses a config.json of another commit
    (the X-Repo-Commit the Hub answers with, as huggingface_hub's own downloads check it: file_download.py
    `get_hf_file_metadata`, 2.4.0)."""
    if hub_offline():
        raise InfraError("offline")
    _hub_online()
    from huggingface_hub import get_session, hf_hub_url, hf_raise_for_status
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(repo, "config.json", revision=commit, endpoint=hub_endpoint())
    try:
        response = get_session().get(url, headers=build_hf_headers(), timeout=HUB_TIMEOUT_S, follow_redirects=True)
        hf_raise_for_status(response)
    except Exception as e:
        err = hub_error(e, commit)
        raise type(err)(f"model.hf: {repo}@{commit[:12]}: cannot download config.json ({err})") from None
    served = response.headers.get("X-Repo-Commit")
    if served != commit:
        raise InfraError(f"model.hf: {repo}: asked for config.json at {commit[:12]}, the Hub served commit "
                         f"{(served or 'none')[:12]}")
    # The ETag of a file kept in git is its blob sha1 (huggingface_hub names the cached blob by it): the bytes must be
    # those it names. A weak or absent ETag (a proxy's) says nothing either way.
    etag = (response.headers.get("X-Linked-Etag") or response.headers.get("ETag") or "").strip('"')
    if is_commit(etag) and git_blob_sha1(response.content) != etag:   # a git blob id: 40 hex, as a commit's
        raise InfraError(f"model.hf: {repo}@{commit[:12]}: the Hub served a config.json whose bytes hash to git-sha1 "
                         f"{git_blob_sha1(response.content)[:12]}, not its ETag {etag[:12]}; refusing it")
    path = hf_repo_dir(repo, config_cache_dir()) / "snapshots" / commit / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, response.content)
    return path


# --- the bytes of a Hub snapshot in the HF cache, checked against their digests -----------------------------------
# huggingface_hub names each cached blob by the ETag the Hub sent (the sha256 of an LFS file, the git blob sha1 of
# another) and checks its size, not its bytes (file_download.py `_hf_hub_download_to_cache_dir`, `http_get`,
# 2.4.0). A blob that rotted on disk, or bytes the Hub (a mirror, a proxy) served under another file's ETag, would
# pass for the file its name claims: so the bytes are hashed with the algorithm the name claims before they are
# used. A mismatch is InfraError (exit 3): the recipe is right, the cache or the server is not, and a fresh
# download mends it.

_BLOB_ALGOS = {64: "sha256", 40: "git-sha1"}   # hex length of a blob's name -> the digest it is


def hf_blob(path: Path) -> Path:
    """The blob a snapshot entry of the HF cache links to."""
    return Path(os.path.realpath(path))


def hub_snapshot_files(snap: Path) -> dict[str, dict]:
    """{name: {"digest": "sha256:..." or "git-sha1:...", "size"}} of the checkpoint files of the HF cache snapshot
    `snap`, each named by the blob it links to and checked to hash to that name."""
    files = {}
    for path in sorted(snap.iterdir()):
        if not path.is_file() or not any(path.match(p) for p in CHECKPOINT_PATTERNS):
            continue
        blob = hf_blob(path)
        algo = _BLOB_ALGOS.get(len(blob.name)) if re.fullmatch(r"[0-9a-f]+", blob.name) else None
        if algo is None:
            # huggingface_hub copies a file into the snapshot where symbolic links cannot be made (a filesystem
            # without them, HF_HUB_DISABLE_SYMLINKS): file_download.py `_create_symlink`, 2.4.0.
            raise InfraError(f"{path}: not a link to a blob of the HF cache named by its digest (huggingface_hub "
                             "copies files where it cannot make symbolic links), so the digest the Hub named it by "
                             "is not known; keep the HF cache on a filesystem with symbolic links and without "
                             "HF_HUB_DISABLE_SYMLINKS")
        digest = f"{algo}:{blob.name}"
        check_hub_file(path, digest, f"remove {blob} and run the command again")
        files[path.name] = {"digest": digest, "size": path.stat().st_size}
    return files


def hub_snapshot_partial(snap: Path) -> bool:
    """Whether the HF cache snapshot `snap` lacks files: a link whose blob is gone (removed, as a refused corrupt blob
    is), or a weight file its index names that was never downloaded. The fetch step downloads them, then checks it."""
    if any(p.is_symlink() and not p.exists() for p in snap.iterdir()):
        return True
    index = snap / WEIGHT_INDEX
    try:
        named = set(json.loads(read_small_file(index, MAX_INDEX_BYTES, WEIGHT_INDEX))["weight_map"].values())
    except (UserError, ValueError, KeyError, TypeError, AttributeError):
        return False     # no index, or one the checkpoint check refuses, naming it
    return not all(isinstance(n, str) and "/" not in n and (snap / n).exists() for n in named)


def check_hub_config(path: Path, raw: bytes) -> None:
    """Planning reads a hub model's config.json (the architecture, so the keys, come from it) without the fetch step:
    where it is a blob of the HF cache, its bytes (`raw`, as read) must hash to the blob's name."""
    blob = hf_blob(path)
    if len(blob.name) == 40 and re.fullmatch(r"[0-9a-f]+", blob.name) and git_blob_sha1(raw) != blob.name:
        raise InfraError(f"{path}: its bytes hash to git-sha1 {git_blob_sha1(raw)[:12]}, not the {blob.name[:12]} "
                         f"the Hub named them by: the HF cache's copy is corrupt; remove {blob} and run the command "
                         "again")


def check_hub_file(path: Path, digest: str, remedy: str) -> None:
    """Raise InfraError, one line naming `path`, unless its bytes hash to `digest` ("sha256:<hex>" or
    "git-sha1:<hex>"); `remedy` says what to do about it."""
    algo, _, want = digest.partition(":")
    got = default_stat_cache(algo).digest(path)
    if got != want:
        raise InfraError(f"{path}: its bytes hash to {algo} {got[:12]}, not the {want[:12]} the Hub named them by: "
                         f"the HF cache's copy is corrupt or the Hub served other bytes; {remedy}")

