"""Model sources: a recipe's config.json and where its checkpoint is (a local directory, the Hugging Face cache, or
a shipped config only), the Hub's answers (the commit a branch resolves to, config.json at a commit), where a fetched
snapshot's bytes live on this machine, checked against the snapshot's digests, and the check of a checkpoint before
anything is built from it. A hub model is looked up in the HF cache by commit only, never through a branch's ref.

A snapshot (the fetch action's output) names files by content digest only, so keys are the same on every
machine. The bytes stay where they are: in the local checkpoint directory, or in the Hugging Face cache.
The published configs of the shipped models are kept in qbuild/configs (named org--name.json) for recipes whose
weights are not downloaded.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Mapping

from qbuild.model.arch import MAX_CONFIG_BYTES, Arch, arch_from_config
from qbuild.core.errors import InfraError, QbuildError, RecipeError, UserError
from qbuild.core.hashing import default_stat_cache, git_blob_sha1
from qbuild.store.files import atomic_write
from qbuild.recipe.schema import LoadedRecipe, PathSource, recipe_field_location
from qbuild.core.userfile import read_small_file

# A published Qwen tokenizer.json is ~11 MiB; the cap only stops a device or a runaway file.
MAX_TOKENIZER_BYTES = 256 << 20
_SHIPPED = Path(__file__).resolve().parents[1] / "configs"


# --- the Hugging Face cache, read without importing huggingface_hub ---------------------------------------------

_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def is_commit(revision: str) -> bool:
    """Whether a revision is a full commit id (what a key may hold), not a branch, a tag or a short sha."""
    return bool(_COMMIT.fullmatch(revision))


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
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "qbuild" / "hf-configs"


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
    if re.fullmatch(r"[0-9a-f]{40}", etag) and git_blob_sha1(response.content) != etag:
        raise InfraError(f"model.hf: {repo}@{commit[:12]}: the Hub served a config.json whose bytes hash to git-sha1 "
                         f"{git_blob_sha1(response.content)[:12]}, not its ETag {etag[:12]}; refusing it")
    path = hf_repo_dir(repo, config_cache_dir()) / "snapshots" / commit / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, response.content)
    return path


def shipped_config_path(repo: str) -> Path:
    return _SHIPPED / (repo.replace("/", "--") + ".json")


# --- a recipe's config.json ---------------------------------------------------------------------------------------

def config_for(loaded: LoadedRecipe, commit: str | None = None) -> tuple[dict, str]:
    """The config.json a recipe's model has, and where it was read: the local dir; for a hub model, the one of
    `commit` (or of the recipe's revision where that is a commit) in the HF cache or qbuild's config cache, else the
    shipped copy. A branch is never looked up in the HF cache: what it pointed to when this machine last downloaded
    must not decide an architecture, and so a key."""
    src = loaded.recipe.model
    if isinstance(src, PathSource):
        try:
            source_dir = loaded.source_dir
        except (RuntimeError, OSError):   # resolve() meets a link cycle as RuntimeError (OSError in newer Pythons)
            raise RecipeError(f"{recipe_field_location(loaded, 'model.path')}: model.path: {src.path} is a symbolic "
                              "link loop") from None
        cfg = source_dir / "config.json"
        where = f"{loaded.path}: model.path"
        if not source_dir.is_dir():
            raise RecipeError(f"{recipe_field_location(loaded, 'model.path')}: model.path: "
                              f"{source_dir} is not a directory")
    else:
        commit = commit or (src.revision if is_commit(src.revision) else None)
        cfg = (hub_config_path(src.hf, commit) if commit else None) or shipped_config_path(src.hf)
        where = f"{loaded.path}: model.hf"
        if not cfg.exists():
            at = f"@{commit[:12]}" if commit else f"@{src.revision} (not resolved)"
            raise RecipeError(f"{recipe_field_location(loaded, 'model.hf')}: model.hf: {src.hf}{at} has no "
                              "config.json on this machine and no shipped config; plan it online or use `path:`")
    raw = read_small_file(cfg, MAX_CONFIG_BYTES, "config.json")
    if not isinstance(src, PathSource):
        check_hub_config(cfg, raw)
    try:
        return json.loads(raw), str(cfg)
    except ValueError as e:   # invalid JSON or not UTF-8
        raise UserError(f"{cfg}: cannot read config.json ({where}): {e}") from None


def load_arch(loaded: LoadedRecipe, commit: str | None = None) -> Arch:
    config, origin = config_for(loaded, commit)
    return arch_from_config(config, origin)


# --- where a snapshot's files are ---------------------------------------------------------------------------------


def read_snapshot(directory: Path) -> dict:
    return json.loads((directory / "snapshot.json").read_text())


def locate(snapshot: dict, context: dict) -> dict[str, Path]:
    """Map each file of `snapshot` to a path on this machine whose content matches the recorded digest."""
    if snapshot["source"] == "path":
        root = Path(context["path"])
        cache = default_stat_cache()
        files = {}
        for name, meta in snapshot["files"].items():
            path = root / name
            if not path.is_file():
                raise UserError(f"{path}: missing; the checkpoint changed since it was planned")
            if "blake3:" + cache.digest(path) != meta["digest"]:
                raise UserError(f"{path}: content changed since it was planned; run the command again")
            files[name] = path
        return files
    repo, commit = snapshot["repo"], snapshot["revision"]
    found = hf_cached_snapshot(repo, commit)
    if found is None:
        raise UserError(f"{repo}@{commit[:12]}: not in the HF cache on this machine")
    files = {}
    for name, meta in snapshot["files"].items():
        path = found / name
        # The fetch step that recorded these digests may have run long ago (or elsewhere): the bytes read now are
        # checked against them, through the stat cache, so an unchanged file is hashed once.
        again = f"`hf download {repo} {name} --revision {commit}`"
        if not path.is_file() or path.stat().st_size != meta["size"]:
            raise InfraError(f"{path}: missing or truncated in the HF cache; download it again with {again}")
        check_hub_file(path, meta["digest"], f"remove {hf_blob(path)} and download it again with {again}")
        files[name] = path
    return files


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


# --- checking a checkpoint before a build --------------------------------------------------------------------

def source_directory(loaded: LoadedRecipe, commit: str | None = None) -> Path | None:
    """Where a recipe's checkpoint is on this machine: its local directory, or the HF cache snapshot of the commit
    its fetch step is keyed on (None when that commit is not downloaded yet; the fetch step checks it after
    downloading)."""
    src = loaded.recipe.model
    if isinstance(src, PathSource):
        return loaded.source_dir
    return hf_cached_snapshot(src.hf, commit) if commit else None


def check_checkpoint(directory: Path, files: Mapping[str, Path] | None = None) -> None:
    """Raise UserError, one line naming the file (and tensor), unless the checkpoint at `directory` can be built:
    config.json, the tokenizer, and every safetensors header against the conversion program (truncation, lying
    headers, missing, extra or misshapen tensors, an index naming a missing shard). Reads headers only, and imports
    no torch: the CLI runs it before the first step of a build, in a process that has no other use for torch."""
    config_path = Path((files or {}).get("config.json", directory / "config.json"))
    try:
        config = json.loads(read_small_file(config_path, MAX_CONFIG_BYTES, "config.json"))
    except ValueError as e:
        raise UserError(f"{config_path}: config.json is not valid JSON ({e})") from None
    check_tokenizer(directory, arch_from_config(config, str(config_path)).vocab_size, files)
    check_weight_index(directory, files)
    from qbuild.model.convert.checkpoint import open_checkpoint
    from qbuild.model.convert.errors import CheckpointError

    try:
        open_checkpoint(directory, files)
    except CheckpointError as e:
        raise UserError(f"{directory}{os.sep}{e}") from None


WEIGHT_INDEX = "model.safetensors.index.json"
# A published index is a few MiB at most (one line per tensor); the cap only stops a device or a runaway file.
MAX_INDEX_BYTES = 64 << 20


def check_weight_index(directory: Path, files: Mapping[str, Path] | None = None) -> None:
    """The safetensors index, where there is one, names weight files a build may read: each a plain file name inside
    the checkpoint directory (no path: `../x.safetensors` or `/dev/zero` would read outside it) that is a regular
    file (not a device, a FIFO or a link loop, on which a read would block, never end or fail). The index itself
    is a regular file of bounded size: a build that ignored an index it cannot read would convert the shards while
    transformers, which reads the index, fails on them."""
    index = Path((files or {}).get(WEIGHT_INDEX, directory / WEIGHT_INDEX))
    if not os.path.lexists(index):
        return
    try:
        weight_map = json.loads(read_small_file(index, MAX_INDEX_BYTES, WEIGHT_INDEX))["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{index}: {WEIGHT_INDEX} has no readable weight_map ({type(e).__name__})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise UserError(f"{index}: weight_map must map tensor names to file names")
    first_tensor: dict[str, str] = {}
    for tensor, name in sorted(weight_map.items()):
        first_tensor.setdefault(name, tensor)
    for name, tensor in sorted(first_tensor.items()):
        where = f"{index}: weight_map[{tensor!r}]"
        if name in ("", ".", "..") or "/" in name or "\\" in name or os.path.isabs(name):
            raise UserError(f"{where} is {name!r}: a weight file must be a file name in the checkpoint directory, "
                            "not a path")
        path = Path((files or {}).get(name, directory / name))
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            raise UserError(f"{where} names {name}, which is not found in {directory}") from None
        except OSError as e:
            raise UserError(f"{where} names {name}, which cannot be read: {e.strerror}") from None
        if not stat.S_ISREG(mode):
            kind = "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else \
                "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise UserError(f"{where} names {name}, which is {kind}, not a regular file")


def check_tokenizer(directory: Path, vocab_size: int, files: Mapping[str, Path] | None = None) -> None:
    """The tokenizer the bundle will ship: present (tokenizer.json, or vocab.json + merges.txt), loadable, and
    naming no token id past the model's vocabulary (such an id would index past the embedding)."""
    def path(name: str) -> Path:
        return Path((files or {}).get(name, directory / name))

    config = path("tokenizer_config.json")
    if config.exists():
        _json_file(config, "tokenizer_config.json", dict)
    if path("tokenizer.json").exists():
        ids = _tokenizer_json_ids(path("tokenizer.json"))
        where = path("tokenizer.json")
    elif path("vocab.json").exists() and path("merges.txt").exists():
        ids = _json_file(path("vocab.json"), "vocab.json", dict)
        read_small_file(path("merges.txt"), MAX_TOKENIZER_BYTES, "merges.txt")
        where = path("vocab.json")
    else:
        raise UserError(f"{directory}: no tokenizer (tokenizer.json, or vocab.json and merges.txt); a bundle without "
                        "one cannot encode prompts")
    bad = [(i, t) for t, i in ids.items() if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab_size]
    if bad:
        token_id, token = max(bad, key=lambda b: b[0] if isinstance(b[0], int) else -1)
        raise UserError(f"{where}: token {token!r} has id {token_id!r}, not below config.json's vocab_size "
                        f"{vocab_size}")


def _json_file(path: Path, label: str, kind: type):
    try:
        doc = json.loads(read_small_file(path, MAX_TOKENIZER_BYTES, label))
    except ValueError as e:
        raise UserError(f"{path}: {label} is not valid JSON ({e})") from None
    if not isinstance(doc, kind):
        raise UserError(f"{path}: {label} is not a JSON {'object' if kind is dict else kind.__name__}")
    return doc


def _tokenizer_json_ids(path: Path) -> dict[str, int]:
    """token -> id of a tokenizer.json, loaded by the `tokenizers` library (what transformers' fast tokenizers
    use) where it is installed, else read as JSON."""
    raw = read_small_file(path, MAX_TOKENIZER_BYTES, "tokenizer.json")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        doc = _json_file(path, "tokenizer.json", dict)
        vocab = doc.get("model", {}).get("vocab") if isinstance(doc.get("model"), dict) else None
        if not isinstance(vocab, dict):
            raise UserError(f"{path}: tokenizer.json has no model.vocab mapping") from None
        added = {t.get("content"): t.get("id") for t in doc.get("added_tokens") or [] if isinstance(t, dict)}
        return {**vocab, **added}
    try:
        tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:  # the Rust library raises its own Exception type, with a multi-line message
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{path}: tokenizer.json cannot be loaded: {first}") from None
    return tokenizer.get_vocab(with_added_tokens=True)


# --- the files of a checkpoint -------------------------------------------------------------------------------

# Files a build needs from a checkpoint; pickled weights (*.bin, *.pt) are never fetched or loaded.
CHECKPOINT_PATTERNS = ("*.json", "*.safetensors", "tokenizer*", "*.txt", "*.jinja", "*.model")


def checkpoint_files(directory: Path) -> list[Path]:
    seen: set[Path] = set()
    for pattern in CHECKPOINT_PATTERNS:
        seen.update(p for p in directory.glob(pattern) if p.is_file() and not p.name.startswith("."))
    return sorted(seen)
