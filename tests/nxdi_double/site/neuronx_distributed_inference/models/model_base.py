"""Contract double of NxDI models/model_base.py (@ ef2731e): NeuronBaseForCausalLM.

Its __init__ enables BOTH submodels, and each asks the app for its compiler arguments right then (mbase.py
L3027-3071, L3102-3149; docs/nxdi.md section 9): so one compile() always builds every context-encoding and
token-generation bucket, and get_compiler_args() runs at construction. Buckets (docs/nxdi.md section 2):
enable_bucketing False -> [max_context_length] / [max_length]; True with explicit lists -> the lists; True with a list
left None -> powers of two from 128 to the max (autobucketing.py), which the double records as auto_buckets. With
prefix caching a bucket is an (active tokens, prefix) pair (autobucketing.py @ 03db3ef, docs/long-context.md
section 5).

forward() is a generation step as NxDI's NeuronBaseForCausalLM.forward takes it (mbase.py L3314-3400): context encoding
where position_ids start at 0 (_is_prefill, L3546-3547), else token generation after it; reset() (L3926-3930) makes the
next call context encoding again. Its output is built as _construct_output builds it (L3832-3862): with on-device
sampling `tokens` holds each row's token (B,) int32 and `logits` is None, else `logits` and `tokens` both hold the
logits (B, 1, V); `hidden_states` holds the same as `tokens`. The double cannot compute: a step's token is a fixed
function of what it was given (the sum of the sequence so far, with the image features it scattered, modulo the
vocabulary), and it refuses what the compiled graphs could not take: a step before load(), token generation before
context encoding, a decode fed another token or position than the one that follows, a prompt over the largest
context-encoding bucket, image features the port's context encoding does not take (the port's model says which).

The KV cache manager the model builds (init_inference_optimization, mbase.py @ 03db3ef L168-186) is chosen at
construction too, where the real one is built with the model: a block layout gets NxDI's BlockKVCacheManager, whose
cache shape exists only for prefix caching or NxDI's chunked prefill (block_kv_cache_manager.py L40-88; without one,
KVCacheManager.__init__ reads a k_shape never set: kv_cache_manager.py L136, L159-164).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

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
        self.kv_cache_populated, self._decode = False, None
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

    # --- a generation step (forward) ---------------------------------------------------------------------------
    def reset(self) -> None:
        self.kv_cache_populated = False
        self._decode = None

    def forward(self, input_ids=None, seq_ids=None, attention_mask=None, position_ids=None, sampling_params=None,
                output_attentions=None, output_hidden_states=None, return_dict=None, llava_args=None, **kwargs):
        if kwargs:
            raise TypeError(f"forward: the double does not model {sorted(kwargs)}")
        if not getattr(self, "is_loaded", False):
            raise RuntimeError("forward: the model was not loaded (call load(compiled_model_path) first)")
        if input_ids is None or input_ids.dim() != 2 or position_ids is None:
            raise ValueError("forward: input_ids [batch, tokens] and position_ids are required")
        if input_ids.shape[0] != self.neuron_config.batch_size:
            raise ValueError(f"forward: a batch of {input_ids.shape[0]} rows, compiled for "
                             f"{self.neuron_config.batch_size}")
        if int(position_ids.min()) == 0:
            token = self._context_step(input_ids, attention_mask, position_ids, list(llava_args or []))
        else:
            token = self._generation_step(input_ids, position_ids, llava_args)
        return self._construct_output(token)

    def _context_step(self, input_ids, attention_mask, position_ids, llava_args) -> int:
        n = input_ids.shape[1]
        buckets = next(s.buckets for s in self.submodels if s.tag == CONTEXT_ENCODING_MODEL_TAG)
        if n > max(buckets):
            raise ValueError(f"forward: a {n}-token prompt exceeds the largest context-encoding bucket {max(buckets)}")
        # NxDI's first fit is strict: the first bucket longer than the prompt, the largest only for a prompt of its
        # length (model_wrapper.py _get_seq_bucket L911, L916 @ ef2731e): a prompt of a smaller bucket's length runs
        # in the next one.
        bucket = next((b for b in sorted(buckets) if n < b), max(buckets))
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError("forward: attention_mask must have input_ids' shape")
        features, next_position = self.context_inputs(input_ids, position_ids, llava_args, bucket)
        total = int(input_ids[0].sum()) + features
        token = total % self.config.vocab_size
        self.kv_cache_populated = True
        self._decode = {"sum": total + token, "last": token, "position": next_position}
        record("forward", stage="context_encoding", bucket=bucket, tokens=n, llava_args=len(llava_args),
               token=token)
        return token

    def context_inputs(self, input_ids, position_ids, llava_args, bucket) -> tuple[int, int]:
        """(what the image features add to the step's sum, the position the first decode takes). NxDI's own models
        pass llava_args to their ImageToText wrappers, which the double does not model; a port that takes image
        features overrides this."""
        if llava_args:
            raise NotImplementedError("llava_args: the double models the Qwen3.5 ports' image features only")
        return 0, int(position_ids.max()) + 1

    def _generation_step(self, input_ids, position_ids, llava_args) -> int:
        state = getattr(self, "_decode", None)
        if not self.kv_cache_populated or state is None:
            raise RuntimeError("forward: token generation before context encoding (reset() makes the next call "
                               "context encoding)")
        if llava_args:
            raise ValueError("forward: token generation takes no image features")
        if input_ids.tolist() != [[state["last"]]]:
            raise RuntimeError(f"forward: a decode fed {input_ids.tolist()}; the step before chose {state['last']}")
        if position_ids.tolist() != [[state["position"]]]:
            raise RuntimeError(f"forward: a decode at position {position_ids.tolist()}; the token that follows is at "
                               f"{state['position']}")
        buckets = next(s.buckets for s in self.submodels if s.tag == TOKEN_GENERATION_MODEL_TAG)
        if state["position"] >= max(buckets):
            raise ValueError(f"forward: position {state['position']} is past the largest token-generation bucket "
                             f"{max(buckets)}")
        token = state["sum"] % self.config.vocab_size
        state.update(sum=state["sum"] + token, last=token, position=state["position"] + 1)
        record("forward", stage="token_generation", position=state["position"] - 1, token=token)
        return token

    def _construct_output(self, token: int):
        """mbase.py L3832-3862 (see the module's docstring)."""
        nc = self.neuron_config
        if nc.on_device_sampling_config is not None:
            tokens = torch.tensor([token], dtype=torch.int32)
            return SimpleNamespace(logits=None, tokens=tokens, hidden_states=tokens)
        logits = torch.zeros((1, 1, self.config.vocab_size), dtype=torch.float32)
        logits[0, 0, token] = 1.0
        return SimpleNamespace(logits=logits, tokens=logits, hidden_states=logits)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

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
