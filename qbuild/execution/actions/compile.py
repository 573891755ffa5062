"""compile: a recipe's compiled graphs, built by the backend its params name (qbuild.backends.base.Backend.compile).

A CPU backend compiles one graph per node (a submodel at one bucket, no weights); the neuron backend compiles the whole
text model in one node and each vision bucket in its own.
"""

from __future__ import annotations

from qbuild import backends
from qbuild.execution.actions import RunContext


def run(ctx: RunContext) -> None:
    backends.get(ctx.params.backend).compile(ctx)
