"""The host's state of one generation: the full KV caches (seq_len slots, as NxDI's) and the DeltaNet states, in the
order of a graph's state signature. Each graph was compiled with its bucket as KV length, so a call gets the caches
cut to that bucket and its result is written back; DeltaNet states do not depend on the bucket. A prefix cache
(qbuild.model.runtime.prefix_cache) keeps and restores slices of this state."""

from __future__ import annotations


class HostState:
    def __init__(self, signature: dict, kv_len: int):
        """`signature`: a CTE graph's (its state's names, shapes and dtypes); `kv_len`: the full KV length (the
        largest token-generation bucket)."""
        self.kv_len = kv_len
        self.attention = [i for i, name in enumerate(signature["state_names"])
                          if name.endswith(("k_cache", "v_cache"))]
        self._signature_state = signature["state"]

    def shapes(self) -> list[tuple[tuple[int, ...], object]]:
        """(shape, dtype) of each state tensor, attention caches at the full KV length."""
        import torch

        attention = set(self.attention)
        shapes = []
        for i, (shape, dtype) in enumerate(self._signature_state):
            if i in attention:
                shape = [*shape[:3], self.kv_len, shape[4]]
            shapes.append((tuple(shape), getattr(torch, dtype)))
        return shapes

    def prefix_cache(self, long_context):
        """A prefix cache of this state, for a bundle whose long-context plan has one; None otherwise."""
        if long_context is None or long_context.prefix_cache is None:
            return None
        from qbuild.model.runtime.prefix_cache import PrefixCache

        shapes = self.shapes()
        deltanet = [i for i in range(len(shapes)) if i not in self.attention]
        return PrefixCache(long_context.prefix_cache, self.attention, deltanet, shapes)

    def resumed(self, cache, use) -> list:
        """The state at a cached checkpoint: its blocks' KV in the full caches (zeros past them, as a cold prefill
        leaves them) and its DeltaNet state."""
        import torch

        state = [torch.zeros(shape, dtype=dtype) for shape, dtype in self.shapes()]
        cache.restore(use, state)
        return state

    def full(self, state: list, real: int) -> list:
        """Prefill's caches (KV length = its bucket) -> the full caches, holding the slots of the `real` tokens only:
        a resumed prefill finds zeros past its cached blocks, and a cold one must find the same."""
        import torch

        for i in self.attention:
            cache = state[i]
            full = torch.zeros(*cache.shape[:3], self.kv_len, cache.shape[4], dtype=cache.dtype)
            full[:, :, :, :real] = cache[:, :, :, :real]
            state[i] = full
        return state

    def call(self, graph, weights, bucket: int, state: list, *args):
        """Call `graph`, which takes (weights, *args, state with the caches cut to its KV bucket) and returns (logits,
        state); its caches are written back into the full ones."""
        cut = [s[:, :, :, :bucket].contiguous() if i in self.attention else s for i, s in enumerate(state)]
        logits, new = graph(weights, *args, tuple(cut))
        new = list(new)
        attention = set(self.attention)
        for i in range(len(state)):
            if i in attention:
                state[i][:, :, :, :bucket] = new[i]
            else:
                state[i] = new[i]
        return logits, state
