"""Fake main-lineage NxDI contrib port (contract double): laid out as contrib/models/Qwen3.5-35B-A3B/src/ @ 4bcdc54."""
