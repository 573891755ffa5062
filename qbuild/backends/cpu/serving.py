"""How `qbuild serve` serves a CPU bundle: qbuild's own OpenAI-compatible server over its runtime, in this process
(serve.py, with serve_requests.py and serve_images.py), and what `--dry-run` says of it.

No build step serves, so no key holds this module or the server's: the registry imports it for `qbuild serve` and
`qbuild pull` alone (qbuild.backends.server), and an edit of the server re-keys no compile.
"""

from __future__ import annotations

from pathlib import Path

from qbuild.backends.base import ServeOptions
from qbuild.core.errors import UserError
from qbuild.model.chunking import LongContext


class CpuServer:
    def __init__(self, name: str):
        self.name = name

    def serve_instructions(self, bundle: Path, manifest: dict) -> dict | None:
        return None

    def serve_command(self, bundle: Path, manifest: dict, options: ServeOptions) -> dict:
        """qbuild's own server (qbuild.backends.cpu.serve) in this process; its limits are the bundle's buckets (with
        chunked prefill, a prompt may fill the KV cache), and its prefix cache the bundle's."""
        self._no_server_args(bundle, options)
        buckets = manifest["buckets"]
        host = f"[{options.host}]" if ":" in options.host else options.host
        plan = LongContext.from_json(manifest.get("long_context"))
        doc = {"server": "qbuild", "backend": self.name, "bundle": str(bundle), "model": options.name,
               "url": f"http://{host}:{options.port}/v1", "routes": ["/v1/models", "/v1/completions",
                                                                  "/v1/chat/completions"],
               "max_prompt_tokens": max(buckets["tkg"]) if plan else max(buckets["cte"]),
               "max_model_len": max(buckets["tkg"])}
        if buckets.get("vision"):
            doc["images"] = images_served(buckets["vision"], options.allow_image_urls)
        return doc if plan is None else {**doc, "long_context": plan.to_json()}

    def serve(self, bundle: Path, manifest: dict, options: ServeOptions) -> int:
        """Load the bundle into qbuild's runtime, with every text graph, so the first request is as fast as the
        others, then answer requests until stopped."""
        from qbuild.backends.cpu.serve import serve
        from qbuild.model.runtime import Runtime

        self._no_server_args(bundle, options)
        options.log(f"loading the {self.name} bundle {options.name}")
        runtime = Runtime.load(bundle, verify_digests=not options.digests_checked)
        for graph in manifest["graphs"]:
            runtime.graph(graph)
        return serve(runtime, options)

    def _no_server_args(self, bundle: Path, options: ServeOptions) -> None:
        """Arguments after `--` are for a server another program runs; qbuild's own server takes none, and ignoring
        them would serve something other than what the user asked for."""
        if options.server_args:
            raise UserError(f"{bundle}: the {self.name} bundle is served by qbuild's own server, which takes no "
                            f"arguments after `--` (given: {' '.join(options.server_args)})")


def images_served(buckets: list[int], allow_urls: bool) -> dict:
    """What a CPU server of a VL bundle takes as an image (qbuild.backends.cpu.serve): one per chat request, within
    `qbuild run --image`'s limits, tiled past the largest bucket."""
    from qbuild.model.runtime.images import MAX_ASPECT_RATIO, MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS
    from qbuild.model.tiling import largest_patches

    return {"per_request": 1, "sources": ["data:"] + (["http:", "https:"] if allow_urls else []),
            "max_bytes": MAX_IMAGE_BYTES, "max_pixels": MAX_IMAGE_PIXELS, "max_aspect_ratio": MAX_ASPECT_RATIO,
            "buckets": sorted(buckets),
            "tiled_above": max(buckets), "max_patches": largest_patches(buckets)}
