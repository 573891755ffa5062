"""compile: one of a recipe's compiled graphs, built by the backend its params name (qbuild.backends.base.Backend
.compile).

A CPU backend compiles one graph per node (a submodel at one bucket, no weights); the neuron backend compiles the whole
text model in one node and each vision bucket in its own. The backend plans these nodes (PlanningBackend.plan), and
whether what it writes runs on every platform is its answer (portable None).
"""

from __future__ import annotations

from qbuild import backends
from qbuild.planning.step import Context, Step


class Compile(Step):
    kind = "compile"
    params = object                  # the backend's own compile params (qbuild.backends.*.params)
    portable = None
    timed = True

    @classmethod
    def run(cls, ctx: Context) -> None:
        backends.get(ctx.params.backend).compile(ctx)
