"""Records every unpickling in a process, for tests/test_pickle_ban.py (installed by tests/startup/sitecustomize.py).

Each unpickling appends one JSON line to the log: which loader ran, whether it was torch's weights-only unpickler,
what it read (a file path or in-memory bytes) and the call stack, so the test can decide what was allowed. Nothing
here changes what the loaders return.
"""

from __future__ import annotations

import json
import os
import sys

# Frames of the loaders themselves (and of this instrumentation) are left out of a recorded stack: what matters is
# who called them.
_LOADER_MODULES = ("sitecustomize", __name__, "pickle", "_pickle", "copyreg", "torch.serialization",
                   "torch._weights_only_unpickler")


def _stack() -> list[str]:
    frames, f = [], sys._getframe(2)
    while f is not None:
        module = f.f_globals.get("__name__", "?")
        if module not in _LOADER_MODULES:
            frames.append(f"{module}:{f.f_code.co_name}")
        f = f.f_back
    return frames


def _source(f) -> str:
    if isinstance(f, (str, os.PathLike)):
        return f"file:{os.fspath(f)}"
    name = getattr(f, "name", None)
    return f"file:{name}" if isinstance(name, str) else "bytes"


def install(log: str, after_import) -> None:
    def record(api: str, source: str, weights_only: bool = False, detail: str = "") -> None:
        line = json.dumps({"pid": os.getpid(), "api": api, "source": source, "weights_only": weights_only,
                           "detail": detail, "stack": _stack()})
        with open(log, "a") as out:
            out.write(line + "\n")

    _wrap_pickle(record)
    sys.addaudithook(lambda event, args: _on_audit(record, event, args))
    after_import("torch.serialization", lambda module: _wrap_torch_load(record, module))


def _wrap_pickle(record) -> None:
    import pickle

    loads, load, unpickler = pickle.loads, pickle.load, pickle.Unpickler

    def audited_loads(data, /, **kwargs):
        record("pickle.loads", "bytes")
        return loads(data, **kwargs)

    def audited_load(file, **kwargs):
        record("pickle.load", _source(file))
        return load(file, **kwargs)

    class AuditedUnpickler(unpickler):
        def __init__(self, file, *args, **kwargs):
            self._audit_source = _source(file)
            super().__init__(file, *args, **kwargs)

        def load(self):
            record("pickle.Unpickler.load", self._audit_source)
            return super().load()

    pickle.loads, pickle.load, pickle.Unpickler = audited_loads, audited_load, AuditedUnpickler


def _on_audit(record, event: str, args: tuple) -> None:
    # Any full unpickler resolving a global, including C code that holds the original _pickle functions.
    if event == "pickle.find_class":
        record("pickle.find_class", "?", detail=f"{args[0]}.{args[1]}")


def _wrap_torch_load(record, module) -> None:
    """torch.serialization.load, wrapped before `torch` re-exports it as torch.load."""
    original = module.load

    def audited_torch_load(f, *args, **kwargs):
        weights_only = kwargs.get("weights_only")
        if weights_only is None:   # torch's default: weights-only unless the environment forces it off
            weights_only = os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0") in ("0", "")
        record("torch.load", _source(f), weights_only=bool(weights_only))
        return original(f, *args, **kwargs)

    module.load = audited_torch_load
