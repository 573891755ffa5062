"""qbuild's own reference implementation of the NxDI-layout model (text decoder + vision encoder).

The CPU backends trace it; tests check it against HF transformers. It consumes exactly the converted,
sharded weights the neuron backend gets. The text decoder is built from an Arch, the traced vision encoder from
a VisionArch (qbuild.model.arch).
"""

from qbuild.model.modeling.model import EntryPoint, TextModel, text_position_ids

__all__ = ["EntryPoint", "TextModel", "text_position_ids"]
