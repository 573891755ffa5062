"""Domain errors of the convert and shard steps: one line, naming the file (and tensor) at fault."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint (or converted directory) that cannot be converted: missing, malformed or inconsistent.

    The message is one line and starts with the file it is about, e.g.
    ``model-00002-of-00004.safetensors: tensor 'model.norm.weight' has shape (63,), expected (64,)``.
    """

    def __init__(self, file: str, message: str, tensor: str | None = None):
        self.file = file
        self.tensor = tensor
        super().__init__(f"{file}: tensor {tensor!r} {message}" if tensor else f"{file}: {message}")


class ShardError(ValueError):
    """A parallel layout (tp, ep, padding) the model's dimensions cannot be split into."""
