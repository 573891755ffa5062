"""Contract double of neuronx-distributed-inference (NxDI main @ 4bcdc54); see _double.py."""

NXDI_DOUBLE = True   # the real-SDK tests skip when the module they imported carries this
