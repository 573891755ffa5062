"""The one way qbuild writes JSON: strict, so NaN and Infinity (which are not JSON) never reach a file or stdout.

Python's json module writes `NaN` and `Infinity` by default, and other parsers reject the result; a report that says
`"max_logit_err": NaN` also hides a broken model behind a document nobody can read. Every lockfile, manifest,
report, bundle.json and --json output goes through `dumps`, which refuses them in values and in keys, naming where.
"""

from __future__ import annotations

import json
import math



def dumps(obj: object, *, indent: int | None = None, sort_keys: bool = False, compact: bool = False,
          ensure_ascii: bool = True) -> str:
    """json.dumps with allow_nan=False; `compact` drops the spaces after separators."""
    try:
        return json.dumps(obj, allow_nan=False, indent=indent, sort_keys=sort_keys, ensure_ascii=ensure_ascii,
                          separators=(",", ":") if compact else None)
    except ValueError:
        where = _non_finite_path(obj, "$")
        if where is None:
            raise
        raise ValueError(f"refusing to write a non-finite number as JSON at {where}") from None


def _non_finite_path(obj: object, path: str) -> str | None:
    """The JSON path of the first NaN or infinity in `obj` (a value or a key), or None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return f"{path} ({obj})"
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(k, float) and not math.isfinite(k):
                return f"{path} (key {k})"
            found = _non_finite_path(v, f"{path}.{k}")
            if found:
                return found
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            found = _non_finite_path(v, f"{path}[{i}]")
            if found:
                return found
    return None
