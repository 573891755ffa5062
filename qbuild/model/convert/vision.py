"""Vision encoder (docs/nxd-layout.md section 6): HF `model.visual.*` -> the traced encoder's names.

The blocks keep their names; the merger's modules are flattened (merger.norm -> merger_norm, merger.linear_fc1 ->
merger_fc1, merger.linear_fc2 -> merger_fc2); patch_embed.proj and pos_embed run on the host and keep their names.
No +1 anywhere: these are LayerNorms with a real weight and bias.
"""

from __future__ import annotations

from qbuild.model.convert.rule import Row, same


def _rows(pairs):
    """(HF suffix, NxDI suffix, shape function) triples -> renaming Rows."""
    return tuple(Row(src, shape, (dst,), same) for src, dst, shape in pairs)


BLOCK = _rows([
    ("norm1.weight", "norm1.weight", lambda v: (v.hidden_size,)),
    ("norm1.bias", "norm1.bias", lambda v: (v.hidden_size,)),
    ("norm2.weight", "norm2.weight", lambda v: (v.hidden_size,)),
    ("norm2.bias", "norm2.bias", lambda v: (v.hidden_size,)),
    ("attn.qkv.weight", "attn.qkv.weight", lambda v: (3 * v.hidden_size, v.hidden_size)),
    ("attn.qkv.bias", "attn.qkv.bias", lambda v: (3 * v.hidden_size,)),
    ("attn.proj.weight", "attn.proj.weight", lambda v: (v.hidden_size, v.hidden_size)),
    ("attn.proj.bias", "attn.proj.bias", lambda v: (v.hidden_size,)),
    ("mlp.linear_fc1.weight", "mlp.linear_fc1.weight", lambda v: (v.intermediate_size, v.hidden_size)),
    ("mlp.linear_fc1.bias", "mlp.linear_fc1.bias", lambda v: (v.intermediate_size,)),
    ("mlp.linear_fc2.weight", "mlp.linear_fc2.weight", lambda v: (v.hidden_size, v.intermediate_size)),
    ("mlp.linear_fc2.bias", "mlp.linear_fc2.bias", lambda v: (v.hidden_size,)),
])
TOP = _rows([
    ("patch_embed.proj.weight", "patch_embed.proj.weight",
     lambda v: (v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)),
    ("patch_embed.proj.bias", "patch_embed.proj.bias", lambda v: (v.hidden_size,)),
    ("pos_embed.weight", "pos_embed.weight", lambda v: (v.num_position_embeddings, v.hidden_size)),
    ("merger.norm.weight", "merger_norm.weight", lambda v: (v.hidden_size,)),
    ("merger.norm.bias", "merger_norm.bias", lambda v: (v.hidden_size,)),
    ("merger.linear_fc1.weight", "merger_fc1.weight", lambda v: (v.merged_hidden_size, v.merged_hidden_size)),
    ("merger.linear_fc1.bias", "merger_fc1.bias", lambda v: (v.merged_hidden_size,)),
    ("merger.linear_fc2.weight", "merger_fc2.weight", lambda v: (v.out_hidden_size, v.merged_hidden_size)),
    ("merger.linear_fc2.bias", "merger_fc2.bias", lambda v: (v.out_hidden_size,)),
])
