"""package: converted configs + tokenizer, per-rank shards and every compiled graph -> one deployable bundle.

Files are hardlinked from the (immutable) inputs, so packaging copies nothing; the bundle's layout and manifest
are described in qbuild/model/bundle.py. Where the compiled graphs go is the backend's (Backend.package), and so is
whether the bundle runs on every platform (portable None: a bundle of native graphs does not).
"""

from __future__ import annotations

from qbuild import backends
from qbuild.core.units import GIB
from qbuild.planning.step import Context, PlannedNode, Step
from qbuild.recipe.params import PackageParams
from qbuild.model.bundle import write_manifest
from qbuild.core.files import link_tree


class Package(Step):
    kind = "package"
    params = PackageParams
    inputs = ("converted", "shard")
    portable = None

    @classmethod
    def plan(cls, recipe) -> None:
        compiles = [planned.role for planned in recipe.backend_plan.compiles]
        deps = {"converted": "convert", "shard": "shard", **recipe.source_roles(),
                **{role.replace(" ", ":"): role for role in compiles}}
        # A bundle links its weights and graphs from its inputs: what it writes itself is a manifest and configs.
        recipe.add(PlannedNode("package", cls.kind, f"package {recipe.name}", recipe.backend_plan.package, deps,
                               recipe.sizes.weights + recipe.sizes.vision + len(compiles) * (64 << 20), GIB // 2,
                               backend=recipe.loaded.recipe.backend, est_new_bytes=1 << 20, code=recipe.runs))

    @classmethod
    def run(cls, ctx: Context) -> None:
        p: PackageParams = ctx.params
        # The unsharded text weights stay out: a bundle ships the per-rank shards.
        link_tree(ctx.inputs["converted"], ctx.out, skip=("text",))
        link_tree(ctx.inputs["shard"], ctx.out)
        graphs = backends.get(p.backend).package(ctx)
        doc = write_manifest(ctx.out, {**p.bundle_meta(), "graphs": dict(sorted(graphs.items()))})
        ctx.log(f"bundle: {len(doc['files'])} files, {sum(f['size'] for f in doc['files'].values())} bytes")
