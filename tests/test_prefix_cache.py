"""The prefix cache's eviction policy (docs/long-context.md section 3), through the runtime's own prefill.

The runtime's prefill (`Runtime._prefill`: where a prompt resumes, which checkpoints it takes, which blocks it keeps)
runs here over a stand-in model instead of compiled graphs: the attention cache's slot i holds token i, and the
DeltaNet state is a running hash of the tokens so far. That is enough for the cache's bookkeeping, which never reads a
value, and it makes a wrong restore visible: every prefill, warm or cold, must end in the state of the whole prompt.

- The cache on its own: its keys, where a prompt resumes, what goes first.
- The request sequences the issue that prompted this policy found under a tight budget (block_size 16, checkpoint
  interval 32, 3 checkpoint slots, 16 blocks, seq_len 256).
- A randomised model of requests (shared system prompts, repeats, next turns, strangers) against a reference policy
  written as plainly as possible, and the policy's promises checked after every request: no request loses its own
  prefix to its tail, the prefix the last request resumed from stays resumable, a repeat of the last request resumes
  at its deepest checkpoint that fits, and the cache never holds more than its budget.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from qbuild.model.chunking import LongContext, PrefixCacheSpec
from qbuild.model.runtime import Runtime
from qbuild.model.runtime.prefix_cache import PrefixCache, block_hashes
from qbuild.model.runtime.state import HostState

# --- the cache on its own -------------------------------------------------------------------------------------------

def _cache(slots: int = 2, blocks: int = 8) -> PrefixCache:
    """A cache of one attention layer (state 0, 1) and one DeltaNet layer (state 2, 3): blocks of 4 tokens,
    checkpoints every 8."""
    shapes = [((1, 1, 1, 32, 2), torch.float32)] * 2 + [((1, 1, 3, 2), torch.float32), ((1, 1, 2, 2, 2),
                                                                                          torch.float32)]
    return PrefixCache(PrefixCacheSpec(4, blocks, 8, slots), [0, 1], [2, 3], shapes)


def _state(value: float) -> list[torch.Tensor]:
    return [torch.full((1, 1, 1, 32, 2), value), torch.full((1, 1, 1, 32, 2), -value),
            torch.full((1, 1, 3, 2), value), torch.full((1, 1, 2, 2, 2), value)]


def _store(cache: PrefixCache, ids: list[int], value: float) -> list[bytes]:
    """What the runtime does for a cold prefill of `ids`: a checkpoint offered at every interval, then the blocks."""
    hashes = block_hashes(ids, 4)
    use = cache.lookup(hashes, len(ids))
    for end in range(8, len(ids) + 1, 8):
        cache.save_checkpoint(use, end, _state(value + end))
    cache.store(use, _state(value))
    return hashes


def test_block_hashes_chain_the_prefix_and_the_salt():
    a, b = block_hashes(list(range(12)), 4), block_hashes([0, 1, 2, 3, 9, 5, 6, 7, 8, 9, 10, 11], 4)
    assert len(a) == 3 and a[0] == b[0] and a[1] != b[1] and a[2] != b[2]   # a changed block changes all after it
    assert block_hashes(list(range(12)), 4, b"image")[0] != a[0]
    assert block_hashes(list(range(11)), 4) == a[:2]                     # only full blocks


def test_a_prompt_resumes_at_its_deepest_cached_checkpoint_before_its_last_token():
    cache = _cache(slots=4)
    ids = list(range(24))
    hashes = _store(cache, ids, 1.0)
    exact = cache.lookup(hashes, 24)   # the checkpoint at 24 would leave no token to compute the logits of
    assert exact.tokens == 16 and torch.equal(exact.checkpoint[0], _state(17.0)[2])
    state = [torch.zeros(1, 1, 1, 32, 2), torch.zeros(1, 1, 1, 32, 2), None, None]
    cache.restore(exact, state)
    assert state[0][..., :16, :].eq(1.0).all() and state[0][..., 16:, :].eq(0).all() and state[1][..., 0, 0] == -1
    longer = block_hashes(ids + [99] * 8, 4)
    assert cache.lookup(longer, 32).tokens == 24
    other = block_hashes([5] + ids[1:], 4)
    assert cache.lookup(other, 24).tokens == 0
    assert cache.stats.hits == 2 and cache.stats.cached_tokens == 40


def test_eviction_is_least_recently_used_deepest_first_and_a_checkpoint_goes_with_its_block():
    cache = _cache(slots=2, blocks=8)
    first = _store(cache, list(range(24)), 1.0)      # checkpoints at 8, 16, 24: it keeps 16 (before its last token)
    assert cache.stats.checkpoints == 2 and cache.stats.evicted_checkpoints == 0   # and 24; 8 is never taken
    assert cache.lookup(first, 24).tokens == 16
    second = _store(cache, list(range(100, 116)), 2.0)   # 4 blocks and 2 checkpoints: the first prompt's go first
    assert cache.stats.blocks == 8 and cache.stats.evicted_blocks == 2 and cache.stats.checkpoints == 2
    assert cache.lookup(second, 16).tokens == 8
    assert cache.lookup(first, 24).tokens == 0       # its checkpoints are gone, and its deepest blocks with them
    assert cache.stats.peak_bytes <= cache.stats.budget_bytes


# --- the runtime's prefill over a stand-in model ------------------------------------------------------------------

MODULUS = 2 ** 31 - 1


def _hash(state: int, tokens: list[int]) -> int:
    for t in tokens:
        state = (state * 1_000_003 + t + 1) % MODULUS
    return state


class StandIn(Runtime):
    """The runtime's prefill and prefix cache over a stand-in model (see the module docstring); batch 1, every prompt
    cut on the grid of the recipe's step, as a bundle with a prefix cache cuts it."""

    def __init__(self, spec: PrefixCacheSpec, seq_len: int, chunk: int):
        self.long_context, self.cte, self.tkg, self.batch = LongContext(chunk, spec), [chunk], [seq_len], 1
        self.arch, self.embeds = SimpleNamespace(mrope_section=None), False
        # one attention cache of a token per slot, and one "DeltaNet" state: the hash of every token so far
        signature = {"state_names": ["layers.0.k_cache", "layers.1.deltanet"],
                     "state": [[[1, 1, 1, chunk, 1], "int64"], [[1], "int64"]]}
        self.state = HostState(signature, seq_len)
        self.prefix_cache = self.state.prefix_cache(self.long_context)
        assert isinstance(self.prefix_cache, PrefixCache)

    def _first_piece(self, tokens, positions, end: int):
        state = [torch.zeros(*shape, dtype=dtype) for shape, dtype in self.state.shapes()]
        return self._extend(tokens, positions, 0, end, state)

    def _extend(self, tokens, positions, start: int, end: int, state: list):
        piece = tokens[0, start:end]
        state[0][0, 0, 0, start:end, 0] = piece
        state[1] = torch.tensor([_hash(int(state[1][0]), piece.tolist())])
        return torch.zeros(1, end - start, 1), state

    def serve(self, ids: list[int]) -> int:
        """Prefill `ids` with the cache as a request does; the tokens taken from the cache. The end state must be the
        whole prompt's, however much of it came from the cache."""
        _, state, _, cached = self._prefill(ids, None, True)
        n = len(ids)
        assert state[0][0, 0, 0, :n, 0].tolist() == ids and not state[0][0, 0, 0, n:, 0].any()
        assert int(state[1][0]) == _hash(0, ids)
        return cached


ISSUE = PrefixCacheSpec(block_size=16, num_blocks=16, checkpoint_interval=32, checkpoint_slots=3)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def test_a_request_never_evicts_its_own_prefix_to_store_its_tail():
    """P (192 tokens), D (96 others), then Q = P[:160] + 40 new tokens, twice. D's three checkpoints take every slot,
    so Q finds nothing to resume; but storing Q must evict D's entries, not Q's own prefix blocks (P's first 10,
    which Q shares): its 12 blocks fit in 16, so the repeat resumes at Q's deepest checkpoint before its last token.
    Before, Q's new blocks evicted its own blocks 8 and 9 and the repeat resumed at 128."""
    runtime = StandIn(ISSUE, seq_len=256, chunk=64)
    p, d = _tokens(192, 1), _tokens(96, 2)
    q = p[:160] + _tokens(40, 3)
    assert [runtime.serve(ids) for ids in (p, d, q, q)] == [0, 0, 0, 192]


def test_the_exact_repeat_of_the_request_just_served_resumes():
    """P (200), D (192), then A = P[:160] + 40, three times, then B sharing A's first 160 tokens. D keeps 4 of P's
    blocks; A resumes nothing, and storing A must not evict the 4 blocks it shares with P. Before, they went first
    and A's repeat resumed nothing at all."""
    runtime = StandIn(ISSUE, seq_len=256, chunk=64)
    p, d = _tokens(200, 4), _tokens(192, 5)
    a = p[:160] + _tokens(40, 6)
    b = a[:160] + _tokens(30, 7)
    assert [runtime.serve(ids) for ids in (p, d, a, a, a, b)] == [0, 0, 0, 192, 192, 160]


def test_a_prompt_sharing_a_prefix_with_the_last_one_resumes_inside_it():
    """Requests sharing a system prompt of 64 tokens: the second finds its blocks but no checkpoint there (the first
    kept its three deepest), and keeps one at 64, where every later one resumes. A prompt sharing 160 tokens with the
    one just served resumes at 160. Before, each kept its deepest checkpoints only and took the slots of the one
    before, so none resumed at all."""
    runtime = StandIn(ISSUE, seq_len=256, chunk=64)
    system = _tokens(64, 8)
    assert [runtime.serve(system + _tokens(100 + 20 * (seed % 3), seed)) for seed in range(9, 14)] == [0, 0, 64, 64, 64]
    last = system + _tokens(136, 20)
    assert runtime.serve(last) == 64
    assert runtime.serve(last[:160] + _tokens(40, 21)) == 160


# --- a randomised model of requests against a reference policy ----------------------------------------------------

class Reference:
    """The policy of docs/long-context.md section 3, written as plainly as possible. Every entry (a block, or a
    checkpoint, both keyed by a block hash) records the number of the request that last used it and its depth; when
    one must go, it is the one whose last use is oldest, the deepest of that use, never one the current request
    keeps. A checkpoint goes with its block.

    A request of n tokens resumes at r, its deepest cached checkpoint within its run of cached blocks and before its
    last token; that run, floored to the interval and before the last token, ends at s (s >= r). Its candidates are
    the multiples of the interval in (r, limit], limit being n or what num_blocks blocks hold; it keeps, while the
    slots last: the deepest candidate before its last token, s, then the other candidates deepest first; and its
    blocks up to the deepest checkpoint it keeps."""

    def __init__(self, spec: PrefixCacheSpec):
        self.spec = spec
        self.blocks: dict[bytes, tuple[int, int]] = {}        # hash -> (last use, depth in tokens)
        self.checkpoints: dict[bytes, tuple[int, int]] = {}
        self.uses = 0

    def plan(self, hashes: list[bytes], n: int) -> tuple[int, list[int]]:
        size, interval = self.spec.block_size, self.spec.checkpoint_interval
        r = resumes_at(self.spec, self.blocks, self.checkpoints, hashes, n)
        shared = min(_present(self.blocks, hashes) * size, n - 1) // interval * interval
        limit = min(n, self.spec.num_blocks * size) // interval * interval
        candidates = list(range(limit, r, -interval))
        first = [p for p in candidates if p <= n - 1][:1]
        order = first + ([shared] if shared and shared not in first else [])
        order += [p for p in candidates if p not in order]
        return r, order[:self.spec.checkpoint_slots]

    def _evict(self, entries: dict, kept: set[bytes]) -> bytes:
        victim = min((k for k in entries if k not in kept), key=lambda k: (entries[k][0], -entries[k][1]))
        del entries[victim]
        return victim

    def serve(self, hashes: list[bytes], n: int) -> int:
        size = self.spec.block_size
        self.uses += 1
        r, keep = self.plan(hashes, n)
        kept_checkpoints = {hashes[p // size - 1] for p in keep}
        depth = max(keep, default=0) // size
        kept_blocks = set(hashes[:depth])
        for p in sorted(keep):
            key = hashes[p // size - 1]
            if p > r and key not in self.checkpoints:
                if len(self.checkpoints) >= self.spec.checkpoint_slots:
                    self._evict(self.checkpoints, kept_checkpoints)
                self.checkpoints[key] = (self.uses, p)
        for j, key in enumerate(hashes[:depth]):
            if key not in self.blocks:
                if len(self.blocks) >= self.spec.num_blocks:
                    self.checkpoints.pop(self._evict(self.blocks, kept_blocks), None)
                self.blocks[key] = (self.uses, (j + 1) * size)
        for j, key in enumerate(hashes[:depth]):
            self.blocks[key] = (self.uses, (j + 1) * size)
        for p in keep:
            self.checkpoints[hashes[p // size - 1]] = (self.uses, p)
        return r


def resumes_at(spec: PrefixCacheSpec, blocks, checkpoints, hashes: list[bytes], n: int) -> int:
    """Where a prompt of n tokens (its full blocks' `hashes`) resumes, given the cached blocks' and checkpoints' keys:
    at its deepest checkpoint within its run of cached blocks, before its last token."""
    size, interval = spec.block_size, spec.checkpoint_interval
    present = _present(blocks, hashes)
    return max((p for p in range(interval, min(present * size, n - 1) + 1, interval)
                if hashes[p // size - 1] in checkpoints), default=0)


def _present(blocks, hashes: list[bytes]) -> int:
    present = 0
    while present < len(hashes) and hashes[present] in blocks:
        present += 1
    return present


def _requests(rng: random.Random, seq_len: int, count: int):
    """Prompts as a server sees them: a few system prompts shared by many, continued by fresh text; exact repeats;
    the next turn of an earlier prompt (it, then more); strangers; some of them longer than the blocks hold."""
    systems = [[rng.randrange(1000) for _ in range(rng.randrange(8, 80))] for _ in range(3)]
    served: list[list[int]] = []
    for _ in range(count):
        kind = rng.random()
        if served and kind < 0.2:
            ids = list(rng.choice(served))
        elif served and kind < 0.4:
            ids = rng.choice(served) + [rng.randrange(1000) for _ in range(rng.randrange(1, 60))]
        elif kind < 0.8:
            ids = rng.choice(systems) + [rng.randrange(1000) for _ in range(rng.randrange(1, 120))]
        else:
            ids = [rng.randrange(1000) for _ in range(rng.randrange(1, seq_len))]
        ids = ids[:seq_len - 1]
        served.append(ids)
        yield ids


SPECS = [PrefixCacheSpec(16, 16, 32, 3), PrefixCacheSpec(8, 32, 16, 2), PrefixCacheSpec(8, 24, 8, 1),
         PrefixCacheSpec(4, 40, 16, 4), PrefixCacheSpec(16, 20, 16, 5)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"b{s.block_size}-n{s.num_blocks}-i{s.checkpoint_interval}"
                                                      f"-s{s.checkpoint_slots}")
@pytest.mark.parametrize("seed", range(4))
def test_random_requests_follow_the_reference_policy_and_its_promises(spec, seed):
    seq_len = min(256, spec.block_size * spec.num_blocks)
    runtime = StandIn(spec, seq_len=seq_len, chunk=32)
    cache, reference = runtime.prefix_cache, Reference(spec)
    size, interval = spec.block_size, spec.checkpoint_interval
    served: list[list[bytes]] = []
    last = None
    for i, ids in enumerate(_requests(random.Random(seed), seq_len, 150)):
        hashes, n = block_hashes(ids, size), len(ids)
        _, keep = reference.plan(hashes, n)
        shared = min(_present(cache._blocks, hashes) * size, n - 1) // interval * interval
        cached = runtime.serve(ids)
        assert cached == reference.serve(hashes, n), i
        assert set(cache._blocks) == set(reference.blocks) and set(cache._checkpoints) == set(reference.checkpoints)
        served.append(hashes)
        # its own prefix: every block up to its deepest kept checkpoint, and the checkpoints it kept
        assert _present(cache._blocks, hashes) >= max(keep, default=0) // size, i
        assert all(hashes[p // size - 1] in cache._checkpoints for p in keep), i
        # a repeat of it would resume at its deepest checkpoint that fits, before its last token
        deepest = min(n - 1, spec.num_blocks * size) // interval * interval
        assert resumes_at(spec, cache._blocks, cache._checkpoints, hashes, n) == deepest, i
        if last is not None and ids == last:
            assert cached == deepest, i
        # the prefix it shares with the prompts before it (where it resumed, or found blocks without a checkpoint)
        # is resumable now, where two slots hold it and the deepest checkpoint
        if shared and spec.checkpoint_slots >= 2:
            assert resumes_at(spec, cache._blocks, cache._checkpoints, hashes, shared + 1) == shared, i
        # no block of any prompt without the blocks before it, no checkpoint without its block
        assert all(sum(h in cache._blocks for h in chain) == _present(cache._blocks, chain) for chain in served), i
        assert all(key in cache._blocks for key in cache._checkpoints), i
        assert cache.stats.peak_bytes <= cache.stats.budget_bytes
        last = ids
    assert cache.stats.hits > 0 and cache.stats.evicted_blocks > 0
