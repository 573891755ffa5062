"""Fake of the Qwen3.6-27B port's vllm/qwen36_hybrid_apc_scheduler_patch.py (PR 173 @ 03db3ef), for the contract double.

What qbuild depends on: the module lives in the port's vllm/ directory, imports without vLLM, and its
install_import_hook() patches vllm-neuron's model runner in the calling process, whether the runner module is imported
already or later (L2737-2749: the modules found in sys.modules are patched at once, an import hook patches the others).
Of the real patch's changes the fake makes the two the double can see: the runner's KV cache spec lists the hybrid
model's attention layers only (L2352-2411; the port also ships it as
vllm/patches/vllm_neuron_qwen36_kv_cache_spec.patch), and around every text step of the runner
(_execute_model_for_text, wrapped at L2494-2565) the port's runtime keys of vLLM's additional_config are set on the
model's config and restored after (_HYBRID_APC_RUNTIME_CONFIG_KEYS L58-86, _runner_hybrid_apc_runtime_config and
_apply_hybrid_apc_runtime_config L1355-1409), which is how use_hybrid_apc_manager at serve time reaches the model's
argument builders.
And the gate on vLLM's prefix-cache reads the patch puts on the scheduler (should_disable_unbacked_prefix_reads
L993-1037, installed on add_request L1040-1056): with the hybrid APC manager and strict metadata every request is marked
skip_reading_prefix_cache unless the artifact supports backed reads (_unbacked_prefix_reads_disabled_requested
L787-807, _supports_backed_prefix_reads L940-953) and a registered GDN checkpoint backs the hit. The double has no
scheduler: its runner records, once its KV cache is made, whether the configuration lets any read through
(prefix_reads_possible), as "hybrid_apc_prefix_reads".
Each installation is recorded in the double's log.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

_RUNNER = "vllm_neuron.worker.neuronx_distributed_model_runner"
_ATTENTION = ("attention", "full_attention", "self_attention", "sliding_attention")     # L97-102
# The runtime keys the patch copies from additional_config (L58-86).
_RUNTIME_KEYS = ("use_hybrid_apc_manager", "use_qwen_hybrid_chunked_prefill", "use_qwen_hybrid_chunked_prefill_nki",
                 "gdn_checkpoint_interval", "max_gdn_checkpoint_slots", "gdn_recurrent_cache_dtype",
                 "gdn_conv_cache_dtype", "hybrid_recurrent_cache_dtype", "hybrid_conv_cache_dtype",
                 "hybrid_cache_mode", "hybrid_cache_prefix_boundary_only", "hybrid_cache_block_boundary_only",
                 "hybrid_cache_validate_exact", "hybrid_apc_layout_version", "hybrid_apc_allow_residual_replay",
                 "hybrid_apc_cache_salt", "hybrid_apc_model_revision", "hybrid_apc_require_vllm_metadata",
                 "hybrid_apc_allow_local_hash_fallback", "hybrid_apc_require_attention_block_refs",
                 "hybrid_apc_reject_unbacked_attention_hits", "hybrid_apc_disable_unbacked_prefix_reads",
                 "hybrid_apc_enable_backed_prefix_reads", "hybrid_apc_max_backed_prefix_read_len",
                 "hybrid_apc_allow_mixed_prefill_decode", "hybrid_apc_prefill_chunk_tokens", "qwen_prefill_group_size")
_MISSING = object()


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")     # L205-212


def prefix_reads_possible(additional: dict) -> bool:
    """Whether vLLM may read its prefix cache at all under this additional_config (with a registered checkpoint):
    reads are not disabled (L787-807), or the artifact supports backed reads (L940-953)."""
    if _env_flag("QWEN36_HYBRID_APC_ENABLE_PREFIX_READS"):
        return True
    disabled = _env_flag("QWEN36_HYBRID_APC_DISABLE_UNBACKED_PREFIX_READS") or (
        bool(additional.get("use_hybrid_apc_manager")) and (
            bool(additional.get("hybrid_apc_reject_unbacked_attention_hits"))
            or bool(additional.get("hybrid_apc_require_vllm_metadata"))
            or bool(additional.get("hybrid_apc_disable_unbacked_prefix_reads"))))
    if not disabled:
        return True
    if _env_flag("QWEN36_HYBRID_APC_ENABLE_BACKED_PREFIX_READS"):
        return True
    return bool(additional.get("hybrid_apc_enable_backed_prefix_reads")) and \
        bool(additional.get("use_qwen_hybrid_chunked_prefill"))


def _patch_runner(module) -> None:
    runner = module.NeuronxDistributedModelRunner
    if getattr(runner.get_kv_cache_spec, "_qwen36_hybrid_kv_cache_spec_patched", False):
        return
    original = runner.get_kv_cache_spec

    def get_kv_cache_spec(self):
        layer_types = getattr(self.hf_config, "layer_types", None)
        spec = original(self)
        if not layer_types:
            return spec
        return {name: s for name, s in spec.items()
                if str(layer_types[int(name.split(".")[1])]).lower() in _ATTENTION}

    get_kv_cache_spec._qwen36_hybrid_kv_cache_spec_patched = True
    runner.get_kv_cache_spec = get_kv_cache_spec
    original_execute = runner._execute_model_for_text

    def execute_model_for_text_with_request_ids(self, *args, **kwargs):
        extra = self.vllm_config.additional_config or {}
        values = {key: extra[key] for key in _RUNTIME_KEYS if key in extra}
        config = self.model.config
        previous = [(key, getattr(config, key, _MISSING)) for key in values]
        for key, value in values.items():
            setattr(config, key, value)
        try:
            return original_execute(self, *args, **kwargs)
        finally:
            for key, value in reversed(previous):
                if value is _MISSING:
                    delattr(config, key)
                else:
                    setattr(config, key, value)

    runner._execute_model_for_text = execute_model_for_text_with_request_ids
    original_initialize = runner.initialize_kv_cache

    def initialize_kv_cache(self):
        from neuronx_distributed_inference._double import record

        table = original_initialize(self)
        if self.vllm_config.enable_prefix_caching:
            record("hybrid_apc_prefix_reads",
                   possible=prefix_reads_possible(self.vllm_config.additional_config or {}))
        return table

    runner.initialize_kv_cache = initialize_kv_cache


class _Loader(importlib.abc.Loader):
    def __init__(self, wrapped):
        self.wrapped = wrapped

    def create_module(self, spec):
        return self.wrapped.create_module(spec)

    def exec_module(self, module):
        self.wrapped.exec_module(module)
        _patch_runner(module)


class _Finder(importlib.abc.MetaPathFinder):
    _qwen36_hybrid_apc_import_hook = True

    def find_spec(self, fullname, path, target=None):
        if fullname != _RUNNER:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install_import_hook() -> bool:
    from neuronx_distributed_inference._double import record

    record("serving_patch_installed", module=__name__, file=__file__)
    if _RUNNER in sys.modules:
        _patch_runner(sys.modules[_RUNNER])
    if not any(getattr(f, "_qwen36_hybrid_apc_import_hook", False) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    return True
