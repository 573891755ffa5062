"""The runtime's prefix cache for a hybrid model: attention KV per block of tokens, DeltaNet state checkpoints every
`checkpoint_interval` tokens, both bounded and evicted least recently used first.

Keys are vLLM's: a prompt's full blocks are hashed as a chain, each block's hash covering its parent's hash, its token
ids and, for the first block, extra keys (vLLM's `hash_block_tokens` and `generate_block_hash_extra_keys`, which adds
a request's cache salt to the first block's keys; vllm/v1/core/kv_cache_utils.py, cited with lines in
docs/long-context.md). A block's hash therefore names the whole prefix up to its end, and equal hashes mean equal
prefixes (sha256; a collision would be needed to confuse two). A checkpoint is keyed by the hash of the block it ends
with. The extra key here is the image a VL prompt carries (its encoded features), whose tokens in the prompt are
image pad tokens, the same for every image.

DeltaNet's state is not per token, so a prefix can only be resumed where its state was kept: at a checkpoint whose
blocks are all cached, and before the prompt's last token (whose logits choose the first new token). The runtime
keeps the checkpoints of the prompt tokens it prefills; generated tokens are not cached.

Eviction: an entry is used when a prompt is stored or resumed through it. Blocks and checkpoints of one prompt are
touched deepest first, so that of two entries used together the deeper is evicted first, as vLLM frees a request's
blocks tail first (FreeKVCacheBlockQueue): a prefix stays resumable while its tail goes. Within one prompt's new
checkpoints, the deepest are kept when there are more than the slots (a repeat or an extension of the prompt resumes
from them).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from qbuild.model.chunking import PrefixCacheSpec


def block_hashes(token_ids: list[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    """The chain hash of each full block of `token_ids`: block i's covers block i-1's hash and its own token ids; the
    first block's parent is a fixed root, and `salt` (an extra key, e.g. an image) is part of the first block's."""
    hashes, parent = [], hashlib.sha256(b"qbuild prefix cache root").digest()
    full = len(token_ids) // block_size * block_size
    raw = memoryview(np.array(token_ids[:full], dtype="<i8").tobytes())   # each id as 8 bytes, little-endian
    step = block_size * 8
    for i in range(full // block_size):
        h = hashlib.sha256(parent)
        h.update(raw[i * step:(i + 1) * step])
        h.update(salt if i == 0 else b"")
        parent = h.digest()
        hashes.append(parent)
    return hashes


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class Resume:
    """Where a prompt resumes: `tokens` cached tokens (0: none), and the state to resume with."""

    tokens: int
    blocks: list[list[torch.Tensor]]     # per block, its slice of each attention cache, in state order
    checkpoint: list[torch.Tensor] | None   # the DeltaNet state tensors, in state order


@dataclass
class CacheStats:
    blocks: int = 0
    checkpoints: int = 0
    bytes: int = 0
    peak_bytes: int = 0
    budget_bytes: int = 0
    hits: int = 0                 # prompts that resumed from the cache
    cached_tokens: int = 0        # prompt tokens not prefilled again, over all prompts
    evicted_blocks: int = 0
    evicted_checkpoints: int = 0


class PrefixCache:
    """The cache of one runtime. `attention` and `deltanet` are the indices, in the model's state tuple, of the
    attention KV caches (R, B, Nkv, L, D) and of the DeltaNet conv and recurrent states."""

    def __init__(self, spec: PrefixCacheSpec, attention: list[int], deltanet: list[int],
                 state_shapes: list[tuple[tuple[int, ...], torch.dtype]]):
        self.spec, self.attention, self.deltanet = spec, attention, deltanet
        self._blocks: OrderedDict[bytes, list[torch.Tensor]] = OrderedDict()
        self._checkpoints: OrderedDict[bytes, list[torch.Tensor]] = OrderedDict()
        self._held = 0    # bytes of the tensors held, counted as they come and go
        self.stats = CacheStats(budget_bytes=self._budget(state_shapes))

    def _budget(self, shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
        """num_blocks blocks and checkpoint_slots checkpoints, in bytes."""
        def size(i: int, slots: int | None = None) -> int:
            shape, dtype = shapes[i]
            shape = shape if slots is None else (*shape[:3], slots, shape[4])
            return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()

        block = sum(size(i, self.spec.block_size) for i in self.attention)
        checkpoint = sum(size(i) for i in self.deltanet)
        return self.spec.num_blocks * block + self.spec.checkpoint_slots * checkpoint

    # --- reading ----------------------------------------------------------------------------------------------
    def lookup(self, hashes: list[bytes], n: int) -> Resume:
        """The deepest checkpoint of a prompt of n tokens (its full blocks' `hashes`) that can be resumed: all its
        blocks cached, and before the last token. Touches what it returns."""
        size, interval = self.spec.block_size, self.spec.checkpoint_interval
        present = 0
        while present < len(hashes) and hashes[present] in self._blocks:
            present += 1
        deepest = min(present * size, n - 1) // interval * interval
        for p in range(deepest, 0, -interval):
            key = hashes[p // size - 1]
            if key in self._checkpoints:
                used = hashes[:p // size]
                self._touch(used, key)
                self.stats.hits += 1
                self.stats.cached_tokens += p
                return Resume(p, [self._blocks[h] for h in used], self._checkpoints[key])
        return Resume(0, [], None)

    def restore(self, resume: Resume, state: list[torch.Tensor]) -> None:
        """Write a resume's blocks into the host's full caches and its checkpoint into the DeltaNet state."""
        if resume.blocks:
            end = len(resume.blocks) * self.spec.block_size
            for k, i in enumerate(self.attention):
                state[i][:, :, :, :end] = torch.cat([block[k] for block in resume.blocks], dim=3)
        for i, saved in zip(self.deltanet, resume.checkpoint):
            state[i] = saved.clone()

    # --- writing ----------------------------------------------------------------------------------------------
    def save_checkpoint(self, key: bytes, state: list[torch.Tensor]) -> None:
        """Keep the DeltaNet state after the block `key` (a copy: the state goes on changing)."""
        if key in self._checkpoints:
            self._checkpoints.move_to_end(key)
            return
        while len(self._checkpoints) >= self.spec.checkpoint_slots:
            self._held -= _nbytes(self._checkpoints.popitem(last=False)[1])
            self.stats.evicted_checkpoints += 1
        self._checkpoints[key] = saved = [state[i].clone() for i in self.deltanet]
        self._held += _nbytes(saved)
        self._account()

    def save_blocks(self, hashes: list[bytes], state: list[torch.Tensor]) -> None:
        """Keep the KV of the blocks `hashes` (a prompt's first len(hashes) blocks) from the host's full caches, and
        mark them, and their prompt's checkpoints, used."""
        size = self.spec.block_size
        for j, key in enumerate(hashes):
            if key not in self._blocks:
                while len(self._blocks) >= self.spec.num_blocks:
                    self._held -= _nbytes(self._blocks.popitem(last=False)[1])
                    self.stats.evicted_blocks += 1
                block = [state[i][:, :, :, j * size:(j + 1) * size].clone() for i in self.attention]
                self._blocks[key] = block
                self._held += _nbytes(block)
        self._touch(hashes, None)
        self._account()

    def _touch(self, hashes: list[bytes], checkpoint: bytes | None) -> None:
        """Mark a prompt's blocks (and a checkpoint) most recently used, its first block last: the deepest are the
        first of them to go."""
        for key in reversed(hashes):
            if key in self._blocks:
                self._blocks.move_to_end(key)
        if checkpoint is not None:
            self._checkpoints.move_to_end(checkpoint)

    def _account(self) -> None:
        s = self.stats
        s.blocks, s.checkpoints = len(self._blocks), len(self._checkpoints)
        s.bytes = self._held
        s.peak_bytes = max(s.peak_bytes, s.bytes)

    def clear(self) -> None:
        self._blocks.clear()
        self._checkpoints.clear()
        self._held = 0
        self._account()
