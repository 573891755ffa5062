"""What a lockfile must be before any command acts on it: its shape (one pydantic schema of the whole document) and
its consistency (each recipe entry against its own nodes). `qbuild.store.lock.read` runs both, so every command that
reads a lockfile (compile, plan, pull, run, serve, publish, gc, lock check) refuses the same documents, in one line
naming the lockfile and the JSON path of what is wrong.

Consistency, per recipe entry: every node id it names is in `nodes` and is a node of its role's kind; every node's
key is the digest of its preimage and its digest the tree digest of its outputs; each input a node's preimage names
is the output of a node of the same recipe (so the entry holds every step its bundle was built from, and none of
another recipe's); a named bundle is its package node's output; a verified bundle has a verify node that took that
bundle; a port entry is its port node's. A lockfile that passes names, for each recipe, one bundle and the steps
that made it: what `pull` lays out is what was built, verified, for that recipe.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, StrictBool, StrictInt, StrictStr, TypeAdapter, ValidationError, with_config
from typing_extensions import NotRequired, TypedDict

from qbuild.core.errors import UserError
from qbuild.core.hashing import digest_json
from qbuild.core.urls import carries_credentials
from qbuild.store.manifest import tree_digest

# TypedDicts under one TypeAdapter, built on first use: the document stays the plain dict every reader indexes, and
# the schema costs planning about half of what the same models as BaseModel classes cost at import.
Digest = Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{64}$")]      # blake3, hex
Name = Annotated[StrictStr, Field(min_length=1)]
_STRICT = ConfigDict(extra="forbid", strict=True)


@with_config(_STRICT)
class _Output(TypedDict):
    digest: Digest
    size: Annotated[StrictInt, Field(ge=0)]


@with_config(ConfigDict(extra="allow", strict=True))
class _Preimage(TypedDict):
    """Only what consistency reads; the rest of a preimage is whatever its action keyed."""

    inputs: NotRequired[dict[str, Digest]]


@with_config(_STRICT)
class _Node(TypedDict):
    kind: Name
    name: StrictStr
    key: Digest
    preimage: _Preimage
    digest: Digest
    outputs: dict[Name, _Output]


@with_config(_STRICT)
class _Model(TypedDict):
    source: StrictStr                        # "path" or "hf" (readers act on "hf" only)
    revision: StrictStr | None
    files: dict[Name, Name]                  # "blake3:<hex>" of a local file; a Hub file's own ("git-sha1:...")
    repo: NotRequired[StrictStr]             # hf only
    requested: NotRequired[StrictStr]        # hf only


@with_config(_STRICT)
class _Port(TypedDict):
    url: NotRequired[StrictStr]              # a git port's url, rev and subdir
    rev: NotRequired[StrictStr]
    subdir: NotRequired[StrictStr]
    digest: Digest


@with_config(_STRICT)
class _Recipe(TypedDict):
    recipe: Name
    model: _Model
    nodes: dict[Name, Name]                  # role -> node id
    bundle: Digest | None
    verified: StrictBool
    verify_failure: NotRequired[StrictStr]
    port: NotRequired[_Port]


@with_config(_STRICT)
class _Lock(TypedDict):
    version: Literal[1]
    recipes: dict[Name, _Recipe]
    nodes: dict[Name, _Node]


@cache
def _schema() -> TypeAdapter:
    return TypeAdapter(_Lock)


def validate(doc: dict, path) -> None:
    """Refuse, in one UserError line naming `path` and a JSON path, a lock document of the wrong shape or whose
    entries do not agree with their nodes. `doc` is the parsed JSON, left as it is."""
    try:
        _schema().validate_python(doc)
    except ValidationError as e:
        err = e.errors()[0]
        raise UserError(f"{path}: {json_path(err['loc'])}: {_message(err)}; not a lockfile qbuild writes: fix it, "
                        "or delete it and run `qbuild compile`") from None
    problem = first_inconsistency(doc)
    if problem is not None:
        raise UserError(f"{path}: {problem}; the lockfile disagrees with itself: restore it from version control, or "
                        "delete the recipe's entry and run `qbuild compile`")


def json_path(loc) -> str:
    """A pydantic error location as a JSON path: $.recipes.alpha.nodes["compile cte-32"]."""
    out = "$"
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[\w-]+", part):
            out += f".{part}"
        else:
            out += "[" + _quoted(part) + "]"
    return out


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


_EXPECTED = {"dict_type": "expected an object", "string_type": "expected a string",
             "int_type": "expected an integer", "bool_type": "expected true or false", "literal_error": "expected 1",
             "greater_than_equal": "expected a size (0 or more)", "string_too_short": "expected a non-empty string"}


def _message(err: dict) -> str:
    if err["type"] == "extra_forbidden":
        return "unknown field"
    if err["type"] == "missing":
        return "missing"
    if err["type"] == "string_pattern_mismatch":
        expected = f"expected a string matching {err['ctx']['pattern']}"
    else:
        expected = _EXPECTED.get(err["type"], err["msg"])
    got = err.get("input")
    shown = "null" if got is None else "true" if got is True else "false" if got is False else \
        "a list" if isinstance(got, list) else "an object" if isinstance(got, dict) else repr(got)[:40]
    return f"{expected}, got {shown}"


# --- consistency -------------------------------------------------------------------------------------------------

def first_inconsistency(doc: dict) -> str | None:
    """The first way the (well-formed) document disagrees with itself, as a line starting with a JSON path: the
    nodes first, then each recipe entry in name order. None where it agrees."""
    for nid, node in sorted(doc["nodes"].items()):
        problem = _node_problem(json_path(("nodes", nid)), node)
        if problem:
            return problem
    for name, entry in sorted(doc["recipes"].items()):
        problem = entry_problem(doc, name, entry)
        if problem:
            return problem
    return None


def _node_problem(where: str, node: dict) -> str | None:
    if digest_json(node["preimage"]) != node["key"]:
        return f"{where}.key: is not the digest of the node's preimage"
    if tree_digest(node["outputs"]) != node["digest"]:
        return f"{where}.digest: is not the tree digest of the node's outputs"
    params = node["preimage"].get("params")
    if isinstance(params, dict) and isinstance(params.get("url"), str) and carries_credentials(params["url"]):
        return f"{where}.preimage.params.url: carries credentials, which no lockfile may hold"
    return None


def entry_problem(doc: dict, name: str, entry: dict) -> str | None:
    """The first way one recipe entry disagrees with the document's nodes, as a line starting with a JSON path; None
    where it agrees."""
    nodes = {}
    for role, nid in sorted(entry["nodes"].items()):
        node = doc["nodes"].get(nid)
        if node is None:
            return f"{json_path(('recipes', name, 'nodes', role))}: node {nid} is not in $.nodes"
        if node["kind"] != role.split(" ", 1)[0]:
            return f"{json_path(('recipes', name, 'nodes', role))}: node {nid} is a {node['kind']} node"
        nodes[role] = node
    problem = _bundle_problem(json_path(("recipes", name)), entry, nodes)
    if problem:
        return problem
    outputs = {node["digest"] for node in nodes.values()}
    for role, node in sorted(nodes.items()):
        for input_name, digest in sorted(node["preimage"].get("inputs", {}).items()):
            if digest not in outputs:
                return (f"{json_path(('recipes', name, 'nodes', role))}: its input {input_name} ({digest[:16]}) is "
                        f"the output of none of {name}'s nodes")
    return None


def _bundle_problem(where: str, entry: dict, nodes: dict[str, dict]) -> str | None:
    bundle, package, verify = entry["bundle"], nodes.get("package"), nodes.get("verify")
    if bundle is not None and package is None:
        return f"{where}.bundle: names a bundle, but the entry has no package node"
    if bundle is not None and package["digest"] != bundle:
        return (f"{where}.bundle: {bundle[:16]} is not the output of its package node ({package['name']}: "
                f"{package['digest'][:16]})")
    if entry["verified"] and (bundle is None or verify is None):
        return f"{where}.verified: true, but the entry has {'no bundle' if bundle is None else 'no verify node'}"
    if verify is not None and bundle is not None and bundle not in verify["preimage"].get("inputs", {}).values():
        return f"{where}.nodes.verify: {verify['name']} did not verify the bundle {bundle[:16]}"
    port = entry.get("port")
    if port is not None:
        return _port_problem(where, port, nodes.get("port"))
    return None


def _port_problem(where: str, port: dict, node: dict | None) -> str | None:
    if node is None or node["digest"] != port["digest"]:
        return f"{where}.port.digest: is not the output of the entry's port node"
    if port.get("url") is not None and carries_credentials(port["url"]):
        return f"{where}.port.url: carries credentials, which no lockfile may hold"
    params = node["preimage"].get("params")
    params = params if isinstance(params, dict) else {}
    if any(port.get(k) != params.get(k) for k in ("url", "rev", "subdir")):
        return f"{where}.port: url, rev and subdir are not its port node's"
    return None
