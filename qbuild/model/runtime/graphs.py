"""A CPU bundle's compiled graphs: each one's call signature (written beside it by its compile, qbuild.backends.cpu)
and its callable, loaded on first use."""

from __future__ import annotations

import json
from pathlib import Path

from qbuild.core.errors import UserError


class Graphs:
    def __init__(self, root: Path, manifest: dict):
        self.root, self.manifest = Path(root), manifest
        self._loaded: dict[str, object] = {}
        self._signatures: dict[str, dict] = {}

    def signature(self, name: str) -> dict:
        if name not in self._signatures:
            self._signatures[name] = json.loads((self.root / "graphs" / f"{name}.json").read_text())
        return self._signatures[name]

    def get(self, name: str):
        """The callable (weights, *args) -> outputs of graph `name`."""
        if name not in self._loaded:
            self._loaded[name] = load_graph(self.root / self.manifest["graphs"][name], self.signature(name)["format"])
        return self._loaded[name]


def load_graph(path: Path, file_format: str):
    """A callable (weights, *args) -> outputs of a compiled graph file: an AOTInductor package or an exported
    program."""
    import torch

    if file_format == "aoti-package":
        return torch._inductor.aoti_load_package(str(path))
    if file_format == "exported-program":
        from qbuild.model.runtime import exported

        return exported.load(str(path)).module()
    raise UserError(f"{path}: unknown graph format {file_format!r}")
