"""Fake of the port's src/hybrid_apc.py: modeling_qwen35.py imports it as `from src.hybrid_apc import (` (l.138),
which is why the PORT DIRECTORY, not src/, must be on sys.path for the main lineage (docs/nxdi.md section 15)."""


def init_hybrid_apc_scheduler_bridge(app) -> None:
    """`_init_hybrid_apc_scheduler_bridge()` does nothing unless use_hybrid_apc_manager is set; the double does not
    model the hybrid APC manager at all."""
    if getattr(app.config, "use_hybrid_apc_manager", False):
        raise NotImplementedError("the contract double does not model the hybrid APC manager")
