"""A recipe's model on this machine: its config.json (a local directory, the HF cache at a commit, or the shipped
copy of a published model whose weights are not downloaded) and the directory of its checkpoint. The published configs
of the shipped models are kept in qbuild/configs (named org--name.json)."""

from __future__ import annotations

import json
from pathlib import Path

from qbuild.core.errors import RecipeError, UserError
from qbuild.core.userfile import read_small_file
from qbuild.core.hashing import is_commit
from qbuild.hub.hf import check_hub_config, hf_cached_snapshot, hub_config_path
from qbuild.model.arch import MAX_CONFIG_BYTES, Arch, arch_from_config
from qbuild.recipe.schema import LoadedRecipe, PathSource, recipe_field_location

_SHIPPED = Path(__file__).resolve().parents[1] / "configs"


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


def source_directory(loaded: LoadedRecipe, commit: str | None = None) -> Path | None:
    """Where a recipe's checkpoint is on this machine: its local directory, or the HF cache snapshot of the commit
    its fetch step is keyed on (None when that commit is not downloaded yet; the fetch step checks it after
    downloading)."""
    src = loaded.recipe.model
    if isinstance(src, PathSource):
        return loaded.source_dir
    return hf_cached_snapshot(src.hf, commit) if commit else None
