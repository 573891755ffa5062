"""Compile backends, behind one seam (qbuild.backends.base.Backend): how a recipe's graphs are compiled, packaged
and run.

- export: a torch.export program (.pt2), weights as graph inputs; fast, for tests and for inspecting graphs.
- inductor: an AOTInductor package (.pt2) compiled to native CPU code from the same exported program.
- neuron: NxDI / neuronx-cc where the Neuron SDK is installed (its config translation is pure).

Callers name a backend only by a recipe's (or --backend's) string and ask `get(name)` for its implementation, which
is imported on first use; a shard step asks `shard_layout(name)` for the rules its params name, and `qbuild serve`
asks `server(name)` for what serves a bundle (no build step does, so a server's code is kept out of every key). The
backend classes import torch and the SDK only inside the methods that build, so planning stays light.

May import: qbuild.core, qbuild.store, qbuild.model, qbuild.recipe, qbuild.hub, qbuild.planning (whose protocols a
backend implements: planning imports no backend, and is handed this registry by whoever plans). Nothing outside this
package names a backend.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from qbuild.backends.base import Backend, Server

NAMES: tuple[str, ...] = ("neuron", "inductor", "export")   # what a recipe's `backend:` and `--backend` may name
# What `qbuild serve --server` may ask for: qbuild's own OpenAI-compatible server, or vLLM with the Neuron plugin.
SERVERS: tuple[str, ...] = ("qbuild", "vllm")
# name -> "module:factory" called with the name
_IMPLEMENTATIONS = {"neuron": "qbuild.backends.neuron.backend:NeuronBackend",
                    "inductor": "qbuild.backends.cpu.backend:CpuBackend",
                    "export": "qbuild.backends.cpu.backend:CpuBackend"}
# name -> "module:factory" of its server, called with the name: what `qbuild serve` and `qbuild pull` ask. Kept apart
# from the implementation because no build step serves: no key holds a server's code.
_SERVERS = {"neuron": "qbuild.backends.neuron.serving:NeuronServer",
            "inductor": "qbuild.backends.cpu.serving:CpuServer",
            "export": "qbuild.backends.cpu.serving:CpuServer"}
# A shard layout's name (ShardParams.layout) -> "module:object" of its rules (a ShardLayout,
# qbuild.model.convert.parallel).
# The shard step imports the module of its own layout alone, so an edit of one layout's rules keys only its steps.
_LAYOUTS = {"cpu": "qbuild.model.convert.shard:CPU",
            "nxd-main": "qbuild.backends.neuron.layout.nxd:MAIN",
            "nxd-main-replicated": "qbuild.backends.neuron.layout.nxd:MAIN_REPLICATED",
            "nxd-moe": "qbuild.backends.neuron.layout.nxd:MOE"}
LAYOUTS: tuple[str, ...] = tuple(_LAYOUTS)                  # what ShardParams.layout may name
_loaded: dict[str, "Backend"] = {}
_overrides: dict[str, "Backend"] = {}


def server(name: str) -> "Server":
    """The server of backend `name`'s bundles (imported on first use); ValueError listing NAMES for any other name."""
    if name not in _SERVERS:
        raise ValueError(f"{name!r} is not one of {', '.join(NAMES)}")
    module, factory = _SERVERS[name].split(":")
    return getattr(importlib.import_module(module), factory)(name)


def implementation_module(name: str) -> str:
    """The module that implements backend `name`: what a node running it imports beyond its step's own code."""
    if name not in _IMPLEMENTATIONS:
        raise ValueError(f"{name!r} is not one of {', '.join(NAMES)}")
    return _IMPLEMENTATIONS[name].partition(":")[0]


def get(name: str) -> "Backend":
    """The backend `name` names; ValueError listing NAMES for any other name."""
    if name in _overrides:
        return _overrides[name]
    if name not in _IMPLEMENTATIONS:
        raise ValueError(f"{name!r} is not one of {', '.join(NAMES)}")
    if name not in _loaded:
        module, factory = _IMPLEMENTATIONS[name].split(":")
        _loaded[name] = getattr(importlib.import_module(module), factory)(name)
    return _loaded[name]


def layout_module(layout: str) -> str:
    """The module holding the rules of shard layout `layout`: what a shard step writing it imports beyond its step's
    own code."""
    if layout not in _LAYOUTS:
        raise ValueError(f"shard layout {layout!r} is not one of {', '.join(_LAYOUTS)}")
    return _LAYOUTS[layout].partition(":")[0]


def shard_layout(layout: str):
    """The rules of shard layout `layout` (a qbuild.model.convert.parallel.ShardLayout, imported on first use);
    ValueError for a name no layout has."""
    module = layout_module(layout)
    return getattr(importlib.import_module(module), _LAYOUTS[layout].partition(":")[2])


def bundle_backend(bundle: Path | str, manifest: dict) -> "Backend":
    """The backend whose bundle this is (Backend.recognises, from its bundle.json `manifest`); UserError naming the
    bundle where none is."""
    from qbuild.core.errors import UserError

    for name in NAMES:
        if get(name).recognises(manifest):
            return get(name)
    raise UserError(f"{bundle}: not a bundle of any backend ({', '.join(NAMES)}): its bundle.json names backend "
                    f"{manifest.get('backend')!r} and graphs {_names(manifest.get('graphs'))}")


def _names(graphs) -> list[str]:
    """The graph names a bundle.json lists, for a message (whatever it holds)."""
    return sorted(map(str, graphs)) if isinstance(graphs, dict) else []


def load_runtime(bundle: Path, *, verify_digests: bool = True, shown_as: str | None = None):
    """`bundle` loaded to run prompts on this host, by the backend whose bundle it is (Backend.runtime); UserError
    where it is no backend's, or where this host cannot run it. Errors name the bundle `shown_as` (default: its
    path; a locked recipe's bundle laid out in a temporary directory is named by the recipe)."""
    from qbuild.model.bundle import read_manifest

    manifest = read_manifest(bundle, shown_as)
    return bundle_backend(shown_as or bundle, manifest).runtime(bundle, manifest, verify_digests, shown_as)


def side_caches() -> list:
    """Every side cache some backend keeps in the store (qbuild.store.side_cache), once each: what gc trims and
    `store verify` checks beside the store's own entries."""
    found = {}
    for name in NAMES:
        for cache in get(name).side_caches():
            found.setdefault(cache.name, cache)
    return list(found.values())


@contextmanager
def using(backend: "Backend") -> Iterator["Backend"]:
    """Within the block, `get(backend.name)` returns `backend` (a test double, or one configured otherwise) in this
    process."""
    previous = _overrides.get(backend.name)
    _overrides[backend.name] = backend
    try:
        yield backend
    finally:
        if previous is None:
            del _overrides[backend.name]
        else:
            _overrides[backend.name] = previous
