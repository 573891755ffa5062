"""`qbuild publish` and `qbuild pull`: the locked artifacts of recipes up to the remote, and a locked bundle down into
a directory."""

import os
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from qbuild.cli.options import (JsonOpt, LockOpt, ProgressMode, ProgressOpt, RemoteOpt, StoreOpt, StrictOpt,
                                check_new_dir, name_a_changed_recipe, workspace)
from qbuild.core.errors import UserError

PublishWhat = Enum("PublishWhat", {name: name for name in ("bundles", "all")}, type=str)


def publish(recipes: list[str] = typer.Argument(None, help="recipe names (or files) as in the lockfile"),
            all_: bool = typer.Option(False, "--all", help="every recipe in the lockfile"),
            verify_remote: bool = typer.Option(False, "--verify-remote",
                                               help="read back every blob the remote has for these recipes, check "
                                                    "its digest, and upload again any missing or corrupt one"),
            what: PublishWhat = typer.Option(PublishWhat.all, "--what",
                                             help="all: every locked step; bundles: what pull and a rebuild "
                                                  "elsewhere need (all but the reference logits; docs/bytes.md)"),
            remote: Optional[str] = RemoteOpt, json_: bool = JsonOpt, store: Optional[Path] = StoreOpt,
            lock: Path = LockOpt, progress_mode: ProgressMode = ProgressOpt) -> None:
    """Upload the locked artifacts of recipes to the remote: blobs it lacks first, then each manifest."""
    from qbuild.render import print_published, transfer_display
    from qbuild.execution.transfer import publish as publish_locked
    from qbuild.planning.lock import recipe_names

    ws = workspace(store, lock, remote, transfers=transfer_display(progress_mode.value, "publish"))
    if ws.store_spec.remote is None:
        raise UserError("publish needs a remote: pass --remote s3://bucket/prefix, set QBUILD_REMOTE, "
                        "or add remote: to ./qbuild.yaml")
    names = recipe_names(ws.lock, lock, recipes or [], all_)
    report = publish_locked(ws.store, ws.lock, lock, names, verify_remote=verify_remote, what=what.value)
    print_published(names, ws.store.remote.url, report, json_, progress_mode.value)


def pull(recipe: str = typer.Argument(..., help="recipe name (or file) as in the lockfile"),
         to: Path = typer.Option(..., "--to", help="directory to lay the bundle out in (new or empty)"),
         remote: Optional[str] = RemoteOpt, json_: bool = JsonOpt, store: Optional[Path] = StoreOpt,
         lock: Path = LockOpt,
         allow_unverified: bool = typer.Option(False, "--allow-unverified",
                                               help="lay out a bundle whose verify did not pass"),
         strict: bool = StrictOpt, progress_mode: ProgressMode = ProgressOpt) -> None:
    """Lay out a recipe's locked bundle in a directory (from the remote when not local); every digest is checked."""
    from qbuild.render import note_json, print_pulled, transfer_display
    from qbuild.execution.transfer import pull_bundle
    from qbuild.planning.lock import resolve_recipe

    check_new_dir(to, "the --to directory", "pull into a new or empty one")
    ws = workspace(store, lock, remote, transfers=transfer_display(progress_mode.value, "pull"))
    if not lock.exists():
        raise UserError(f"{lock}: no lockfile; pull lays out what a lockfile names")
    name_a_changed_recipe(ws, resolve_recipe(ws.lock, lock, recipe), strict,
                          note_json("pull") if progress_mode.value == "json" else None)
    # Root ignores the read-only bit that protects the store's blobs, so a root-owned bundle must not share their
    # inodes: an edit to a bundle file would change the store's copy (and every other bundle made from it).
    manifest = pull_bundle(ws.store, ws.lock, lock, recipe, to, share=os.geteuid() != 0,
                           allow_unverified=allow_unverified)
    print_pulled(recipe, to, manifest, _serve_instructions(to), json_, progress_mode.value)


def _serve_instructions(bundle: Path) -> dict | None:
    """How to serve a pulled bundle (a neuron bundle with vLLM), as its backend says; None where it names none."""
    from qbuild import backends
    from qbuild.model.bundle import MANIFEST, read_manifest

    if not (bundle / MANIFEST).is_file():   # a bundle of test-defined steps records no backend
        return None
    manifest = read_manifest(bundle)
    return backends.server(manifest["backend"]).serve_instructions(bundle.resolve(), manifest)
