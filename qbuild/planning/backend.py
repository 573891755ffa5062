"""What planning asks of a backend, and what a backend adds to a recipe's plan.

Planning names no backend and imports none: whoever plans (the workspace, a command) passes the registry of backends
in (`Backends`; the module qbuild.backends is one), and each backend answers through these protocols with these
types. qbuild.backends.base.Backend extends `PlanningBackend` with what building, running and serving ask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from qbuild.model.arch import Arch
from qbuild.planning.step import PlannedNode
from qbuild.recipe.params import PackageParams, ShardParams
from qbuild.recipe.schema import LoadedRecipe


@dataclass(frozen=True)
class Sizes:
    """The planner's estimates of a recipe's weights, which a backend's own estimates build on."""

    weights: int                     # the text weights, in the recipe's dtype and FP8 policy
    vision: int                      # the vision encoder's weights (0 without one)


@dataclass(frozen=True)
class BackendPlan:
    """A backend's part of a recipe's plan: the nodes of the kinds it plans (its source nodes, such as a port, and its
    compile nodes: step kinds whose `plan` takes them, qbuild.planning.step.Step.plan), the shard and package params,
    and `verify_resources`, the devices verifying the bundle runs on, by the name an executor schedules them by (a
    neuron bundle's {"neuron_cores": 8}); empty where any host runs it. Every source node is an input of the shard,
    package and verify nodes under its role; each compile node names its own inputs."""

    sources: tuple[PlannedNode, ...]
    shard: ShardParams
    compiles: tuple[PlannedNode, ...]
    package: PackageParams
    verify_resources: dict[str, int] = field(default_factory=dict)

    def nodes(self) -> tuple[PlannedNode, ...]:
        return self.sources + self.compiles


class SourceEnvironment(Protocol):
    """What a backend's planning reads of the machine (a part of qbuild.planning.plan.Environment)."""

    def port_digests(self, port_dir: Path) -> dict[str, str] | None:
        """Relative path -> "blake3:<hex>" of a port's source files; None where the directory does not exist."""


class PlanningBackend(Protocol):
    """What planning asks of the backend a recipe names: its checks, its part of the plan, and the decisions keys and
    explanations need. Pure over the arguments; no torch."""

    name: str

    def validate(self, loaded: LoadedRecipe, arch: Arch) -> None:
        """Raise RecipeError (at the field's file:line:column) for what this backend cannot build of the recipe."""

    def plan(self, loaded: LoadedRecipe, arch: Arch, env: SourceEnvironment, sizes: Sizes) -> BackendPlan:
        """The recipe's source, shard, compile and package steps on this backend."""

    def explain_reuse(self, old: dict, new: object) -> str | None:
        """What a compile whose locked params were `old` (JSON) can still reuse now that they are `new`."""

    def portable(self, kind: str) -> bool:
        """Whether what this backend's `kind` step (compile, package) writes is the same, and runs, on every platform:
        False for native code built for this host's machine, libc, Python and CPU."""


class Backends(Protocol):
    """The registry of backends a plan is made with (the module qbuild.backends, or a test's)."""

    NAMES: tuple[str, ...]           # what a recipe's `backend:` may name

    def get(self, name: str) -> PlanningBackend:
        """The backend `name` names; ValueError for any other name."""

    def implementation_module(self, name: str) -> str:
        """The module implementing backend `name`, whose import closure joins the keys of the nodes that run it."""

    def layout_module(self, layout: str) -> str:
        """The module holding shard layout `layout`'s rules, whose import closure joins the key of a shard step
        writing it."""
