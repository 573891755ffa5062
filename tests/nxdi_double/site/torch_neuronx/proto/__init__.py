"""Contract double of torch_neuronx.proto (the metaneff message NxD reads)."""
