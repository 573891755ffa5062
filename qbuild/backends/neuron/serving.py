"""How `qbuild serve` and `qbuild pull` serve a neuron bundle. A VL bundle: qbuild's own OpenAI server over the port's
VL classes, which take images (vl_serve; docs/vision.md section 8). A text bundle, or a VL bundle with `--server vllm`:
vLLM with its Neuron plugin, by the command line and the plugin the package step wrote into the bundle (vllm_serve),
images refused (vllm_images; docs/vllm.md).

No build step serves, so no key holds this module: the registry imports it for those commands alone
(qbuild.backends.server).
"""

from __future__ import annotations

import sys
from pathlib import Path

from qbuild.backends.base import ServeOptions
from qbuild.backends.neuron import vl_serve, vllm_images, vllm_serve
from qbuild.core.errors import UserError


class NeuronServer:
    def __init__(self, name: str = "neuron"):
        self.name = name

    def serve_instructions(self, bundle: Path, manifest: dict) -> dict | None:
        """The vLLM command for a host that serves the pulled bundle without qbuild (`qbuild serve DIR` runs it, and
        serves a VL bundle's images with qbuild's server instead); None where qbuild's glue cannot serve it (`qbuild
        serve DIR` says why)."""
        try:
            return _with_images(vllm_serve.printable(vllm_serve.serve_command(
                bundle, manifest, bundle.name, "127.0.0.1", 8000, "python")), manifest)
        except UserError:
            return None

    def serve_command(self, bundle: Path, manifest: dict, options: ServeOptions) -> dict:
        if _qbuild_server(bundle, manifest, options):
            return vl_serve.printable(vl_serve.serve_command(bundle, manifest, options, sys.executable))
        vllm_images.check_image_urls(manifest, options.allow_image_urls)
        return _with_images(vllm_serve.printable(vllm_serve.serve_command(
            bundle, manifest, options.name, options.host, options.port, sys.executable, options.server_args,
            getattr(options, "api_key", None), options.nxdi_tree)), manifest)

    def serve(self, bundle: Path, manifest: dict, options: ServeOptions) -> int:
        if _qbuild_server(bundle, manifest, options):
            return vl_serve.serve(bundle, manifest, options)
        vllm_images.check_image_urls(manifest, options.allow_image_urls)
        if (note := vllm_images.images_note(manifest)) is not None:
            options.log(f"warning: images are not served: {note['why']}")
        return vllm_serve.serve(bundle, manifest, options)


def _qbuild_server(bundle: Path, manifest: dict, options: ServeOptions) -> bool:
    """Whether qbuild's server serves the bundle: a VL bundle's default, or asked for (a text bundle is refused:
    vl_serve.check_servable)."""
    vl = bool(manifest.get("buckets", {}).get("vision"))
    if options.server == "qbuild" and not vl:
        vl_serve.check_servable(bundle, manifest, {})
    return options.server == "qbuild" or (vl and options.server != "vllm")


def _with_images(doc: dict, manifest: dict) -> dict:
    """The serving document with, for a VL bundle, what happens to its images (vllm_images)."""
    note = vllm_images.images_note(manifest)
    return doc if note is None else {**doc, "images": note}
