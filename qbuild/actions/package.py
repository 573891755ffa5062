"""package: converted configs + tokenizer, per-rank shards and every compiled graph -> one deployable bundle.

Files are hardlinked from the (immutable) inputs, so packaging copies nothing; the bundle's layout and manifest
are described in qbuild/bundle.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from .. import jsonio
from ..actions import RunContext
from ..bundle import link_or_copy, write_manifest


def _link_tree(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> None:
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if path.is_file() and rel.parts[0] not in skip:
            link_or_copy(path, dst / rel)


def run(ctx: RunContext) -> None:
    p = ctx.params
    # The unsharded text weights stay out: a bundle ships the per-rank shards.
    _link_tree(ctx.inputs["converted"], ctx.out, skip=("text",))
    _link_tree(ctx.inputs["shard"], ctx.out)
    graphs, node_configs = {}, []
    for name, tree in sorted(ctx.inputs.items()):
        if not name.startswith("compile:"):
            continue
        graph = name.removeprefix("compile:")
        _link_tree(tree, ctx.out / "graphs")
        if p["backend"] == "neuron":
            graphs[graph] = f"graphs/{graph}"
            node_configs.append(json.loads((tree / graph / "neuron_config.json").read_text()))
        else:
            graphs[graph] = f"graphs/{graph}.pt2"
    expected = {f"cte-{b}" for b in p["cte_buckets"]} | {f"tkg-{b}" for b in p["tkg_buckets"]} | \
        {f"vision-{b}" for b in p["vision_buckets"]}
    if set(graphs) != expected:
        raise ValueError(f"package got graphs {sorted(graphs)}, planned {sorted(expected)}")
    if node_configs:
        from ..backends.neuron import bundle_neuron_config

        (ctx.out / "neuron_config.json").write_text(
            jsonio.dumps(bundle_neuron_config(node_configs), indent=1, sort_keys=True))
    meta = {"family": p["family"], "backend": p["backend"], "tp": p["tp"], "ep": p["ep"],
            "batch_size": p["batch_size"], "seq_len": p["seq_len"], "dtype": p["dtype"],
            "buckets": {"cte": p["cte_buckets"], "tkg": p["tkg_buckets"], "vision": p["vision_buckets"]},
            "graphs": dict(sorted(graphs.items()))}
    doc = write_manifest(ctx.out, meta)
    ctx.log(f"bundle: {len(doc['files'])} files, {sum(f['size'] for f in doc['files'].values())} bytes")
