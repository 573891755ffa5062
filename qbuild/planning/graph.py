"""Walks over a plan's DAG as plain data: what a node is built from, and what is built from it.

A `Graph` maps each node id to the ids of its inputs, in a topological order (a plan's order: Plan.graph). The
engine's scheduler (qbuild.execution.scheduler) and the lock's verdicts (qbuild.planning.lock) walk it here; nothing
here reads a node's params.
"""

from __future__ import annotations

from typing import Collection, Iterable, Mapping

Graph = Mapping[str, Collection[str]]     # node id -> the ids of its inputs; inputs come first


def upstream(graph: Graph, ids: Iterable[str]) -> set[str]:
    """`ids` and every node they are built from, at any depth."""
    out: set[str] = set()
    todo = list(ids)
    while todo:
        nid = todo.pop()
        if nid not in out:
            out.add(nid)
            todo.extend(graph[nid])
    return out


def users(graph: Graph) -> dict[str, list[str]]:
    """node id -> the nodes that take it as an input, in the graph's order."""
    out: dict[str, list[str]] = {nid: [] for nid in graph}
    for nid, inputs in graph.items():
        for dep in inputs:
            out[dep].append(nid)
    return out
