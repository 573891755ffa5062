"""Model sources: where a fetched snapshot's bytes live on this machine, checked against the snapshot's digests,
and the check of a checkpoint before anything is built from it.

A snapshot (the fetch action's output) names files by content digest only, so keys are the same on every
machine. The bytes stay where they are: in the local checkpoint directory, or in the Hugging Face cache.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

from .arch import hf_cached_snapshot
from .errors import UserError
from .hashing import default_stat_cache
from .recipe import LoadedRecipe
from .userfile import read_small_file

# A published Qwen tokenizer.json is ~11 MiB; the cap only stops a device or a runaway file.
MAX_TOKENIZER_BYTES = 256 << 20


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
    found = hf_cached_snapshot(snapshot["repo"], snapshot["revision"])
    if found is None:
        raise UserError(f"{snapshot['repo']}@{snapshot['revision'][:12]}: not in the HF cache on this machine")
    files = {}
    for name, meta in snapshot["files"].items():
        path = found[1] / name
        if not path.is_file() or path.stat().st_size != meta["size"]:
            raise UserError(f"{path}: missing or truncated in the HF cache; run `qbuild compile` to fetch it again")
        files[name] = path
    return files


# --- checking a checkpoint before a build --------------------------------------------------------------------

def source_directory(loaded: LoadedRecipe) -> Path | None:
    """Where a recipe's checkpoint is on this machine: its local directory, or its HF cache snapshot (None when a
    hub model is not downloaded yet; the fetch step checks it after downloading)."""
    src = loaded.recipe.model
    if src.path is not None:
        return loaded.source_dir
    cached = hf_cached_snapshot(src.hf, src.revision)
    return cached[1] if cached else None


def check_checkpoint(directory: Path, files: Mapping[str, Path] | None = None) -> None:
    """Raise UserError, one line naming the file (and tensor), unless the checkpoint at `directory` can be built:
    config.json, the tokenizer, and every safetensors header against the conversion program (truncation, lying
    headers, missing, extra or misshapen tensors, an index naming a missing shard). Reads headers only; the last
    check imports torch (the conversion program is made of torch functions), so call this where a build will run."""
    from .arch import MAX_CONFIG_BYTES, arch_from_config

    config_path = Path((files or {}).get("config.json", directory / "config.json"))
    try:
        config = json.loads(read_small_file(config_path, MAX_CONFIG_BYTES, "config.json"))
    except ValueError as e:
        raise UserError(f"{config_path}: config.json is not valid JSON ({e})") from None
    check_tokenizer(directory, arch_from_config(config, str(config_path)).vocab_size, files)
    from .convert.checkpoint import open_checkpoint   # torch: only once the cheap checks have passed
    from .convert.errors import CheckpointError

    try:
        open_checkpoint(directory, files)
    except CheckpointError as e:
        raise UserError(f"{directory}{os.sep}{e}") from None


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
