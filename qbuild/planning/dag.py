"""The plan as data: its nodes (one build step each, of a step kind), each recipe's roles, and the DAG they make.

A node's id is structural (its kind, params, the ids of its inputs and its backend), so equal work in two recipes is
one node: the tp4 and tp8 recipes of a model share fetch, convert and reference. The planner that makes a Plan is
qbuild.planning.plan; what keys its nodes, qbuild.planning.keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qbuild.model.arch import Arch
from qbuild.planning.step import Source, Step
from qbuild.recipe.schema import LoadedRecipe

if TYPE_CHECKING:
    from qbuild.core.errors import QbuildError
    from qbuild.planning.backend import Backends


@dataclass
class Node:
    """One step of the plan. `resources` are the devices the step runs on, by the name its backend gives them and an
    executor schedules them by (verifying a neuron bundle: {"neuron_cores": 8}); empty where any host runs it."""

    id: str
    step: type[Step]                 # its step kind, which runs it and whose code its key holds
    name: str                        # what a person reads: "compile cte-128", "fetch Qwen/Qwen3.5-2B"
    params: object                   # the step's typed params; their JSON enters the key
    deps: dict[str, str]             # input name -> node id
    backend: str | None              # the backend whose implementation the node runs, if any
    est_out_bytes: int
    est_peak_bytes: int
    source: Source | None = None     # where its source is on this machine; never in a key
    recipes: list[str] = field(default_factory=list)
    resources: dict[str, int] = field(default_factory=dict)     # devices it runs on; empty: any host
    unresolved: QbuildError | None = None   # why a hub fetch has no commit (so no key); None when it has one
    est_new_bytes: int | None = None    # what of its output no input holds (a package links them); None: all of it
    code: tuple[str, ...] = ()      # modules it runs beyond its step's own (a backend's implementation, a shard
                                    # layout's rules): their import closures join its key (qbuild.planning.keys)

    @property
    def kind(self) -> str:
        return self.step.kind

    @property
    def needs_device(self) -> bool:
        return any(self.resources.values())


@dataclass
class PlannedRecipe:
    loaded: LoadedRecipe
    arch: Arch
    nodes: dict[str, str]           # role ("fetch", "compile cte-128", "package", ...) -> node id
    bundle: str                     # id of the package node
    verify: str                     # id of the verify node
    kept: str | None = None         # id of the node materializing the converted weights (--keep-intermediates):
                                    # built on request, never locked, so no role names it


@dataclass
class Plan:
    nodes: dict[str, Node]          # in a topological order
    recipes: dict[str, PlannedRecipe]
    backends: Backends | None = None    # the registry it was planned with (None: a plan of no backend's nodes)

    def roles(self, node_id: str) -> list[tuple[str, str]]:
        return [(r, role) for r, pr in self.recipes.items() for role, nid in pr.nodes.items() if nid == node_id]

    def graph(self) -> dict[str, tuple[str, ...]]:
        """The DAG (qbuild.planning.graph.Graph): each node's distinct inputs (a node may take one input under two
        names)."""
        return {nid: tuple(dict.fromkeys(node.deps.values())) for nid, node in self.nodes.items()}
