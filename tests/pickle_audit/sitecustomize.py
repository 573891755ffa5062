"""Records every unpickling in a process and its children, for tests/test_pickle_ban.py.

A directory holding this file is put first on PYTHONPATH with QBUILD_PICKLE_AUDIT naming a log file; Python then
imports it at start-up, in the CLI and in every worker it starts, before any other module. Each unpickling appends
one JSON line: which loader ran, whether it was torch's weights-only unpickler, what it read (a file path or
in-memory bytes) and the call stack, so the test can decide what was allowed. Nothing here changes what the loaders
return.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys

_LOG = os.environ.get("QBUILD_PICKLE_AUDIT")

# Frames of the loaders themselves (and of this file) are left out of a recorded stack: what matters is who called.
_LOADER_MODULES = ("sitecustomize", "pickle", "_pickle", "copyreg", "torch.serialization",
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


def _record(api: str, source: str, weights_only: bool = False, detail: str = "") -> None:
    line = json.dumps({"pid": os.getpid(), "api": api, "source": source, "weights_only": weights_only,
                       "detail": detail, "stack": _stack()})
    with open(_LOG, "a") as out:
        out.write(line + "\n")


def _install_pickle_wrappers() -> None:
    import pickle

    loads, load, unpickler = pickle.loads, pickle.load, pickle.Unpickler

    def audited_loads(data, /, **kwargs):
        _record("pickle.loads", "bytes")
        return loads(data, **kwargs)

    def audited_load(file, **kwargs):
        _record("pickle.load", _source(file))
        return load(file, **kwargs)

    class AuditedUnpickler(unpickler):
        def __init__(self, file, *args, **kwargs):
            self._audit_source = _source(file)
            super().__init__(file, *args, **kwargs)

        def load(self):
            _record("pickle.Unpickler.load", self._audit_source)
            return super().load()

    pickle.loads, pickle.load, pickle.Unpickler = audited_loads, audited_load, AuditedUnpickler


def _audit_hook(event: str, args: tuple) -> None:
    # Any full unpickler resolving a global, including C code that holds the original _pickle functions.
    if event == "pickle.find_class":
        _record("pickle.find_class", "?", detail=f"{args[0]}.{args[1]}")


def _wrap_torch_load(module) -> None:
    original = module.load

    def audited_torch_load(f, *args, **kwargs):
        weights_only = kwargs.get("weights_only")
        # torch.load's default is weights_only=True unless the environment forces it off.
        if weights_only is None:
            weights_only = os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0") in ("0", "")
        _record("torch.load", _source(f), weights_only=bool(weights_only))
        return original(f, *args, **kwargs)

    module.load = audited_torch_load


class _PatchTorchSerialization(importlib.abc.MetaPathFinder):
    """Wraps torch.serialization.load as soon as the module runs, before `torch` re-exports it as torch.load."""

    def find_spec(self, name, path, target=None):
        if name != "torch.serialization":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            _wrap_torch_load(module)

        spec.loader.exec_module = exec_and_wrap
        return spec


if _LOG:
    _install_pickle_wrappers()
    sys.addaudithook(_audit_hook)
    sys.meta_path.insert(0, _PatchTorchSerialization())
