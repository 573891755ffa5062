"""Contract double: NxDI utilities."""
