"""Contract double of NxDI modules/kvcache/block_kv_cache_manager.py @ 03db3ef (the PR 173 tree): how many blocks the
block KV cache has and which block a padded slot is written to. The Qwen3.6-27B port's QwenHybridBlockKVCacheManager
subclasses it and keeps both (modeling_qwen35.py L3925-3960, L4022-4033: its raw block pair is pa_num_blocks +
_NUM_EXTRA_RESERVED_BLOCK blocks long)."""

from __future__ import annotations

# "Reserve extra blocks to serve as the destination of non-active KV during update" (L20-21).
_NUM_EXTRA_RESERVED_BLOCK = 1


def cache_blocks(neuron_config) -> int:
    """The blocks of the cache: pa_num_blocks + 1 with prefix caching (_init_kv_shape_for_prefix_caching L49-77, with
    or without block tiling), pa_num_blocks with NxDI's own chunked prefill only (L79-88)."""
    extra = _NUM_EXTRA_RESERVED_BLOCK if neuron_config.is_prefix_caching else 0
    return neuron_config.pa_num_blocks + extra


def padding_block(neuron_config) -> int | None:
    """The block every padded slot (a slot_mapping entry < 0, or past the cache) is written to with prefix caching:
    pad_dest_index = (num_blocks - 1) * block_size, the first row of the cache's last block (_update_cache_with_reshape
    L340-360). NxDI's own chunked prefill writes padding to the last row of the last block instead (L384-391); the
    double models the prefix-caching layout only (None otherwise)."""
    if not neuron_config.is_prefix_caching:
        return None
    return cache_blocks(neuron_config) - 1
