"""The lockfile's model and the laws its merge obeys (qbuild.planning.lock), as properties over generated builds.

A generated world: recipes over one checkpoint, each converting it one of two ways (recipes that convert alike share
the fetch and convert steps, as tp4 and tp8 recipes of a model do) and packaging and verifying a bundle of its own.
A build of some recipes at some generation (a qbuild upgrade that changes a step's bytes is a new generation of it)
yields each recipe's entry as the workspace makes it once the recipe's build is over: every node it built, and its
verify node only where the verify passed.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from qbuild.core.errors import UserError
from qbuild.core.hashing import digest_json
from qbuild.planning.lock import (Lock, ModelEntry, NodeEntry, Output, RecipeEntry, combined, first_difference,
                                  first_inconsistency, merge, parse)
from qbuild.store.manifest import tree_digest

NAMES = ("alpha", "beta", "gamma", "delta")


def _node(kind: str, params: dict, inputs: dict[str, str], content: str) -> NodeEntry:
    preimage = {"action": kind, "params": params, "inputs": inputs, "version": "v1"}
    outputs = {"out.bin": Output(digest=digest_json({"content": content}), size=len(content))}
    return NodeEntry(kind=kind, key=digest_json(preimage), preimage=preimage,
                     digest=tree_digest({rel: {"digest": o.digest, "size": o.size} for rel, o in outputs.items()}),
                     outputs=outputs)


def built(name: str, convert: int, generation: int, verified: bool) -> Lock:
    """The entry a build at `generation` writes for recipe `name` converting its checkpoint the `convert` way."""
    fetch = _node("fetch", {"files": "ckpt"}, {}, "snapshot")
    conv = _node("convert", {"way": convert}, {"snapshot": fetch.digest}, f"converted {convert} at {generation}")
    package = _node("package", {"recipe": name}, {"converted": conv.digest}, f"bundle {name} {convert} {generation}")
    nodes = {"fetch": ("f", fetch), "convert": (f"c{convert}", conv), "package": (f"p-{name}", package)}
    if verified:
        nodes["verify"] = (f"v-{name}", _node("verify", {}, {"bundle": package.digest}, f"report {name}"))
    entry = RecipeEntry(recipe=f"recipes/{name}.yaml", model=ModelEntry(source="path", revision=None, files={}),
                        nodes={role: nid for role, (nid, _) in nodes.items()}, bundle=package.digest,
                        verified=verified, verify_failure=None if verified else "top-1 agreement 0.5 < 0.99")
    return Lock(recipes={name: entry}, nodes={nid: node for nid, node in nodes.values()})


# One build: which recipes it finished, how each converts, and whether each verify passed.
builds = st.lists(st.tuples(st.sampled_from(NAMES), st.integers(0, 1), st.booleans()), min_size=1, max_size=4,
                  unique_by=lambda t: t[0])
# A history: builds one after another, each at a generation of its own or an earlier one's.
histories = st.lists(st.tuples(builds, st.integers(0, 2)), min_size=1, max_size=5)


def written(build, generation: int) -> Lock:
    return combined(built(name, convert, generation, verified) for name, convert, verified in build)


def run(history) -> Lock:
    lock = Lock()
    for build, generation in history:
        lock = merge(lock, written(build, generation))
    return lock


def _resolved(lock: Lock, name: str) -> tuple[dict, dict]:
    """A recipe's entry as a reader sees it: its fields, and what each of its roles resolves to."""
    entry = lock.recipes[name]
    return entry.model_dump(exclude={"nodes"}), {role: node.model_dump() for role, node in lock.resolved(name).items()}


@settings(max_examples=300, deadline=None)
@given(histories)
def test_every_lock_a_history_of_builds_leaves_agrees_with_itself_and_reads_back_as_written(history):
    lock = run(history)
    assert first_inconsistency(lock) is None
    text = lock.dumps()
    assert parse(text.encode(), Path("artifacts.lock")) == lock
    for entry in lock.recipes.values():
        # verified exactly when the entry holds its verify node
        assert entry.verified == ("verify" in entry.nodes)
        assert entry.bundle == lock.nodes[entry.nodes["package"]].digest


@settings(max_examples=300, deadline=None)
@given(histories, st.data())
def test_merging_what_the_lock_already_holds_changes_nothing_byte_for_byte(history, data):
    lock = run(history)
    names = data.draw(st.lists(st.sampled_from(sorted(lock.recipes)), unique=True))
    again = Lock(recipes={n: lock.recipes[n] for n in names},
                 nodes={nid: lock.nodes[nid] for n in names for nid in lock.recipes[n].nodes.values()})
    assert merge(lock, again).dumps() == lock.dumps()


@settings(max_examples=300, deadline=None)
@given(histories, builds, st.integers(0, 3))
def test_writing_some_recipes_never_drops_or_changes_another_recipes_entry(history, build, generation):
    lock = run(history)
    new = written(build, generation)
    merged = merge(lock, new)
    assert first_inconsistency(merged) is None
    for name in set(lock.recipes) - set(new.recipes):
        assert _resolved(merged, name) == _resolved(lock, name)
    for name in new.recipes:
        assert _resolved(merged, name) == _resolved(new, name)
    assert set(merged.recipes) == set(lock.recipes) | set(new.recipes)


@settings(max_examples=200, deadline=None)
@given(histories, builds, st.integers(0, 3), st.randoms(use_true_random=False))
def test_the_lock_does_not_depend_on_the_order_recipes_finish_or_are_named(history, build, generation, rnd):
    """One build's recipes, finished (and so written) in any order, merged one at a time or all at once, and the
    same recipes built again in another command: one lock."""
    lock = run(history)
    entries = [built(name, convert, generation, verified) for name, convert, verified in build]
    at_once = merge(lock, combined(entries))
    for _ in range(3):
        shuffled = entries[:]
        rnd.shuffle(shuffled)
        one_by_one = lock
        for entry in shuffled:
            one_by_one = merge(one_by_one, entry)
        assert one_by_one.dumps() == at_once.dumps()
        assert merge(lock, combined(shuffled)).dumps() == at_once.dumps()
    assert merge(at_once, combined(entries)).dumps() == at_once.dumps()


def test_two_recipes_that_share_every_step_lock_the_same_whichever_is_built_first():
    """A copy of a recipe under another name plans the same steps: which of the two was built last must not show."""
    twin = lambda name: built(name, 0, 0, True)     # noqa: E731
    ab = merge(merge(Lock(), twin("alpha")), twin("beta"))
    ba = merge(merge(Lock(), twin("beta")), twin("alpha"))
    assert ab.dumps() == ba.dumps() == merge(Lock(), combined([twin("beta"), twin("alpha")])).dumps()


def test_a_shared_step_built_again_stays_locked_apart_for_the_recipe_built_from_the_old_one():
    before = merge(Lock(), combined([built("alpha", 0, 0, True), built("beta", 0, 0, True)]))
    after = merge(before, built("alpha", 0, 1, True))
    kept = after.recipes["beta"].nodes["convert"]
    assert kept == f"c0@{before.nodes['c0'].digest[:12]}" and after.nodes[kept] == before.nodes["c0"]
    assert after.nodes["c0"] == built("alpha", 0, 1, True).nodes["c0"]
    # Building beta again puts it back on the shared id, and the kept copy goes.
    again = merge(after, built("beta", 0, 1, True))
    assert not any("@" in nid for nid in again.nodes) and first_inconsistency(again) is None


def test_first_difference_names_the_entry_and_field_that_would_change():
    lock = merge(Lock(), combined([built("alpha", 0, 0, True), built("beta", 1, 0, True)]))
    assert first_difference(lock, lock) is None
    failed = merge(lock, built("beta", 1, 0, False))
    assert first_difference(lock, failed) == "recipes.beta.nodes.verify: removed"
    assert first_difference(lock, merge(lock, built("alpha", 0, 0, True))) is None
    rebuilt = merge(lock, built("alpha", 0, 1, True))
    old, new = lock.recipes["alpha"].bundle, rebuilt.recipes["alpha"].bundle
    assert first_difference(lock, rebuilt) == f"recipes.alpha.bundle: {old[:16]}... -> {new[:16]}..."


# --- reading a file ------------------------------------------------------------------------------------------------

def _file(lock: Lock) -> dict:
    return json.loads(lock.dumps())


def _parse(doc: dict) -> Lock:
    return parse(json.dumps(doc).encode(), Path("artifacts.lock"))


def test_a_version_1_lockfile_reads_as_the_same_lock_without_display_names():
    lock = merge(Lock(), combined([built("alpha", 0, 0, True), built("beta", 0, 0, False)]))
    v1 = _file(lock)
    v1["version"] = 1
    for nid, node in v1["nodes"].items():
        node["name"] = f"{node['kind']} {nid}"
    v1["recipes"]["gamma"] = {"recipe": "recipes/gamma.yaml", "model": {"source": "path", "revision": None,
                                                                        "files": {}},
                              "nodes": {"fetch": "f"}, "bundle": None, "verified": False}
    read = _parse(v1)
    assert read.nodes == lock.nodes and read.recipes["alpha"] == lock.recipes["alpha"]
    # An entry an older qbuild left without a bundle is kept as what it is: a recipe with no build locked.
    assert read.recipes["gamma"].nodes == {} and read.recipes["gamma"].bundle is None
    assert json.loads(read.dumps())["version"] == 2


INCONSISTENT = {
    "verified without its verify node": (lambda d: d["recipes"]["alpha"]["nodes"].pop("verify"),
                                         "$.recipes.alpha.verified: true, but the entry has no verify node"),
    "a verify node on an unverified entry": (lambda d: d["recipes"]["alpha"].update(verified=False),
                                             "$.recipes.alpha.verified: false, but the entry holds its verify node"),
    "steps without a bundle": (lambda d: d["recipes"]["alpha"].update(bundle=None),
                               "$.recipes.alpha.bundle: null, but the entry names the steps of a build"),
    "a display name": (lambda d: d["nodes"]["f"].update(name="fetch ckpt"), "$.nodes.f.name: unknown field"),
    "an unknown model source": (lambda d: d["recipes"]["alpha"]["model"].update(source="s3"),
                                "$.recipes.alpha.model.source: "),
    "an input that is not a digest": (lambda d: d["nodes"]["p-alpha"]["preimage"]["inputs"].update(converted=5),
                                      "$.nodes.p-alpha.preimage: inputs: expected an object of digests"),
}


@pytest.mark.parametrize("case", sorted(INCONSISTENT))
def test_a_lockfile_that_disagrees_with_itself_is_refused_in_one_line(case):
    edit, needle = INCONSISTENT[case]
    doc = _file(merge(Lock(), built("alpha", 0, 0, True)))
    edit(doc)
    with pytest.raises(UserError) as err:
        _parse(doc)
    assert str(err.value).startswith(f"artifacts.lock: {needle}"), str(err.value)
    assert "\n" not in str(err.value)


def test_no_lock_that_disagrees_with_itself_is_ever_written():
    lock = merge(Lock(), built("alpha", 0, 0, True))
    bad = lock.model_copy(update={"recipes": {"alpha": lock.recipes["alpha"].model_copy(update={"verified": False})}})
    with pytest.raises(AssertionError, match="disagrees with itself"):
        bad.dumps()


@pytest.mark.parametrize("order", list(itertools.permutations(["alpha", "beta", "gamma"])))
def test_combined_entries_do_not_depend_on_their_order(order):
    entries = {n: built(n, i % 2, 0, True) for i, n in enumerate(["alpha", "beta", "gamma"])}
    assert combined(entries[n] for n in order).dumps() == combined(entries.values()).dumps()
