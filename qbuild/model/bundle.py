"""The deployable bundle: its layout, its manifest (bundle.json), and checking a bundle directory.

Layout (CPU backends):
    bundle.json                                   this manifest
    config.json, tokenizer*.json, ...             the converted checkpoint's config and tokenizer files
    weights/tp{r}_sharded_checkpoint.safetensors  one per rank (the shard step's output)
    vision/model.safetensors                      the vision encoder's weights (VL bundles)
    graphs/<graph>-<bucket>.pt2                   one compiled graph per submodel x bucket, weights as inputs
    graphs/<graph>-<bucket>.json                  that graph's call signature
A neuron bundle is NxDI's compiled directory instead (qbuild/backends/neuron/package.py; docs/nxd-layout.md
section 7), with the same bundle.json, tokenizer files and weights/ (in NxD's format), and at its top level:
    model.pt, neuron_config.json                  NxDI's compiled text model (every bucket) and its saved config
    qbuild-neuron.json                            qbuild's record of the text compile (params, NxDI configuration)
    vision_encoder_<bucket>.pt                    one traced vision encoder per vision bucket, or with vision.tp
    bucket_<bucket>/tp_<rank>.pt                  one per rank of its TP-sharded encoder (docs/vision.md)
    qbuild-vision.json                            the vision buckets, how each was traced, the 2x2 tiling rule
    port/                                         the port's source, which the app class is imported from
    config.json                                   the checkpoint's, with its text fields also at the top level
    vllm/                                         what vLLM's Neuron plugin needs to serve it (docs/vllm.md)

bundle.json = {format, family, backend, tp, ep, batch_size, seq_len, dtype, buckets: {cte, tkg, vision},
               graphs: {"cte-32": path, ...}, files: {path: {digest (blake3), size}}}; `files` lists every file
of the bundle but bundle.json itself. Its digests are the store's (BLAKE3), so `qbuild pull` (qbuild.execution.transfer)
lays a bundle out from the store by hardlink and checks it against the lockfile.
"""

from __future__ import annotations

import json
from pathlib import Path

from qbuild.core import jsonio
from qbuild.core.errors import UserError
from qbuild.core.hashing import digest_file
from qbuild.core.files import safe_join

FORMAT = 1
MANIFEST = "bundle.json"


def file_entries(root: Path) -> dict[str, dict]:
    """{relative path: {digest, size}} of every file under `root` but the manifest, sorted."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and rel != MANIFEST:
            out[rel] = {"digest": digest_file(path), "size": path.stat().st_size}
    return out


def write_manifest(root: Path, meta: dict) -> dict:
    """Write bundle.json for the files now under `root`; returns the manifest."""
    doc = {"format": FORMAT, **meta, "files": file_entries(root)}
    (root / MANIFEST).write_text(jsonio.dumps(doc, indent=1, sort_keys=True) + "\n")
    return doc


def read_manifest(root: Path, shown_as: str | None = None) -> dict:
    """The bundle.json of the bundle at `root`; errors name the bundle as `shown_as` (default: `root`)."""
    path = root / MANIFEST
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{shown_as or root}: not a qbuild bundle (no {MANIFEST}); pull one with "
                        "`qbuild pull RECIPE --to DIR`") from None
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{shown_path(root, MANIFEST, shown_as)}: unreadable bundle manifest: {e}") from None
    if doc.get("format") != FORMAT:
        raise UserError(f"{shown_path(root, MANIFEST, shown_as)}: bundle format {doc.get('format')!r}; this qbuild reads "
                        f"format {FORMAT}")
    for rel in doc.get("files", {}):
        safe_join(root, rel)  # a manifest naming a path outside the bundle is refused before anything is read
    return doc


def check_files(root: Path, doc: dict, *, digests: bool = True, shown_as: str | None = None) -> None:
    """Every file the manifest names is present with its size (and digest); raises UserError naming the first, inside
    the bundle named `shown_as` (default: `root`)."""
    changed = "changed since the bundle was made; pull it again (`qbuild pull RECIPE --to DIR`)"
    for rel, meta in sorted(doc["files"].items()):
        path = safe_join(root, rel)
        shown = shown_path(root, rel, shown_as)
        if not path.is_file():
            raise UserError(f"{shown}: missing (bundle.json lists it)")
        size = path.stat().st_size
        if size != meta["size"]:
            raise UserError(f"{shown}: {size} bytes where bundle.json says {meta['size']}: {changed}")
        if digests and digest_file(path) != meta["digest"]:
            raise UserError(f"{shown}: content does not match its digest in bundle.json: {changed}")


def shown_path(root: Path, rel: str, shown_as: str | None) -> str:
    """How an error names the file `rel` of the bundle at `root`, which errors name `shown_as` (None: by its path)."""
    return f"{shown_as}/{rel}" if shown_as else str(root / rel)
