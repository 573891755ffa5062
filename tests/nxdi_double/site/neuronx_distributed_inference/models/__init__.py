"""Contract double: the NxDI model classes and their configuration."""
