"""vllm_neuron/__init__.py @ 3afb0a9: register() names the platform class (L15-23). The real one answers only where
/dev/neuron* exists; the double answers everywhere, since it stands in for a Neuron host."""


def register():
    return "vllm_neuron.platform.NeuronPlatform"
