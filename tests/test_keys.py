"""Keys, in-process on toy graphs: the preimage, the one walk with its digest sources, statuses and reasons."""

from __future__ import annotations

import importlib.metadata

from qbuild.planning.dag import Plan
from qbuild.planning.keys import LockedNode, as_locked, code_hash, key_node, key_of, preimage, toolchain_versions, walk
from qbuild.planning.plan import evaluate, explain
from qbuild.store.manifest import Manifest
from tests.engine_actions import Sleep, add


def _chain(**params) -> tuple[Plan, list[str]]:
    """a -> b -> c, each a test-sleep step; `params` go into b's params."""
    nodes: dict = {}
    a = add(nodes, Sleep, "a", {"name": "a"}, {}, 1, 1)
    b = add(nodes, Sleep, "b", {"name": "b", **params}, {"up": a}, 1, 1)
    c = add(nodes, Sleep, "c", {"name": "c"}, {"up": b}, 1, 1)
    return Plan(nodes, {}), [a, b, c]


def _manifest(key: str, digest: str) -> Manifest:
    return Manifest(key=key, kind="test-sleep", preimage={}, outputs={"value.txt": {"digest": digest, "size": 1}},
                    digest=digest)


def test_the_preimage_holds_the_hash_of_the_code_the_step_runs():
    plan, (a, _, _) = _chain()
    pre = preimage(plan.nodes[a], {})
    assert pre == {"action": "test-sleep", "code_hash": code_hash(Sleep), "params": {"name": "a"}, "inputs": {},
                   "toolchain": toolchain_versions(Sleep)}
    # tests.engine_actions imports the planning modules, which import pydantic (through the typed params): a
    # third-party distribution of the closure is in the key with its installed version.
    assert pre["toolchain"]["pydantic"] == importlib.metadata.version("pydantic")
    # A step kind defined elsewhere runs other code: another key.
    from dataclasses import replace

    other = type("Other", (Sleep,), {"__module__": "tests.test_keys"})
    assert key_of(preimage(replace(plan.nodes[a], step=other), {})) != key_of(pre)


def test_a_pinned_toolchain_replaces_the_installed_one():
    nodes: dict = {}
    nid = add(nodes, Sleep, "x", {"name": "x", "toolchain": {"neuronx-cc": "2.21"}}, {}, 1, 1)
    assert preimage(nodes[nid], {})["toolchain"] == {"neuronx-cc": "2.21"}


def test_walk_keys_a_node_once_its_inputs_digests_are_known():
    plan, (a, b, c) = _chain()
    digests = {a: "d-a"}
    keys = walk(plan, lambda nid, key: digests.get(nid))
    assert keys[a].digest == "d-a" and keys[b].key is not None and keys[b].digest is None
    assert keys[b].preimage["inputs"] == {"up": "d-a"}
    assert keys[c].key is None and keys[c].unknown == ("up",)
    # The walk and the engine's per-node step are one function: the same digests give the same key.
    assert key_node(plan.nodes[b], {a: "d-a"}).key == keys[b].key


def test_evaluate_reads_statuses_from_the_store_and_reasons_from_the_lock():
    plan, (a, b, c) = _chain()
    ka = walk(plan, lambda nid, key: None)[a].key
    store = {ka: _manifest(ka, "d-a")}
    kb = key_node(plan.nodes[b], {a: "d-a"}).key
    old_b = as_locked(key_node(plan.nodes[b], {a: "d-old"}).preimage)
    status = evaluate(plan, store.get, {b: LockedNode("k", old_b, "d-b")})
    assert (status[a].status, status[a].why) == ("cached", "cached")
    assert (status[b].status, status[b].key, status[b].why) == ("build", kb, "inputs.up: d-old -> d-a")
    assert (status[c].status, status[c].key, status[c].why) == ("waiting", None, "waits on up")
    assert evaluate(plan, store.get, {})[b].why == "no entry"


def test_explain_names_a_change_below_a_miss_with_the_lock_digests():
    """b is a miss, so c's input digest is unknown: keyed with the digest the lock recorded for b, c's own changed
    param is named, while `evaluate` (and so `plan`) only says that c waits."""
    before, (a, b, c) = _chain()
    locked_keys = walk(before, lambda nid, key: {a: "d-a", b: "d-b"}.get(nid))
    locked = {nid: LockedNode(nk.key, as_locked(nk.preimage), f"d-{before.nodes[nid].name}")
              for nid, nk in locked_keys.items()}
    nodes: dict = {}
    a2 = add(nodes, Sleep, "a", {"name": "a"}, {}, 1, 1)
    b2 = add(nodes, Sleep, "b", {"name": "b", "seconds": 2}, {"up": a2}, 1, 1)
    c2 = add(nodes, Sleep, "c", {"name": "c", "seconds": 3}, {"up": b2}, 1, 1)
    after = Plan(nodes, {})
    # The planned ids differ where params changed; the lock's entries are matched to them by role.
    by_plan = {a2: locked[a], b2: locked[b], c2: locked[c]}
    store = {locked[a].key: _manifest(locked[a].key, "d-a")}
    status = evaluate(after, store.get, by_plan)
    assert status[b2].why == "params.seconds: None -> 2" and status[c2].why == "waits on up"
    why = explain(after, status, by_plan)
    assert why == {a2: "cached", b2: "params.seconds: None -> 2", c2: "waits on up; params.seconds: None -> 3"}
    # Unchanged below the miss: it only waits. Not locked at all: said so.
    unchanged = explain(before, evaluate(before, {}.get, locked), locked)
    assert unchanged[c] == "waits on up"
    assert explain(after, status, {a2: locked[a]})[c2] == "waits on up"
    assert explain(after, status, {a2: locked[a], b2: locked[b]})[c2] == "waits on up; no entry"
