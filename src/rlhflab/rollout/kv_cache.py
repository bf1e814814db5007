"""A KV cache with preallocated buffers for the sampler.

transformers' `DynamicCache` grows every layer's keys and values with `torch.cat` at every decoding
step, which copies the whole cache each time: O(T²) memory traffic, and on CPU the largest single
cost of sampling (measured: `aten::cat` was 55% of a 64 × 64-token rollout of the 4.2 M model).
`preallocated_cache` returns a `DynamicCache` whose full-attention layers write each step's keys
and values in place into buffers sized for the whole rollout (prompt width + max_new_tokens) and
hand attention a view of the filled part. The values attention sees are the same; only the copies
are gone. Dropping finished rows (`batch_select_indices`) indexes the buffers once.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """A `DynamicLayer` backed by a (B, H, capacity, D) buffer instead of a growing tensor."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """transformers' cache-layer API: write the new (b, h, n, d) keys/values in place after
        the `length` cached ones; returns views of all cached keys and values so far."""
        n = key_states.shape[-2]
        if self._k is None:
            self.dtype, self.device = key_states.dtype, key_states.device
            b, h, _, d = key_states.shape
            shape = (b, h, max(self.capacity, n), d)
            self._k = key_states.new_empty(shape)
            self._v = value_states.new_empty(
                (b, value_states.shape[1], shape[2], value_states.shape[-1])
            )
            self.is_initialized = True
        if self.length + n > self._k.shape[-2]:  # beyond the planned size: grow (never in sample())
            grow = self.length + n - self._k.shape[-2]
            self._k = torch.cat(
                [self._k, self._k.new_empty((*self._k.shape[:2], grow, self._k.shape[-1]))], -2
            )
            self._v = torch.cat(
                [self._v, self._v.new_empty((*self._v.shape[:2], grow, self._v.shape[-1]))], -2
            )
        self._k[:, :, self.length : self.length + n] = key_states
        self._v[:, :, self.length : self.length + n] = value_states
        self.length += n
        self.keys = self._k[:, :, : self.length]
        self.values = self._v[:, :, : self.length]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        """Cached positions so far."""
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows `indices` (the sampler drops finished sequences)."""
        if self._k is None:
            return
        self._k = self._k[indices]
        self._v = self._v[indices]
        self.keys = self._k[:, :, : self.length]
        self.values = self._v[:, :, : self.length]

    def reset(self) -> None:
        """Forget every cached position (buffers are allocated again at the next update)."""
        self._k = self._v = None
        self.length = 0
        super().reset()


def preallocated_cache(config, capacity: int) -> DynamicCache:
    """A `DynamicCache` for `config` whose plain (full-attention) layers preallocate `capacity`
    positions; any other layer kind (sliding window, ...) keeps transformers' own layer."""
    cache = DynamicCache(config=config)
    cache.layers = [
        PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer
        for layer in cache.layers
    ]
    return cache


def static_cache(config, capacity: int):
    """transformers' `StaticCache` of `capacity` positions: (B, H, capacity, D) buffers per layer,
    allocated at the first update and written in place at a device-side position counter, so a
    decode step has fixed shapes and no host-side index (what a CUDA graph needs)."""
    from transformers.cache_utils import StaticCache

    return StaticCache(config=config, max_cache_len=capacity)


def select_static_rows(cache, index: torch.Tensor) -> None:
    """Keep only the batch rows `index` ((b,) long) of every layer of a `static_cache` (new
    buffers: a CUDA graph captured on the old ones must be captured again)."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False):
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)
            if hasattr(layer, "batch_size"):
                layer.batch_size = index.numel()


class PrefixStore:
    """The KV caches of finished sequences, kept so that a later prompt which extends one of
    them starts from its cache instead of being prefilled again (KV reuse across the turns of
    a multi-turn episode: the next turn's prompt is the history, the last model turn and the
    observation).

    An entry is one sequence's real tokens (no padding) and, per cache layer, its keys and
    values of shape (H, L, D) for those L tokens, in the cache's dtype. Keys and values depend
    on a token's position id and on the tokens before it only, never on where it sat in a padded
    batch, so an entry can be placed at any column of a later batch (`rlhflab.rollout.sampler`).

    `take` hands an entry out once (the episode continues from it and a new entry is stored at
    the end of its next turn); entries nobody takes are freed with the store.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[int, ...], list[list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        self._lengths: set[int] = set()

    def put(self, tokens: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep `layers` ((keys, values) of shape (H, len(tokens), D) per cache layer) as the
        cache of `tokens`. Raises ValueError when their length is not len(tokens)."""
        if any(k.shape[-2] != len(tokens) or v.shape[-2] != len(tokens) for k, v in layers):
            raise ValueError("PrefixStore.put: keys/values must cover exactly the tokens given")
        self._entries.setdefault(tuple(tokens), []).append(layers)
        self._lengths.add(len(tokens))

    def take(self, prompt: list[int]) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """The longest stored entry that is a proper prefix of `prompt` (at least one token of
        the prompt is left to forward, for the next token's logits), removed from the store:
        (its length, its layers), or (0, None) when no entry is."""
        for n in sorted((n for n in self._lengths if n < len(prompt)), reverse=True):
            found = self._entries.get(tuple(prompt[:n]))
            if found:
                layers = found.pop()
                if not found:
                    del self._entries[tuple(prompt[:n])]
                return n, layers
        return 0, None

    def __len__(self) -> int:
        return sum(len(v) for v in self._entries.values())
