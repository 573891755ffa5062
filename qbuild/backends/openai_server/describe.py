"""What `qbuild serve --dry-run` says of qbuild's own server for a bundle (the same document for every runtime it
serves), and the one refusal every such server makes before it starts."""

from __future__ import annotations

import re

from pathlib import Path

from qbuild.core.errors import UserError

ROUTES = ["/v1/models", "/v1/completions", "/v1/chat/completions"]


def server_doc(backend: str, bundle: Path, name: str, host: str, port: int, max_prompt_tokens: int,
               max_model_len: int, vision_buckets: list[int], allow_image_urls: bool) -> dict:
    """The server, its URL and routes, and the limits it holds requests to: the longest prompt, the longest sequence,
    and for a VL bundle what it takes as an image."""
    host_in_url = f"[{host}]" if ":" in host else host
    doc = {"server": "qbuild", "backend": backend, "bundle": str(bundle), "model": name,
           "url": f"http://{host_in_url}:{port}/v1", "routes": list(ROUTES), "max_prompt_tokens": max_prompt_tokens,
           "max_model_len": max_model_len}
    if vision_buckets:
        doc["images"] = images_served(vision_buckets, allow_image_urls)
    return doc


def images_served(buckets: list[int], allow_urls: bool) -> dict:
    """What the server of a VL bundle takes as an image (qbuild.backends.openai_server.serve): one per chat request,
    within `qbuild run --image`'s limits, tiled past the largest bucket."""
    from qbuild.model.runtime.images import MAX_ASPECT_RATIO, MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS
    from qbuild.model.tiling import largest_patches

    return {"per_request": 1, "sources": ["data:"] + (["http:", "https:"] if allow_urls else []),
            "max_bytes": MAX_IMAGE_BYTES, "max_pixels": MAX_IMAGE_PIXELS, "max_aspect_ratio": MAX_ASPECT_RATIO,
            "buckets": sorted(buckets), "tiled_above": max(buckets), "max_patches": largest_patches(buckets)}


def no_server_args(bundle: Path, what: str, server_args: tuple[str, ...], way_out: str = "") -> None:
    """Arguments after `--` are for a server another program runs; qbuild's own server takes none, and ignoring them
    would serve something other than what the user asked for. `what` names the bundle ("the export bundle");
    `way_out`, where the bundle has another server that takes them, says how to ask for it. The refusal names the
    options given, never a value: vLLM's arguments carry its API key."""
    if server_args:
        names = [a.split("=", 1)[0] for a in server_args]
        # An option's name only: not a value, nor the word after --api-key, whatever it looks like.
        options = [n for before, n in zip([None, *server_args], names)
                   if before != "--api-key" and re.fullmatch(r"--[A-Za-z][\w-]*", n)]
        given = ", ".join(options) if options else f"{len(server_args)} arguments"
        raise UserError(f"{bundle}: {what} is served by qbuild's own server, which takes no arguments after `--` "
                        f"(given: {given}){'; ' + way_out if way_out else ''}")
