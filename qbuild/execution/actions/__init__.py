"""The action interface.

An action is a pure function of its declared inputs: it reads `ctx.params` and the input trees under
`ctx.inputs`, and writes its outputs under `ctx.out`. The engine hashes, stores and caches the result. What an
action is made of (its entry point, the source hashed into its keys, its toolchain) is its spec in qbuild.planning.keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from qbuild.core.progress import StepProgress
    from qbuild.store import StoreSpec


@dataclass
class RunContext:
    """What an action sees: its params, materialised inputs (read-only), an empty output dir, and a scratch dir."""

    kind: str
    params: object                                 # the step's typed params (qbuild.recipe.params, a backend's)
    inputs: dict[str, Path]
    out: Path
    scratch: Path
    context: dict = field(default_factory=dict)   # non-key facts, e.g. where a local checkpoint lives
    log: Callable[[str], None] = print
    store: "StoreSpec | None" = None               # the store the job builds into (e.g. for the Neuron compile cache)
    # Where the step reports how much of its work is done (bytes, seconds): the worker's qbuild.core.progress
    # StepProgress; None where nobody listens (an action called directly). Never read into an output.
    progress: "StepProgress | None" = None
