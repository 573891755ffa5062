"""How `qbuild serve` serves a CPU bundle: qbuild's own OpenAI-compatible server over its runtime, in this process
(qbuild.backends.openai_server), and what `--dry-run` says of it.

No build step serves, so no key holds this module or the server's: the registry imports it for `qbuild serve` and
`qbuild pull` alone (qbuild.backends.server), and an edit of the server re-keys no compile.
"""

from __future__ import annotations

from pathlib import Path

from qbuild.backends.base import ServeOptions
from qbuild.backends.openai_server.describe import no_server_args, server_doc
from qbuild.core.errors import UserError
from qbuild.model.chunking import LongContext


class CpuServer:
    def __init__(self, name: str):
        self.name = name

    def serve_instructions(self, bundle: Path, manifest: dict) -> dict | None:
        return None

    def serve_command(self, bundle: Path, manifest: dict, options: ServeOptions) -> dict:
        """qbuild's own server in this process; its limits are the bundle's buckets (with chunked prefill, a prompt
        may fill the KV cache), and its prefix cache the bundle's."""
        self._check_options(bundle, options)
        buckets = manifest["buckets"]
        plan = LongContext.from_json(manifest.get("long_context"))
        doc = server_doc(self.name, bundle, options.name, options.host, options.port,
                         max(buckets["tkg"]) if plan else max(buckets["cte"]), max(buckets["tkg"]),
                         buckets.get("vision") or [], options.allow_image_urls)
        return doc if plan is None else {**doc, "long_context": plan.to_json()}

    def serve(self, bundle: Path, manifest: dict, options: ServeOptions) -> int:
        """Load the bundle into qbuild's runtime, with every text graph, so the first request is as fast as the
        others, then answer requests until stopped."""
        from qbuild.backends.openai_server.serve import serve
        from qbuild.model.runtime import Runtime

        self._check_options(bundle, options)
        options.log(f"loading the {self.name} bundle {options.name}")
        runtime = Runtime.load(bundle, verify_digests=not options.digests_checked)
        for graph in manifest["graphs"]:
            runtime.graph(graph)
        return serve(runtime, options)

    def _check_options(self, bundle: Path, options: ServeOptions) -> None:
        no_server_args(bundle, f"the {self.name} bundle", options.server_args)
        if options.server == "vllm":
            raise UserError(f"--server vllm: {bundle} is a bundle of the {self.name} backend, which vLLM cannot run; "
                            "qbuild's own server serves it (drop --server)")
