"""Contract double of NxDI modules/kvcache/ (@ 03db3ef)."""
