"""Dense SwiGLU MLP (Qwen3.5 dense models, and Qwen3-Next's `mlp_only_layers`): names are unchanged."""

from __future__ import annotations

from qbuild.model.convert.rule import Row, same

DENSE_MLP = (
    Row("mlp.gate_proj.weight", lambda d: (d.intermediate_size, d.hidden_size), ("mlp.gate_proj.weight",), same),
    Row("mlp.up_proj.weight", lambda d: (d.intermediate_size, d.hidden_size), ("mlp.up_proj.weight",), same),
    Row("mlp.down_proj.weight", lambda d: (d.hidden_size, d.intermediate_size), ("mlp.down_proj.weight",), same),
)
