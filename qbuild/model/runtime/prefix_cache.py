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

What a prompt keeps, and what goes first (docs/long-context.md section 3 says why):
- A prompt of n tokens that resumed at r has candidate checkpoints at the multiples of the interval in (r, limit],
  limit being n or what num_blocks blocks hold. It keeps, while the slots last: its deepest candidate before its last
  token (an exact repeat, or the next turn of a chat, resumes there); the deepest point of the prefix it shares with
  the prompts before it (its run of cached blocks, floored to the interval and before its last token: where it
  resumed, or a new checkpoint where it found blocks but no checkpoint), because a prefix two requests shared, such as
  a system prompt, is the likeliest to come again; then its other candidates, deepest first. It keeps its blocks up to
  the deepest checkpoint it keeps, and only those: a block past every kept checkpoint could never be resumed from.
- Room for what a prompt keeps is made by evicting entries it does not keep: never its own prefix to store its tail.
  What goes is the least recently used entry; of the entries one prompt used, the deepest first, as vLLM frees a
  request's blocks tail first (FreeKVCacheBlockQueue), so a prefix stays resumable while its tail goes. A block's
  checkpoint goes with it, so no checkpoint outlives the blocks it needs.
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
class Use:
    """One prompt's use of the cache, from its lookup to its store: where it resumes (`tokens` cached tokens, 0: none,
    and the state to resume with) and which of its checkpoints it keeps."""

    hashes: list[bytes]                  # the prompt's full blocks' hashes
    tokens: int
    blocks: list[list[torch.Tensor]]     # per resumed block, its slice of each attention cache, in state order
    checkpoint: list[torch.Tensor] | None   # the DeltaNet state tensors to resume with, in state order
    keep: list[int]                      # the positions of the checkpoints it keeps, in the policy's order


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
    def lookup(self, hashes: list[bytes], n: int) -> Use:
        """A prompt of n tokens (its full blocks' `hashes`): where it resumes, its deepest checkpoint whose blocks are
        all cached and that lies before its last token, and what it will keep."""
        size, interval = self.spec.block_size, self.spec.checkpoint_interval
        present = 0
        while present < len(hashes) and hashes[present] in self._blocks:
            present += 1
        shared = min(present * size, n - 1) // interval * interval
        resumed = next((p for p in range(shared, 0, -interval) if hashes[p // size - 1] in self._checkpoints), 0)
        keep = self._keep(n, resumed, shared)
        if not resumed:
            return Use(hashes, 0, [], None, keep)
        self.stats.hits += 1
        self.stats.cached_tokens += resumed
        return Use(hashes, resumed, [self._blocks[h] for h in hashes[:resumed // size]],
                   self._checkpoints[hashes[resumed // size - 1]], keep)

    def _keep(self, n: int, resumed: int, shared: int) -> list[int]:
        """The positions of the checkpoints a prompt of n tokens keeps (it resumed at `resumed`; its cached blocks
        reach `shared`, floored to the interval): its deepest new one before its last token, the end of the prefix
        it shares, then its other new ones deepest first, while the slots last."""
        size, interval = self.spec.block_size, self.spec.checkpoint_interval
        limit = min(n, self.spec.num_blocks * size) // interval * interval
        new = list(range(limit, resumed, -interval))
        order = [p for p in new if p < n][:1]
        order += [p for p in [shared] if p and p not in order]
        order += [p for p in new if p not in order]
        return order[:self.spec.checkpoint_slots]

    def restore(self, use: Use, state: list[torch.Tensor]) -> None:
        """Write a use's resumed blocks into the host's full caches and its checkpoint into the DeltaNet state."""
        if use.blocks:
            end = len(use.blocks) * self.spec.block_size
            for k, i in enumerate(self.attention):
                state[i][:, :, :, :end] = torch.cat([block[k] for block in use.blocks], dim=3)
        for i, saved in zip(self.deltanet, use.checkpoint):
            state[i] = saved.clone()

    # --- writing ----------------------------------------------------------------------------------------------
    def save_checkpoint(self, use: Use, end: int, state: list[torch.Tensor]) -> None:
        """Keep the DeltaNet state after the prompt's first `end` tokens (a copy: the state goes on changing), where
        the use keeps a checkpoint there."""
        if end not in use.keep:
            return
        key = use.hashes[end // self.spec.block_size - 1]
        if key in self._checkpoints:
            return
        if len(self._checkpoints) >= self.spec.checkpoint_slots:
            mine = {use.hashes[p // self.spec.block_size - 1] for p in use.keep}
            self._drop_checkpoint(next(k for k in self._checkpoints if k not in mine))
        self._checkpoints[key] = saved = [state[i].clone() for i in self.deltanet]
        self._held += _nbytes(saved)
        self._account()

    def store(self, use: Use, state: list[torch.Tensor]) -> None:
        """Keep the prompt's blocks up to its deepest kept checkpoint from the host's full caches, evicting only
        blocks it does not keep, and mark what it keeps used."""
        size = self.spec.block_size
        mine = use.hashes[:max(use.keep, default=0) // size]
        for key in mine:   # its cached blocks to the back, out of the way of the evictions below
            if key in self._blocks:
                self._blocks.move_to_end(key)
        for j, key in enumerate(mine):
            if key not in self._blocks:
                if len(self._blocks) >= self.spec.num_blocks:   # the front is another prompt's: this one's fit
                    evicted, block = self._blocks.popitem(last=False)
                    self._held -= _nbytes(block)
                    self.stats.evicted_blocks += 1
                    if evicted in self._checkpoints:
                        self._drop_checkpoint(evicted)
                self._blocks[key] = block = [state[i][:, :, :, j * size:(j + 1) * size].clone()
                                             for i in self.attention]
                self._held += _nbytes(block)
        # most recently used, the deepest of them first to go
        for key in reversed(mine):
            self._blocks.move_to_end(key)
        for p in sorted(use.keep, reverse=True):
            self._checkpoints.move_to_end(use.hashes[p // size - 1])
        self._account()

    def _drop_checkpoint(self, key: bytes) -> None:
        self._held -= _nbytes(self._checkpoints.pop(key))
        self.stats.evicted_checkpoints += 1

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
