"""`qbuild serve`: a bundle's OpenAI-compatible endpoint, served by its backend until Ctrl-C."""

import os
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from qbuild.backends import SERVERS
from qbuild.cli.exits import err
from qbuild.cli.options import JsonOpt, LockOpt, RemoteOpt, StoreOpt, StrictOpt, check_new_dir, open_bundle
from qbuild.core import jsonio
from qbuild.core.errors import UserError

ServerName = Enum("ServerName", {name: name for name in SERVERS}, type=str)
SERVER_HELP = ("qbuild (its own server: a CPU bundle's and a neuron VL bundle's, which then takes images through the "
               "port's VL classes) or vllm (vLLM's Neuron plugin: a neuron text bundle's; a neuron VL bundle's text "
               "only); default the bundle's")


def serve(target: str = typer.Argument(..., help="a bundle directory (from `qbuild pull`), or a locked recipe"),
          server_args: Optional[list[str]] = typer.Argument(
              None, metavar="VLLM_ARGS",
              help="after --, arguments handed to vLLM as they are (a neuron bundle): --chat-template, "
                   "--enable-auto-tool-choice --tool-call-parser NAME, --reasoning-parser NAME, ...; the lengths, "
                   "parallelism and cache flags come from the bundle and are refused here"),
          host: str = typer.Option("127.0.0.1", "--host", help="address to listen on"),
          port: int = typer.Option(8000, "--port", min=0, max=65535, help="port to listen on (0: any free one)"),
          server: Optional[ServerName] = typer.Option(None, "--server", help=SERVER_HELP),
          dry_run: bool = typer.Option(False, "--dry-run",
                                       help="print how the bundle would be served (for a neuron bundle the exact "
                                            "command and environment) and exit; a recipe's bundle is then laid out "
                                            "in a temporary directory that is gone afterwards"),
          ready_file: Optional[Path] = typer.Option(None, "--ready-file",
                                                    help="write the server's base URL to this file once it answers "
                                                         "requests"),
          allow_unverified: bool = typer.Option(False, "--allow-unverified",
                                                help="serve a locked recipe whose verify did not pass"),
          api_key: Optional[str] = typer.Option(None, "--api-key", envvar="QBUILD_API_KEY", show_default=False,
                                                help="require `Authorization: Bearer KEY` on every request (prefer "
                                                     "the environment variable: a command line is visible to other "
                                                     "users)"),
          allow_image_urls: bool = typer.Option(False, "--allow-image-urls",
                                                help="fetch the http(s) image URLs chat requests name (a VL "
                                                     "bundle served by qbuild's server); without it only data: URLs are taken, since a fetch "
                                                     "reaches whatever the server's network reaches"),
          nxdi_tree: Optional[Path] = typer.Option(None, "--nxdi-tree", envvar="QBUILD_NXDI_TREE", show_default=False,
                                                   help="a checkout of the NxDI source tree a neuron bundle's port "
                                                        "imports from (its vllm/serve.json names it), where this "
                                                        "host's NxDI is not that tree; its src/ goes on the "
                                                        "server's PYTHONPATH"),
          json_: bool = JsonOpt, store: Optional[Path] = StoreOpt, lock: Path = LockOpt,
          remote: Optional[str] = RemoteOpt, strict: bool = StrictOpt) -> None:
    """Serve a bundle's OpenAI-compatible endpoint (/v1/models, /v1/completions, /v1/chat/completions) until Ctrl-C:
    qbuild's runtime for a CPU bundle, qbuild's server over the port's VL classes for a neuron VL bundle, vLLM with the
    Neuron plugin for a neuron text bundle."""
    from qbuild import backends
    from qbuild.backends.base import ServeOptions
    from qbuild.render import serve_text
    from qbuild.core.files import atomic_write
    from qbuild.model.bundle import MANIFEST, read_manifest, shown_path

    if ready_file is not None:
        check_new_dir(ready_file.parent, "the --ready-file's directory", None)
        if ready_file.is_dir():
            raise UserError(f"--ready-file {ready_file}: is a directory")

    def on_ready(url: str) -> None:
        print(jsonio.dumps({"url": url}) if json_ else url, flush=True)
        err(f"serving {options.name} at {url} (Ctrl-C stops it)")
        if ready_file is not None:
            atomic_write(ready_file, (url + "\n").encode())

    # A recipe's bundle is named by the recipe (a directory by its name), and laid out as `pull` lays it out: root gets
    # copies, so that no server process can change the store's blobs.
    with open_bundle(target, store, lock, remote, allow_unverified, strict, share=os.geteuid() != 0) as opened:
        bundle = opened.path.resolve()
        manifest = read_manifest(bundle, opened.shown_as)
        if manifest.get("backend") not in backends.NAMES:
            raise UserError(f"{shown_path(bundle, MANIFEST, opened.shown_as)}: backend {manifest.get('backend')!r} is "
                            f"not one of {', '.join(backends.NAMES)}; only a bundle qbuild built can be served")
        backend = backends.server(manifest["backend"])
        options = ServeOptions(name=opened.name, host=host, port=port, log=err, on_ready=on_ready,
                               digests_checked=opened.digests_checked, server_args=tuple(server_args or ()),
                               api_key=api_key, allow_image_urls=allow_image_urls, nxdi_tree=nxdi_tree,
                               server=server.value if server is not None else None)
        if dry_run:
            doc = backend.serve_command(bundle, manifest, options)
            if json_:
                print(jsonio.dumps(doc, indent=1, sort_keys=True))
            else:
                serve_text(doc)
            return
        if options.open_to_others:
            err(f"warning: --host {host} takes requests from other machines and no --api-key is set: anyone who can "
                "reach it can use the model; set QBUILD_API_KEY (or --api-key)")
        code = backend.serve(bundle, manifest, options)
    raise typer.Exit(code)
