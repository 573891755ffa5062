"""A step kind: one typed object that says everything about one kind of build step.

A step kind is a subclass of `Step` in a module of its own (qbuild/steps/, or a backend's for the steps it alone
runs): its `kind` (the name its nodes, keys and lock entries carry), its params type, the inputs it reads, how it
plans its nodes into a recipe's plan (`plan`), how it runs (`run`), whether its output is the same on every platform
(`portable`), and what its key holds of the code (its own module's import closure, and a node's `code`: the backend or
shard layout it runs, qbuild.planning.keys). The registry of step kinds is a list of these classes
(qbuild.steps.registry.STEPS), in the order a recipe's steps are planned; planning is handed it, and a node carries its class
to the worker that runs it. Adding a step kind is one module and one line in that list (docs/developer-guide.md).

What a step reads of this machine is its `Context` (where the source checkpoint's files are, the store it builds
into, where its progress goes), never part of a key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar

if TYPE_CHECKING:
    from qbuild.core.progress import StepProgress
    from qbuild.store.spec import StoreSpec


@dataclass(frozen=True)
class LockedFiles:
    """The files the lockfile holds for a hub model's pinned commit: a fetch of that commit must give them."""

    lock: str                        # the lockfile, for the refusal's line
    files: dict[str, str]            # file name -> digest


@dataclass(frozen=True)
class Source:
    """Where a recipe's source is on this machine, for the steps that read it: a local directory (a checkpoint, or a
    port being worked on), or for a hub model the revision the recipe asked for and the files the lock holds for its
    pinned commit. Set when the plan is made; never in a key (two machines key the same node alike)."""

    path: str | None = None
    requested_revision: str | None = None
    locked_files: LockedFiles | None = None


@dataclass(frozen=True)
class Checkpoint:
    """The source checkpoint's files on the machine a step runs on, located by the worker from the snapshot the fetch
    step recorded, for a step that reads them (Step.reads_checkpoint)."""

    files: dict[str, Path]           # file name -> its path here
    digests: dict[str, str]          # file name -> the digest the snapshot records


@dataclass
class Context:
    """What a step sees when it runs: its params, its inputs (read-only trees), an empty output directory and a
    scratch one, and the facts of this machine it may read."""

    params: Any                      # the node's typed params (the step's `params` type)
    inputs: dict[str, Path]          # input name -> the materialized output tree of the node it names
    out: Path
    scratch: Path
    source: Source = field(default_factory=Source)
    checkpoint: Checkpoint | None = None
    store: "StoreSpec | None" = None  # the store the step builds into (a backend keeps its compiler's cache there)
    log: Callable[[str], None] = print
    # Where the step reports how much of its work is done (qbuild.core.progress); None where nobody listens. Never
    # read into an output.
    progress: "StepProgress | None" = None


@dataclass(frozen=True)
class PlannedNode:
    """One node a step kind (or a recipe's backend, for the kinds it plans) adds to a recipe's plan. Its inputs are
    named by the roles of the recipe's nodes planned before it; the planner makes them node ids and merges equal work
    of several recipes into one node (qbuild.planning.plan.RecipePlanning.add)."""

    role: str | None                 # the recipe's name for it ("convert", "compile cte-128"); None: never locked
    kind: str                        # its step kind
    name: str                        # what a person reads: "compile cte-128 (export)", "fetch Qwen/Qwen3.5-2B"
    params: Any                      # its typed params; their JSON enters its id and key
    deps: dict[str, str]             # input name -> the role of the node it takes
    est_out_bytes: int
    est_peak_bytes: int
    source: Source | None = None     # where its source is on this machine (steps that read one)
    resources: dict[str, int] = field(default_factory=dict)   # devices it runs on (Node.resources)
    backend: str | None = None       # the backend whose implementation it runs
    unresolved: Exception | None = None   # why a hub fetch has no commit to key it on
    est_new_bytes: int | None = None      # what of its output no input holds (None: all of it)
    code: tuple[str, ...] = ()       # modules it runs beyond its step's own (a backend's, a shard layout's)


class Step:
    """A kind of build step (see the module docstring). Subclasses set the class attributes and define `run`, and
    `plan` where the step plans its own nodes rather than take those its recipe's backend plans."""

    kind: ClassVar[str]
    params: ClassVar[type | tuple[type, ...]]     # the type of its nodes' params
    inputs: ClassVar[tuple[str, ...]] = ()        # the inputs every node of it takes (a node may take more)
    reads_checkpoint: ClassVar[bool] = False      # the worker locates the source checkpoint's files for it
    # Whether its output is the same on every platform (machine, libc, Python, torch's CPU kernels); None: the
    # backend its params name decides (PlanningBackend.portable).
    portable: ClassVar[bool | None] = True
    # Whether a running node reports its elapsed seconds against how long the last one of its kind and architecture
    # took (a step without byte counts of its own). Not in any key.
    timed: ClassVar[bool] = False
    data: ClassVar[tuple[str, ...]] = ()          # files it reads beside code, relative to its top-level package

    @classmethod
    def module(cls) -> str:
        """The module the step's key holds the import closure of: where the step is defined."""
        return cls.__module__

    @classmethod
    def plan(cls, recipe: "RecipePlanning") -> None:   # noqa: F821 (qbuild.planning.plan, which imports this)
        """Add this kind's nodes to one recipe's plan. By default, the nodes of this kind the recipe's backend
        planned (a compile per graph, a port)."""
        recipe.add_backend_nodes(cls)

    # run(cls, ctx: Context) -> None, a classmethod every kind defines: build one node into ctx.out from its params
    # and inputs. A kind without one, or without its kind and params, is refused where its class is defined.
    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        missing = [name for name in ("kind", "params", "run") if not hasattr(cls, name)]
        if missing:
            raise TypeError(f"step kind {cls.__qualname__} does not set {', '.join(missing)}")
