"""The registry of step kinds: every Step class (qbuild.planning.step), in the order a recipe's steps are planned.

Adding a step kind is a module in qbuild/steps/ and one line here (docs/developer-guide.md).
"""

from __future__ import annotations

from qbuild.planning.step import Step
from qbuild.steps.compile import Compile
from qbuild.steps.convert import Convert, Materialize
from qbuild.steps.fetch import Fetch
from qbuild.steps.package import Package
from qbuild.steps.port import Port
from qbuild.steps.reference import Reference
from qbuild.steps.shard import Shard
from qbuild.steps.verify import Verify

STEPS: list[type[Step]] = [
    Fetch,
    Convert,
    Materialize,
    Port,
    Shard,
    Compile,
    Package,
    Reference,
    Verify,
]
