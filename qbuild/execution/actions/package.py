"""package: converted configs + tokenizer, per-rank shards and every compiled graph -> one deployable bundle.

Files are hardlinked from the (immutable) inputs, so packaging copies nothing; the bundle's layout and manifest
are described in qbuild/store/bundle.py. Where the compiled graphs go is the backend's (Backend.package).
"""

from __future__ import annotations

from qbuild import backends
from qbuild.execution.actions import RunContext
from qbuild.recipe.params import PackageParams
from qbuild.store.bundle import write_manifest
from qbuild.store.files import link_tree


def run(ctx: RunContext) -> None:
    p: PackageParams = ctx.params
    # The unsharded text weights stay out: a bundle ships the per-rank shards.
    link_tree(ctx.inputs["converted"], ctx.out, skip=("text",))
    link_tree(ctx.inputs["shard"], ctx.out)
    graphs = backends.get(p.backend).package(ctx)
    doc = write_manifest(ctx.out, {**p.bundle_meta(), "graphs": dict(sorted(graphs.items()))})
    ctx.log(f"bundle: {len(doc['files'])} files, {sum(f['size'] for f in doc['files'].values())} bytes")
