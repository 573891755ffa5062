"""Contract double of neuronx_distributed.parallel_layers.parallel_state: the tensor-parallel rank and size a model is
built for. The real state is a torch.distributed process group per rank process (trace/trace.py:186-191 @ fbac349);
the double's parallel_model_trace builds every rank in one process, one after another, and sets these for each
(`building`). Outside a trace there is no group: asking is an error, as before initialize_model_parallel."""

from __future__ import annotations

from contextlib import contextmanager

_STATE: tuple[int, int] | None = None   # (rank, size) while a rank's model is built


def get_tensor_model_parallel_rank() -> int:
    return _state()[0]


def get_tensor_model_parallel_size() -> int:
    return _state()[1]


def _state() -> tuple[int, int]:
    if _STATE is None:
        raise RuntimeError("tensor model parallel group is not initialized (the double: only inside "
                           "parallel_model_trace)")
    return _STATE


@contextmanager
def building(rank: int, size: int):
    global _STATE
    previous, _STATE = _STATE, (rank, size)
    try:
        yield
    finally:
        _STATE = previous
