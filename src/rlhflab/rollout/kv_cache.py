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
