"""Contract double of NxDI models/model_base.py (@ ef2731e): NeuronBaseForCausalLM.

Its __init__ enables BOTH submodels, and each asks the app for its compiler arguments right then (mbase.py
L3027-3071, L3102-3149; docs/nxdi.md section 9): so one compile() always builds every context-encoding and
token-generation bucket, and get_compiler_args() runs at construction. Buckets (docs/nxdi.md section 2):
enable_bucketing False -> [max_context_length] / [max_length]; True with explicit lists -> the lists; True with a list
left None -> powers of two from 128 to the max (autobucketing.py), which the double records as auto_buckets. With
prefix caching a bucket is an (active tokens, prefix) pair (autobucketing.py @ 03db3ef, docs/long-context.md
section 5).

The KV cache manager the model builds (init_inference_optimization, mbase.py @ 03db3ef L168-186) is chosen at
construction too, where the real one is built with the model: a block layout gets NxDI's BlockKVCacheManager, whose
cache shape exists only for prefix caching or NxDI's chunked prefill (block_kv_cache_manager.py L40-88; without one,
KVCacheManager.__init__ reads a k_shape never set: kv_cache_manager.py L136, L159-164).
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


def _prefix_context_buckets(nc) -> tuple[list, bool]:
    """autobucketing.py generate_buckets_for_cte @ 03db3ef with prefix caching: explicit pairs (L162-166); without
    bucketing [[max_context_length, 0], [max_context_length, max_context_length]] (L168-176, generate_buckets of one
    length); with explicit lists every CTE bucket with prefix 0 and each prefix bucket (L183-189, L45-62). The double
    does not generate the automatic 2D grid (L193-201)."""
    if nc.context_encoding_bucket_pairs is not None:
        return [list(p) for p in nc.context_encoding_bucket_pairs], False
    if not nc.enable_bucketing:
        return [[nc.max_context_length, 0], [nc.max_context_length, nc.max_context_length]], False
    if nc.context_encoding_buckets is None or nc.prefix_buckets is None:
        raise NotImplementedError("the double builds prefix-caching CTE buckets from explicit context_encoding_buckets "
                                  "and prefix_buckets only (NxDI's own grid is not in the facts)")
    return [[c, p] for c in nc.context_encoding_buckets for p in [0, *nc.prefix_buckets]], False


def _prefix_token_buckets(nc) -> tuple[list, bool]:
    """generate_buckets_for_tkg @ 03db3ef with prefix caching: (1, KV length) per bucket (L244-264)."""
    if not nc.enable_bucketing:
        return [[1, nc.max_length]], False
    if nc.token_generation_buckets is None:
        raise NotImplementedError("the double builds prefix-caching TKG buckets from explicit lists only")
    return [[1, t] for t in nc.token_generation_buckets], False


class NeuronBaseForCausalLM(NeuronApplicationBase):
    def __init__(self, model_path, config=None, neuron_config=None):
        super().__init__(model_path, config=config, neuron_config=neuron_config)
        if self.neuron_config.is_chunked_prefill:
            raise NotImplementedError("Chunked Prefill is not available in NxDI for now")   # mbase.py L3073-3074
        self.kv_manager = self.init_kv_manager()
        self.enable_context_encoding()
        self.enable_token_generation()

    def init_kv_manager(self) -> str:
        """The KV cache manager init_inference_optimization builds (mbase.py L168-186 @ 03db3ef), by class name; a port
        overrides it as the real ports override init_inference_optimization."""
        nc = self.neuron_config
        if nc.attention_dp_degree > 1:
            return "DataParallelKVCacheManager"
        if nc.is_block_kv_layout:
            if not (nc.is_prefix_caching or nc.is_chunked_prefill):
                raise AttributeError("'BlockKVCacheManager' object has no attribute 'k_shape' (a block KV layout has a "
                                     "cache shape only with prefix caching or chunked prefill: "
                                     "block_kv_cache_manager.py L40-47 @ 03db3ef)")
            return "BlockKVCacheManager"
        return "KVCacheManager"

    def _enable(self, tag: str, priority: bool, buckets: tuple[list, bool], batch: int, per_token: bool):
        self.compile_tag = tag        # the ports' get_compiler_args() read it
        args = self.get_compiler_args()
        record("get_compiler_args", cls=type(self).__name__, tag=tag, returned=args)
        self.submodels.append(Submodel(tag, buckets[0], buckets[1], args, priority, batch, per_token))

    def enable_context_encoding(self):
        nc = self.neuron_config
        buckets = _prefix_context_buckets(nc) if nc.is_prefix_caching else \
            _buckets(nc.enable_bucketing, nc.context_encoding_buckets, nc.max_context_length)
        self._enable(CONTEXT_ENCODING_MODEL_TAG, False, buckets, nc.ctx_batch_size, True)

    def enable_token_generation(self, enable_wlt_optimization: bool = True):
        # priority_model_idx=0 "to turn on weight layout optimization" (mbase.py L3147-3149).
        nc = self.neuron_config
        record("enable_token_generation", enable_wlt_optimization=enable_wlt_optimization)
        buckets = _prefix_token_buckets(nc) if nc.is_prefix_caching else \
            _buckets(nc.enable_bucketing, nc.token_generation_buckets, nc.max_length)
        self._enable(TOKEN_GENERATION_MODEL_TAG, enable_wlt_optimization, buckets, nc.tkg_batch_size, False)

    def execute(self, tag: str, tokens: int) -> None:
        """One call of the loaded `tag` graph (the double does not compute). Where the port says how many tensors a
        call takes (its model's stage_inputs, built from the config as it is at the call), they must be the inputs
        the graph was traced with: NxD routes a call by its inputs' shapes, and a call of another count finds no
        graph (PR 173's own check reads the traced count from input_shape_map: modeling_qwen35.py
        _qwen36_compiled_arg_count L4517-4536 @ 03db3ef). The double raises there in its own words."""
        if not self.is_loaded:
            raise RuntimeError("execute: the model was not loaded")
        stage_inputs = getattr(self._model_cls, "stage_inputs", None)
        traced = self.traced_inputs.get(tag)
        if stage_inputs is None or traced is None:
            return
        built = stage_inputs(self.config)
        if built != traced:
            raise RuntimeError(f"{tag}: a call of {built} tensors (use_hybrid_apc_manager="
                               f"{bool(getattr(self.config, 'use_hybrid_apc_manager', False))} now) to a graph traced "
                               f"with {traced} inputs")
