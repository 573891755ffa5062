"""Contract double of neuronx-distributed (NxD @ fbac349). qbuild calls two parts of it itself, for a TP-sharded vision
encoder (docs/vision.md section 3): trace/ (parallel_model_trace, parallel_model_save, parallel_model_load,
get_sharded_checkpoint) and parallel_layers/ (the tensor-parallel state and the parallel linear layers the port's
encoder is built of). The rest of NxD runs inside NxDI's compile and load, which the NxDI double plays."""
