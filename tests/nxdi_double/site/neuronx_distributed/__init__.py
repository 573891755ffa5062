"""Contract double of neuronx-distributed (NxD @ fbac349): importable so qbuild finds the package; qbuild calls
nothing in it directly (NxD runs inside NxDI's compile and load, which the NxDI double plays)."""
