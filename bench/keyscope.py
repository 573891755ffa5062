"""Which step kinds an edit of each qbuild module re-keys.

    python bench/keyscope.py [--recipes recipes/tiny/*.yaml recipes/*.yaml] [--json]

For every module under qbuild/, a copy of the package gets one no-op statement appended to that module, and the code
hash of every (step kind, code) pair the recipes plan is computed again (qbuild.planning.keys.code_hash over the
copy): the pairs whose hash moved are the step kinds an edit of that module re-keys, on every machine that upgrades
qbuild to it. Prints one line per module; tests/test_keyscope.py holds the table to the rules the keys follow.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def planned_pairs(recipes: list[Path]) -> dict[str, tuple]:
    """label -> (step, code) of every distinct node kind the recipes plan, offline: "compile export",
    "shard nxd-moe qwen3_next", "verify neuron", "fetch"."""
    from qbuild import backends
    from qbuild.core.hashing import StatCache
    from qbuild.planning.drift import OfflineEnvironment
    from qbuild.planning.environment import HostEnvironment
    from qbuild.planning.plan import build_plan
    from qbuild.recipe.schema import load_recipe
    from qbuild.steps.registry import STEPS

    pairs: dict[str, tuple] = {}
    with tempfile.TemporaryDirectory() as tmp:
        env = OfflineEnvironment(HostEnvironment(StatCache(Path(tmp) / "stat.db")))
        for recipe in recipes:
            plan = build_plan([load_recipe(recipe)], env, backends=backends, steps=STEPS)
            for node in plan.nodes.values():
                pairs.setdefault(label(node), (node.step, node.code))
    return dict(sorted(pairs.items()))


def label(node) -> str:
    """A node's step kind, with the backend or shard layout whose code it runs, and the model family whose
    conversion rules it runs: "compile export", "shard nxd-moe qwen3_next", "convert qwen3_5"."""
    from qbuild.model.families import FAMILIES

    rules = {family.rule_modules(): name for name, family in FAMILIES.items()}
    family = next((name for modules, name in rules.items() if set(modules) <= set(node.code)), None)
    words = [node.kind, node.params.layout if node.kind == "shard" else node.backend, family]
    return " ".join(w for w in words if w)


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = path
    return out


def table(pairs: dict[str, tuple]) -> dict[str, list[str]]:
    """module -> the labels of `pairs` a no-op code edit of it re-keys."""
    from qbuild.planning.closures import Sources
    from qbuild.planning.keys import code_hash

    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "qbuild"
        shutil.copytree(REPO / "qbuild", tree, ignore=shutil.ignore_patterns("__pycache__"))
        facts: dict = {}

        def hashes() -> dict[str, str]:
            sources = Sources({"qbuild": tree}, _facts=facts)
            return {name: code_hash(step, code, sources) for name, (step, code) in pairs.items()}

        before = hashes()
        out = {}
        for name, path in modules(tree).items():
            original = path.read_text()
            try:
                path.write_text(original + "\n_keyscope_probe = None\n")
                after = hashes()
            finally:
                path.write_text(original)
            out[name] = [label for label in pairs if after[label] != before[label]]
        return out


def default_recipes(root: Path, checkpoints: dict[str, Path] | None = None) -> list[Path]:
    """The tiny and shipped recipes. The tiny ones name checkpoints under .qbuild/tiny, which `make demo` makes: they
    are copied under `root`, whose .qbuild/tiny holds `checkpoints` (family -> directory), or tiny checkpoints made
    there, so that a fresh clone plans them."""
    from qbuild.model.families import FAMILIES
    from qbuild.model.tinymodel import install_tiny_checkpoint

    for folder in ("tiny", "bases"):
        shutil.copytree(REPO / "recipes" / folder, root / "recipes" / folder)
    (root / ".qbuild" / "tiny").mkdir(parents=True)
    for family in FAMILIES:
        where = root / ".qbuild" / "tiny" / family
        if checkpoints is not None:
            where.symlink_to(checkpoints[family])
        else:
            install_tiny_checkpoint(where, family)
    return sorted((root / "recipes" / "tiny").glob("*.yaml")) + sorted((REPO / "recipes").glob("*.yaml"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="*", default=None, help="recipes to plan (default: the tiny and shipped ones)")
    ap.add_argument("--json", action="store_true", help="the table as JSON")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        recipes = [Path(r) for r in args.recipes] if args.recipes else default_recipes(Path(tmp))
        rekeyed = table(planned_pairs(recipes))
    if args.json:
        print(json.dumps(rekeyed, indent=1))
        return
    width = max(map(len, rekeyed))
    for module, labels in rekeyed.items():
        print(f"{module:{width}s}  {', '.join(labels) or '-'}")


if __name__ == "__main__":
    main()
