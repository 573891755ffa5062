"""Keys, in-process on toy graphs: the preimage, the one walk with its digest sources, statuses and reasons."""

from __future__ import annotations

import importlib.metadata

from qbuild.planning.keys import ActionSpec, as_locked, key_node, key_of, preimage, walk
from qbuild.planning.keys import LockedNode
from qbuild.planning.plan import Plan, _add, evaluate, explain
from qbuild.store.manifest import Manifest
from tests.engine_actions import SLEEP, TEST_REGISTRY


def _chain(**params) -> tuple[Plan, list[str]]:
    """a -> b -> c, each a test-sleep step; `params` go into b's params."""
    nodes: dict = {}
    a = _add(nodes, "toy", "test-sleep", "a", {"name": "a"}, {}, 1, 1)
    b = _add(nodes, "toy", "test-sleep", "b", {"name": "b", **params}, {"up": a}, 1, 1)
    c = _add(nodes, "toy", "test-sleep", "c", {"name": "c"}, {"up": b}, 1, 1)
    return Plan(nodes, {}), [a, b, c]


def _manifest(key: str, digest: str) -> Manifest:
    return Manifest(key=key, kind="test-sleep", preimage={}, outputs={"value.txt": {"digest": digest, "size": 1}},
                    digest=digest)


def test_the_preimage_holds_the_action_source_hash_under_version():
    plan, (a, _, _) = _chain()
    pre = preimage(plan.nodes[a], {}, TEST_REGISTRY)
    assert pre == {"action": "test-sleep", "version": SLEEP.source_hash(), "params": {"name": "a"}, "inputs": {},
                   "toolchain": SLEEP.toolchain_versions()}
    # tests.engine_actions imports the keys module, which imports pydantic (through the typed params): a
    # third-party distribution of the closure is in the key with its installed version.
    assert pre["toolchain"]["pydantic"] == importlib.metadata.version("pydantic")
    other = ActionSpec("test-sleep", "tests.test_keys:_manifest")
    assert key_of(preimage(plan.nodes[a], {}, {"test-sleep": other})) != key_of(pre)


def test_a_pinned_toolchain_replaces_the_installed_one():
    nodes: dict = {}
    nid = _add(nodes, "toy", "test-sleep", "x", {"name": "x", "toolchain": {"neuronx-cc": "2.21"}}, {}, 1, 1)
    assert preimage(nodes[nid], {}, TEST_REGISTRY)["toolchain"] == {"neuronx-cc": "2.21"}


def test_walk_keys_a_node_once_its_inputs_digests_are_known():
    plan, (a, b, c) = _chain()
    digests = {a: "d-a"}
    keys = walk(plan, lambda nid, key: digests.get(nid), TEST_REGISTRY)
    assert keys[a].digest == "d-a" and keys[b].key is not None and keys[b].digest is None
    assert keys[b].preimage["inputs"] == {"up": "d-a"}
    assert keys[c].key is None and keys[c].unknown == ("up",)
    # The walk and the engine's per-node step are one function: the same digests give the same key.
    assert key_node(plan.nodes[b], {a: "d-a"}, TEST_REGISTRY).key == keys[b].key


def test_evaluate_reads_statuses_from_the_store_and_reasons_from_the_lock():
    plan, (a, b, c) = _chain()
    ka = walk(plan, lambda nid, key: None, TEST_REGISTRY)[a].key
    store = {ka: _manifest(ka, "d-a")}
    kb = key_node(plan.nodes[b], {a: "d-a"}, TEST_REGISTRY).key
    old_b = as_locked(key_node(plan.nodes[b], {a: "d-old"}, TEST_REGISTRY).preimage)
    status = evaluate(plan, store.get, {b: LockedNode("k", old_b, "d-b")}, TEST_REGISTRY)
    assert (status[a].status, status[a].why) == ("cached", "cached")
    assert (status[b].status, status[b].key, status[b].why) == ("build", kb, "inputs.up: d-old -> d-a")
    assert (status[c].status, status[c].key, status[c].why) == ("waiting", None, "waits on up")
    assert evaluate(plan, store.get, {}, TEST_REGISTRY)[b].why == "no entry"


def test_explain_names_a_change_below_a_miss_with_the_lock_digests():
    """b is a miss, so c's input digest is unknown: keyed with the digest the lock recorded for b, c's own changed
    param is named, while `evaluate` (and so `plan`) only says that c waits."""
    before, (a, b, c) = _chain()
    locked_keys = walk(before, lambda nid, key: {a: "d-a", b: "d-b"}.get(nid), TEST_REGISTRY)
    locked = {nid: LockedNode(nk.key, as_locked(nk.preimage), f"d-{before.nodes[nid].name}")
              for nid, nk in locked_keys.items()}
    nodes: dict = {}
    a2 = _add(nodes, "toy", "test-sleep", "a", {"name": "a"}, {}, 1, 1)
    b2 = _add(nodes, "toy", "test-sleep", "b", {"name": "b", "seconds": 2}, {"up": a2}, 1, 1)
    c2 = _add(nodes, "toy", "test-sleep", "c", {"name": "c", "seconds": 3}, {"up": b2}, 1, 1)
    after = Plan(nodes, {})
    # The planned ids differ where params changed; the lock's entries are matched to them by role.
    by_plan = {a2: locked[a], b2: locked[b], c2: locked[c]}
    store = {locked[a].key: _manifest(locked[a].key, "d-a")}
    status = evaluate(after, store.get, by_plan, TEST_REGISTRY)
    assert status[b2].why == "params.seconds: None -> 2" and status[c2].why == "waits on up"
    why = explain(after, status, by_plan, TEST_REGISTRY)
    assert why == {a2: "cached", b2: "params.seconds: None -> 2", c2: "waits on up; params.seconds: None -> 3"}
    # Unchanged below the miss: it only waits. Not locked at all: said so.
    unchanged = explain(before, evaluate(before, {}.get, locked, TEST_REGISTRY), locked, TEST_REGISTRY)
    assert unchanged[c] == "waits on up"
    assert explain(after, status, {a2: locked[a]}, TEST_REGISTRY)[c2] == "waits on up"
    assert explain(after, status, {a2: locked[a], b2: locked[b]}, TEST_REGISTRY)[c2] == "waits on up; no entry"
