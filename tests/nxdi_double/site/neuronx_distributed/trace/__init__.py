"""Contract double of neuronx_distributed.trace (NxD @ fbac349): parallel_model_trace, parallel_model_save and
parallel_model_load, as compile_vision_encoder_tp.py and the port's load_compiled use them (docs/vision.md
section 3)."""

from neuronx_distributed.trace.trace import (get_sharded_checkpoint, parallel_model_load,  # noqa: F401
                                             parallel_model_save, parallel_model_trace)
