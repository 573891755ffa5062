"""Vision encoder (nxdi-layout.md section 6): HF `model.visual.*` -> the traced encoder's names.

The blocks keep their names; the merger's modules are flattened (merger.norm -> merger_norm, merger.linear_fc1 ->
merger_fc1, merger.linear_fc2 -> merger_fc2); patch_embed.proj and pos_embed run on the host and keep their names.
No +1 anywhere: these are LayerNorms with a real weight and bias.
"""

from __future__ import annotations

from qbuild.convert.steps import Row, same


def _rows(pairs):
    """(HF suffix, NxDI suffix, shape function) triples -> renaming Rows."""
    return tuple(Row(src, shape, (dst,), same) for src, dst, shape in pairs)


BLOCK = _rows([
    ("norm1.weight", "norm1.weight", lambda v: (v.hidden,)),
    ("norm1.bias", "norm1.bias", lambda v: (v.hidden,)),
    ("norm2.weight", "norm2.weight", lambda v: (v.hidden,)),
    ("norm2.bias", "norm2.bias", lambda v: (v.hidden,)),
    ("attn.qkv.weight", "attn.qkv.weight", lambda v: (3 * v.hidden, v.hidden)),
    ("attn.qkv.bias", "attn.qkv.bias", lambda v: (3 * v.hidden,)),
    ("attn.proj.weight", "attn.proj.weight", lambda v: (v.hidden, v.hidden)),
    ("attn.proj.bias", "attn.proj.bias", lambda v: (v.hidden,)),
    ("mlp.linear_fc1.weight", "mlp.linear_fc1.weight", lambda v: (v.intermediate, v.hidden)),
    ("mlp.linear_fc1.bias", "mlp.linear_fc1.bias", lambda v: (v.intermediate,)),
    ("mlp.linear_fc2.weight", "mlp.linear_fc2.weight", lambda v: (v.hidden, v.intermediate)),
    ("mlp.linear_fc2.bias", "mlp.linear_fc2.bias", lambda v: (v.hidden,)),
])
TOP = _rows([
    ("patch_embed.proj.weight", "patch_embed.proj.weight",
     lambda v: (v.hidden, v.in_channels, v.temporal_patch, v.patch, v.patch)),
    ("patch_embed.proj.bias", "patch_embed.proj.bias", lambda v: (v.hidden,)),
    ("pos_embed.weight", "pos_embed.weight", lambda v: (v.num_positions, v.hidden)),
    ("merger.norm.weight", "merger_norm.weight", lambda v: (v.hidden,)),
    ("merger.norm.bias", "merger_norm.bias", lambda v: (v.hidden,)),
    ("merger.linear_fc1.weight", "merger_fc1.weight", lambda v: (v.merged_hidden, v.merged_hidden)),
    ("merger.linear_fc1.bias", "merger_fc1.bias", lambda v: (v.merged_hidden,)),
    ("merger.linear_fc2.weight", "merger_fc2.weight", lambda v: (v.out_hidden, v.merged_hidden)),
    ("merger.linear_fc2.bias", "merger_fc2.bias", lambda v: (v.out_hidden,)),
])
