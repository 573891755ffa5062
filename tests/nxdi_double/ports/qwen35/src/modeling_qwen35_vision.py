"""Fake of the main-lineage port's src/modeling_qwen35_vision.py (Qwen3.5-35B-A3B @ 4bcdc54): CPUVisionModel, the module
compile_vision_encoder.py traces with the real weights (docs/nxdi.md section 5).

`CPUVisionModel(config)` takes the vision config only (no weights) and has exactly the parameter names the port's
load_cpu_model fills: blocks.{i}.{norm1,norm2,attn.qkv,attn.proj,mlp.linear_fc1,mlp.linear_fc2}.{weight,bias},
merger_norm, merger_fc1, merger_fc2; the patch and position embeddings run on the host and are not part of it.
`forward(hidden_states, attention_mask, cos, sin)` with hidden (S, hidden), mask (1, 1, S, S), cos/sin (S, head_dim).
The shapes are those of the HF vision encoder the port loads from (LayerNorms with bias, qkv fused, the 2x2 merger);
the arithmetic is a plain ViT block, enough for torch.jit.trace, not a numerical copy of the port.
"""

from __future__ import annotations

import torch
from torch import nn


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x, mask, cos, sin):
        s, hidden = x.shape
        q, k, v = self.qkv(x).reshape(s, 3, self.heads, hidden // self.heads).permute(1, 2, 0, 3)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        scores = q @ k.transpose(-1, -2) / (hidden // self.heads) ** 0.5 + mask[0]
        out = torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v
        return self.proj(out.transpose(0, 1).reshape(s, hidden))


class _MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, intermediate)
        self.linear_fc2 = nn.Linear(intermediate, hidden)

    def forward(self, x):
        return self.linear_fc2(nn.functional.gelu(self.linear_fc1(x), approximate="tanh"))


class _Block(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, eps=1e-6)
        self.norm2 = nn.LayerNorm(hidden, eps=1e-6)
        self.attn = _Attention(hidden, heads)
        self.mlp = _MLP(hidden, intermediate)

    def forward(self, x, mask, cos, sin):
        x = x + self.attn(self.norm1(x), mask, cos, sin)
        return x + self.mlp(self.norm2(x))


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class CPUVisionModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden, merge = config.hidden_size, config.spatial_merge_size
        self.merged = hidden * merge * merge
        self.blocks = nn.ModuleList(_Block(hidden, config.num_heads, config.intermediate_size)
                                    for _ in range(config.depth))
        self.merger_norm = nn.LayerNorm(hidden, eps=1e-6)
        self.merger_fc1 = nn.Linear(self.merged, self.merged)
        self.merger_fc2 = nn.Linear(self.merged, config.out_hidden_size)

    def forward(self, hidden_states, attention_mask, cos, sin):
        x = hidden_states
        for block in self.blocks:
            x = block(x, attention_mask, cos, sin)
        x = self.merger_norm(x).reshape(-1, self.merged)
        return self.merger_fc2(nn.functional.gelu(self.merger_fc1(x)))
