"""Contract double of NxD's parallel_layers (NxD @ fbac349): the tensor-parallel state and the two parallel linear
layers the ports' TP vision encoder is built of (docs/vision.md section 3)."""

from neuronx_distributed.parallel_layers import layers, parallel_state  # noqa: F401
