"""Contract double of NxD's ColumnParallelLinear and RowParallelLinear (parallel_layers/layers.py @ fbac349), as the
ports' TP vision encoder uses them (contrib/models/Qwen3.5-2B/src/modeling_qwen35_vision.py:120-208 @ 4bcdc54):

- ColumnParallelLinear(in, out, bias, gather_output): this rank's weight (out / size, in) and bias (out / size), both
  `partition_dim` 0 (get_sharded_checkpoint slices them on it); with gather_output the ranks' outputs are gathered.
- RowParallelLinear(in, out, bias, input_is_parallel): weight (out, in / size), `partition_dim` 1, bias (out,) whole;
  without input_is_parallel the input is split and this rank takes its slice; the partial outputs are all-reduced.
- A size that does not divide evenly fails, as NxD's `divide` asserts.

The double builds each rank's model alone (parallel_state.building), so it cannot exchange values between ranks: the
gather repeats this rank's block to the full width and the all-reduce passes the partial sum on. Shapes, names and
the slicing of the weights are NxD's; the values of a TP module traced here are not a real encoder's, which is why
qbuild proves the sharding rule's arithmetic on the CPU instead (ShardedLinear, tests/test_vision_images.py).
"""

from __future__ import annotations

import torch
from torch import nn

from neuronx_distributed.parallel_layers.parallel_state import (get_tensor_model_parallel_rank,
                                                                  get_tensor_model_parallel_size)


def _divide(total: int, parts: int) -> int:
    if total % parts:
        raise AssertionError(f"{total} is not divisible by {parts}")
    return total // parts


def _partitioned(param: nn.Parameter, dim: int) -> nn.Parameter:
    param.partition_dim = dim
    param.tensor_model_parallel = True
    return param


class ColumnParallelLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = True,
                 dtype: torch.dtype = torch.float32, **kwargs):
        super().__init__()
        if kwargs:
            raise TypeError(f"ColumnParallelLinear: the double takes no {sorted(kwargs)}")
        self.size = get_tensor_model_parallel_size()
        local = _divide(output_size, self.size)
        self.gather_output = gather_output
        self.weight = _partitioned(nn.Parameter(torch.zeros(local, input_size, dtype=dtype)), 0)
        self.bias = _partitioned(nn.Parameter(torch.zeros(local, dtype=dtype)), 0) if bias else None

    def forward(self, x):
        out = nn.functional.linear(x, self.weight, self.bias)
        return torch.cat([out] * self.size, dim=-1) if self.gather_output else out


class RowParallelLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = True, input_is_parallel: bool = False,
                 dtype: torch.dtype = torch.float32, **kwargs):
        super().__init__()
        if kwargs:
            raise TypeError(f"RowParallelLinear: the double takes no {sorted(kwargs)}")
        self.size, self.rank = get_tensor_model_parallel_size(), get_tensor_model_parallel_rank()
        self.input_is_parallel = input_is_parallel
        self.weight = _partitioned(nn.Parameter(torch.zeros(output_size, _divide(input_size, self.size),
                                                            dtype=dtype)), 1)
        self.bias = nn.Parameter(torch.zeros(output_size, dtype=dtype)) if bias else None

    def forward(self, x):
        if not self.input_is_parallel:
            x = x.chunk(self.size, dim=-1)[self.rank]
        out = nn.functional.linear(x, self.weight)
        return out + self.bias if self.bias is not None else out
