"""A checkpoint's files on this machine: the snapshot the fetch step records (files named by content digest only, so
keys are the same on every machine), where its bytes are (the local checkpoint directory, or the Hugging Face cache),
checked against its digests, and the checks of a checkpoint's files before anything is built from them."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Mapping

from qbuild.core.errors import InfraError, UserError
from qbuild.core.hashing import default_stat_cache
from qbuild.core.userfile import read_small_file
from qbuild.hub.hf import (CHECKPOINT_PATTERNS, MAX_INDEX_BYTES, WEIGHT_INDEX, check_hub_file, hf_blob,
                           hf_cached_snapshot)
from qbuild.model.arch import MAX_CONFIG_BYTES, arch_from_config

# A published Qwen tokenizer.json is ~11 MiB; the cap only stops a device or a runaway file.
MAX_TOKENIZER_BYTES = 256 << 20


# --- where a snapshot's files are ---------------------------------------------------------------------------------


def read_snapshot(directory: Path) -> dict:
    return json.loads((directory / "snapshot.json").read_text())


def locate(snapshot: dict, path: str | None) -> dict[str, Path]:
    """Map each file of `snapshot` to a path on this machine whose content matches the recorded digest: under `path`,
    the local checkpoint's directory, or in the HF cache for a hub model."""
    if snapshot["source"] == "path":
        root = Path(path)
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


# --- checking a checkpoint's files ---------------------------------------------------------------------

def check_checkpoint(directory: Path, files: Mapping[str, Path] | None = None) -> None:
    """Raise UserError, one line naming the file (and tensor), unless the files of the checkpoint at `directory` are
    well formed: config.json, the tokenizer, the index and every safetensors header (truncation, lying headers, an
    index naming a missing shard, a config whose vocabulary the embedding does not have). Reads headers only, and
    imports no torch and no conversion rule: whether the tensors are the ones the conversion program reads is the
    convert step's check (and the CLI's, before the first step of a build: qbuild.execution.workspace)."""
    config_path = Path((files or {}).get("config.json", directory / "config.json"))
    try:
        config = json.loads(read_small_file(config_path, MAX_CONFIG_BYTES, "config.json"))
    except ValueError as e:
        raise UserError(f"{config_path}: config.json is not valid JSON ({e})") from None
    check_tokenizer(directory, arch_from_config(config, str(config_path)).vocab_size, files)
    check_weight_index(directory, files)
    from qbuild.model.convert.checkpoint import read_checkpoint
    from qbuild.model.convert.errors import CheckpointError

    try:
        read_checkpoint(directory, files)
    except CheckpointError as e:
        raise UserError(f"{directory}{os.sep}{e}") from None


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


def checkpoint_files(directory: Path) -> list[Path]:
    seen: set[Path] = set()
    for pattern in CHECKPOINT_PATTERNS:
        seen.update(p for p in directory.glob(pattern) if p.is_file() and not p.name.startswith("."))
    return sorted(seen)
