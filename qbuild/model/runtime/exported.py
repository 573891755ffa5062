"""Saving and loading an exported program (torch.export's .pt2): without a self-check torch throws away, and with
its type hints read once per class.

torch 2.13's serializer calls `canonicalize(serialized_ep, ...)` on every save "to test canonical form is well
defined" and discards what it returns (torch/_export/serde/serialize.py line 2263 at v2.13.0); canonicalize starts
with a deepcopy of the whole serialized program (line 4144), which is more than half of a tiny graph's save. `save`
skips that call while it saves, where the call site still discards the result; the bytes are the same.

torch 2.13 rebuilds the program's JSON into dataclasses with `typing.get_type_hints(cls, globalns=vars(schema))`
for every object it creates (torch/_export/serde/serialize.py `_dict_to_dataclass`, lines 3739 and 3745 at
v2.13.0): about 25,000 calls for a tiny model's graph, 3.5 s of a 4 s load, all of it re-evaluating the same
string annotations. The hints of a schema class never change, so `load` gives that module a `typing` whose
`get_type_hints` remembers them per class; everything else is the real `typing`, and a torch whose serializer no
longer has this shape is loaded as it is. docs/architecture.md ("Loading exported programs") has the measurement.
"""

from __future__ import annotations

import functools
import types
import typing


class _SchemaTyping(types.ModuleType):
    """`typing`, except that the schema module's hints are read once per class."""

    def __init__(self, schema_globals: dict):
        super().__init__("typing")
        # A copy of typing's names rather than a __getattr__: the serializer looks them up some 300,000 times.
        self.__dict__.update((k, v) for k, v in vars(typing).items() if not k.startswith("__"))
        self._schema_globals = schema_globals
        self._hints = functools.cache(lambda cls: typing.get_type_hints(cls, globalns=schema_globals))
        self.get_type_hints = self._get_type_hints

    def _get_type_hints(self, obj, globalns=None, localns=None, include_extras=False):
        if globalns is self._schema_globals and localns is None and not include_extras and isinstance(obj, type):
            return self._hints(obj)
        return typing.get_type_hints(obj, globalns, localns, include_extras)


_DISCARDED_CHECK = "\n        canonicalize(serialized_ep, set(constants.keys()))\n"


@functools.cache
def _canonicalize_is_a_discarded_check() -> bool:
    """Whether torch's serializer calls canonicalize only as a check whose result it drops (see the docstring)."""
    import inspect

    try:
        from torch._export.serde import serialize
        source = inspect.getsource(serialize.ExportedProgramSerializer.serialize)
    except (ImportError, AttributeError, OSError, TypeError):
        return False
    return callable(getattr(serialize, "canonicalize", None)) and _DISCARDED_CHECK in source


def save(program, path) -> None:
    """torch.export.save(program, path), without the discarded canonical-form check where torch has it."""
    import torch

    if not _canonicalize_is_a_discarded_check():
        torch.export.save(program, path)
        return
    from torch._export.serde import serialize

    check = serialize.canonicalize
    serialize.canonicalize = lambda ep, constants=None: ep
    try:
        torch.export.save(program, path)
    finally:
        serialize.canonicalize = check


@functools.cache
def _memoize_schema_hints() -> bool:
    """Give torch's serializer the remembering `typing`; False where its shape is not the one described above."""
    try:
        from torch._export.serde import schema, serialize
    except ImportError:
        return False
    if serialize.__dict__.get("typing") is not typing or not hasattr(serialize, "_dict_to_dataclass"):
        return False
    serialize.typing = _SchemaTyping(vars(schema))
    return True


def load(path: str):
    """torch.export.load(path), the ExportedProgram."""
    import torch

    _memoize_schema_hints()
    return torch.export.load(path)
