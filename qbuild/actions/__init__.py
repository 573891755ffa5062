"""The action interface and the registry of actions.

An action is a pure function of its declared inputs: it reads `ctx.params` and the input trees under
`ctx.inputs`, and writes its outputs under `ctx.out`. The engine hashes, stores and caches the result. An action
registers by naming the function to run (imported only in the worker, so planning stays light), the source it
is made of (hashed into every key it produces, so editing a converter rebuilds conversions and nothing else),
and the distributions whose versions enter its keys.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..hashing import digest_bytes

if TYPE_CHECKING:
    from ..store import StoreSpec


@dataclass(frozen=True)
class ActionSpec:
    kind: str
    entry: str                                 # "package.module:function", called as function(ctx)
    sources: tuple[str, ...]                   # modules or packages whose source files are hashed into keys
    toolchain: tuple[str, ...] = ()            # distributions whose installed versions are hashed into keys
    optional_toolchain: tuple[str, ...] = ()   # the same, where installed (e.g. the Neuron SDK)

    @property
    def version(self) -> str:
        return _source_hash(self.sources)

    def toolchain_versions(self) -> dict[str, str]:
        return _toolchain(self.toolchain, self.optional_toolchain)


@dataclass
class RunContext:
    """What an action sees: its params, materialised inputs (read-only), an empty output dir, and a scratch dir."""

    kind: str
    params: dict
    inputs: dict[str, Path]
    out: Path
    scratch: Path
    context: dict = field(default_factory=dict)   # non-key facts, e.g. where a local checkpoint lives
    log: Callable[[str], None] = print
    store: "StoreSpec | None" = None               # the store the job builds into (e.g. for the Neuron compile cache)


def _source_files(name: str) -> list[Path]:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ValueError(f"action source {name!r} is not importable")
    origin = Path(spec.origin)
    if spec.submodule_search_locations:
        return sorted(p for p in origin.parent.rglob("*.py"))
    return [origin]


@cache
def _source_hash(sources: tuple[str, ...]) -> str:
    parts = []
    for name in sources:
        for path in _source_files(name):
            parts.append(f"{name}:{path.name}:{digest_bytes(path.read_bytes())}")
    return digest_bytes("\n".join(sorted(parts)).encode())[:32]


@cache
def _toolchain(required: tuple[str, ...], optional: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for dist in required + optional:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            if dist in required:
                out[dist] = "absent"
    return out


_SRC = "qbuild.actions"
REGISTRY: dict[str, ActionSpec] = {}


def register(spec: ActionSpec) -> ActionSpec:
    REGISTRY[spec.kind] = spec
    return spec


def get(kind: str) -> ActionSpec:
    return REGISTRY[kind]


for _spec in (
    ActionSpec("fetch", f"{_SRC}.fetch:run", (f"{_SRC}.fetch",), ("huggingface_hub",)),
    ActionSpec("port", f"{_SRC}.port:run", (f"{_SRC}.port",)),
    ActionSpec("convert", f"{_SRC}.convert:run", (f"{_SRC}.convert", "qbuild.convert", "qbuild.families",
                                                  "qbuild.arch"), ("safetensors", "torch")),
    ActionSpec("shard", f"{_SRC}.shard:run", (f"{_SRC}.shard", "qbuild.convert", "qbuild.families", "qbuild.arch"),
               ("safetensors", "torch")),
    # A neuron compile pins its toolchain in its params (the recipe's `toolchain`), which then replaces these.
    ActionSpec("compile", f"{_SRC}.compile:run", (f"{_SRC}.compile", "qbuild.params", "qbuild.backends",
                                                  "qbuild.modeling", "qbuild.kernels", "qbuild.ports",
                                                  "qbuild.families", "qbuild.arch"), ("torch",)),
    ActionSpec("package", f"{_SRC}.package:run", (f"{_SRC}.package", "qbuild.params", "qbuild.bundle",
                                                  "qbuild.backends.neuron", "qbuild.families", "qbuild.arch",
                                                  "qbuild.convert.hybrid")),
    ActionSpec("reference", f"{_SRC}.reference:run", (f"{_SRC}.reference", "qbuild.families"),
               ("torch", "transformers")),
    ActionSpec("verify", f"{_SRC}.verify:run", (f"{_SRC}.verify", "qbuild.params", "qbuild.runtime",
                                                "qbuild.modeling", "qbuild.kernels", "qbuild.backends",
                                                "qbuild.families", "qbuild.arch", "qbuild.convert"), ("torch",)),
):
    register(_spec)
