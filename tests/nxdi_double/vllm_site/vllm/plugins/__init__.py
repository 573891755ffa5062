"""vllm/plugins/__init__.py @ vLLM 0.16.0: the entry points of a group among every distribution on sys.path, keeping
only the names VLLM_PLUGINS lists when it is set (L28-65); general plugins are called once per process (L68-81). A
plugin that fails to load is logged and skipped there (L59-63); the double raises, so a broken plugin fails the test."""

from __future__ import annotations

import os
from importlib.metadata import entry_points

_loaded = False


def load_plugins_by_group(group: str) -> dict:
    allowed = os.environ.get("VLLM_PLUGINS")
    allowed = None if allowed is None else allowed.split(",")
    return {ep.name: ep.load() for ep in entry_points(group=group) if allowed is None or ep.name in allowed}


def load_general_plugins() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for func in load_plugins_by_group("vllm.general_plugins").values():
        func()


def load_platform():
    """The platform plugin that answers (vllm/platforms/__init__.py resolves the platform plugins the same way)."""
    import importlib

    for name, func in load_plugins_by_group("vllm.platform_plugins").items():
        path = func()
        if path:
            module, cls = path.rsplit(".", 1)
            return getattr(importlib.import_module(module), cls)
    raise RuntimeError("no platform plugin answered (VLLM_PLUGINS must list 'neuron')")
