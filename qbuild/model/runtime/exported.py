"""Loading an exported program (torch.export's .pt2) with its type hints read once per class.

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
