"""Contract double: NxDI modules the fake ports use."""
