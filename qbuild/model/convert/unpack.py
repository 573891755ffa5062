"""A rank of the "cpu" shard layout (qbuild.model.convert.shard) read back as qbuild's reference model holds it:
each FP8 weight dequantized with the `.scale` beside it, a fused Wqkv split into q/k/v_proj. Apart from the shard
writer, so that the code a model's key holds is what reads a rank, not what writes one."""

from __future__ import annotations

from typing import Mapping

import torch

from qbuild.model.arch import Arch
from qbuild.model.convert import attention, fp8


def _is_fp8(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.element_size() == 1


def unpack_rank(rank: int, shard: Mapping[str, torch.Tensor], arch: Arch, tp: int) -> dict[str, torch.Tensor]:
    """One rank's "cpu"-layout tensors as qbuild's reference model holds them: each FP8 weight dequantized with the
    `.scale` beside it, a fused `self_attn.Wqkv.weight` split back into q/k/v_proj. ValueError naming the tensor for
    a scale without its FP8 weight, an FP8 weight without its scale, or a Wqkv of the wrong size."""
    rank_arch = arch.per_rank(tp)
    q_rows, kv_rows = rank_arch.num_heads * arch.head_dim, rank_arch.kv_dim
    out: dict[str, torch.Tensor] = {}
    for name, tensor in shard.items():
        if name.endswith(".scale"):
            weight = name.removesuffix(".scale") + ".weight"
            if weight not in shard or not _is_fp8(shard[weight]):
                raise ValueError(f"rank {rank}: {name} has no FP8 weight {weight} beside it")
            continue
        if _is_fp8(tensor):
            scale = fp8.scale_name(name)
            if scale not in shard:
                raise ValueError(f"rank {rank}: FP8 tensor {name} has no {scale} beside it")
            tensor = fp8.dequantize(tensor, shard[scale])
        if name.endswith("self_attn.Wqkv.weight"):
            if tensor.shape[0] != q_rows + 2 * kv_rows:
                raise ValueError(f"rank {rank}: {name} has {tensor.shape[0]} rows, expected {q_rows + 2 * kv_rows}")
            prefix = name.removesuffix("Wqkv.weight")
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), attention.split_qkv(tensor, q_rows, kv_rows)):
                out[f"{prefix}{part}.weight"] = rows
            continue
        out[name] = tensor
    return out
