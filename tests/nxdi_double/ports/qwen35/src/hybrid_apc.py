"""Fake of the port's src/hybrid_apc.py: modeling_qwen35.py imports it as `from src.hybrid_apc import (` (l.138),
which is why the PORT DIRECTORY, not src/, must be on sys.path for the main lineage (docs/nxdi.md section 15)."""


def init_hybrid_apc_scheduler_bridge(app) -> None:
    """`_init_hybrid_apc_scheduler_bridge()` (modeling_qwen35.py L7168-7185 @ 03db3ef): nothing unless
    use_hybrid_apc_manager is set; then the model needs a DeltaNet layer. The bridge itself (the request-side
    bookkeeping of checkpoints) is not modelled: the double never runs a request."""
    app.hybrid_apc_bridge = None
    if not getattr(app.config, "use_hybrid_apc_manager", False):
        return
    if "linear_attention" not in app.config.layer_types:
        raise ValueError("hybrid APC requires at least one GDN layer")
