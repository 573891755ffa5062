"""Contract double of NxDI models/model_base.py (@ ef2731e): NeuronBaseForCausalLM.

Its __init__ enables BOTH submodels, and each asks the app for its compiler arguments right then (mbase.py
L3027-3071, L3102-3149; docs/nxdi.md section 9): so one compile() always builds every context-encoding and
token-generation bucket, and get_compiler_args() runs at construction. Buckets (docs/nxdi.md section 2):
enable_bucketing False -> [max_context_length] / [max_length]; True with explicit lists -> the lists; True with a list
left None -> powers of two from 128 to the max (autobucketing.py), which the double records as auto_buckets.
"""

from __future__ import annotations

from neuronx_distributed_inference._double import record
from neuronx_distributed_inference.models.application_base import NeuronApplicationBase, Submodel
from neuronx_distributed_inference.models.model_wrapper import (
    CONTEXT_ENCODING_MODEL_TAG,
    TOKEN_GENERATION_MODEL_TAG,
)


def _buckets(enabled: bool, explicit: list[int] | None, maximum: int) -> tuple[list[int], bool]:
    if not enabled:
        return [maximum], False
    if explicit is not None:
        return list(explicit), False
    if maximum < 128:
        raise ValueError(f"autobucketing starts at 128; the maximum is {maximum}")
    return [2 ** i for i in range(7, maximum.bit_length()) if 2 ** i < maximum] + [maximum], True


class NeuronBaseForCausalLM(NeuronApplicationBase):
    def __init__(self, model_path, config=None, neuron_config=None):
        super().__init__(model_path, config=config, neuron_config=neuron_config)
        self.enable_context_encoding()
        self.enable_token_generation()

    def _enable(self, tag: str, priority: bool, buckets: tuple[list[int], bool], batch: int, per_token: bool):
        self.compile_tag = tag        # the ports' get_compiler_args() read it
        args = self.get_compiler_args()
        record("get_compiler_args", cls=type(self).__name__, tag=tag, returned=args)
        self.submodels.append(Submodel(tag, buckets[0], buckets[1], args, priority, batch, per_token))

    def enable_context_encoding(self):
        nc = self.neuron_config
        self._enable(CONTEXT_ENCODING_MODEL_TAG, False,
                     _buckets(nc.enable_bucketing, nc.context_encoding_buckets, nc.max_context_length),
                     nc.ctx_batch_size, True)

    def enable_token_generation(self, enable_wlt_optimization: bool = True):
        # priority_model_idx=0 "to turn on weight layout optimization" (mbase.py L3147-3149).
        nc = self.neuron_config
        record("enable_token_generation", enable_wlt_optimization=enable_wlt_optimization)
        self._enable(TOKEN_GENERATION_MODEL_TAG, enable_wlt_optimization,
                     _buckets(nc.enable_bucketing, nc.token_generation_buckets, nc.max_length),
                     nc.tkg_batch_size, False)
