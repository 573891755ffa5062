"""Start-up instrumentation for the tests that watch the CLI and its workers from inside.

A test puts this directory first on PYTHONPATH; Python then imports this file at start-up in the CLI and in every
worker the CLI starts, before any other module, and it installs what the environment asks for:
QBUILD_PICKLE_AUDIT (tests/pickle_audit.py), QBUILD_CRASH_AT (tests/crash_points.py) and QBUILD_SERVE_POINTS
(tests/serve_points.py). Without them it does nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Callable


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls `callback(module)` once `name` has run, before any importer sees the module."""

    def __init__(self, name: str, callback: Callable):
        self.name, self.callback = name, callback

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_call(module):
            exec_module(module)
            self.callback(module)

        spec.loader.exec_module = exec_then_call
        return spec


def after_import(name: str, callback: Callable) -> None:
    sys.meta_path.insert(0, _AfterImport(name, callback))


if os.environ.get("QBUILD_PICKLE_AUDIT"):
    from tests import pickle_audit

    pickle_audit.install(os.environ["QBUILD_PICKLE_AUDIT"], after_import)
if os.environ.get("QBUILD_CRASH_AT"):
    from tests import crash_points

    crash_points.install(os.environ["QBUILD_CRASH_AT"], os.environ["QBUILD_CRASH_MARKER"], after_import)
if os.environ.get("QBUILD_SERVE_POINTS"):
    from tests import serve_points

    serve_points.install(os.environ["QBUILD_SERVE_POINTS"], after_import)
