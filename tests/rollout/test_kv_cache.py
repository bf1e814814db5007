"""The sampler's preallocated KV cache hands attention exactly what DynamicCache would."""

import torch
from transformers.cache_utils import DynamicLayer

from rlhflab.rollout.kv_cache import PreallocatedLayer, preallocated_cache


def test_preallocated_layer_matches_dynamic_layer():
    g = torch.Generator().manual_seed(0)
    a, b = PreallocatedLayer(capacity=6), DynamicLayer()
    for n in (3, 1, 1):
        k, v = torch.randn(4, 2, n, 8, generator=g), torch.randn(4, 2, n, 8, generator=g)
        ka, va = a.update(k, v)
        kb, vb = b.update(k, v)
        assert torch.equal(ka, kb) and torch.equal(va, vb)
        assert a.get_seq_length() == b.get_seq_length()
    keep = torch.tensor([0, 2])
    a.batch_select_indices(keep)
    b.batch_select_indices(keep)
    k, v = torch.randn(2, 2, 1, 8, generator=g), torch.randn(2, 2, 1, 8, generator=g)
    ka, va = a.update(k, v)
    kb, vb = b.update(k, v)
    assert torch.equal(ka, kb) and torch.equal(va, vb)
    # past the planned capacity it still grows correctly
    k, v = torch.randn(2, 2, 3, 8, generator=g), torch.randn(2, 2, 3, 8, generator=g)
    ka, _ = a.update(k, v)
    kb, _ = b.update(k, v)
    assert torch.equal(ka, kb) and a.get_seq_length() == 9


def test_preallocated_cache_replaces_full_attention_layers(tiny_model):
    cache = preallocated_cache(tiny_model.config, 16)
    assert len(cache.layers) == tiny_model.config.num_hidden_layers
    assert all(isinstance(layer, PreallocatedLayer) for layer in cache.layers)
