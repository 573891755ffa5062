"""Contract double: NxDI attention modules."""
