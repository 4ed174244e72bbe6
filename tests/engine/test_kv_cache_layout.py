"""The block-major KV cache: each block one contiguous span, each layer a strided view."""

from __future__ import annotations

import torch

from engine.kv_cache_layout import allocate_kv_cache, layer_view, layer_views


def test_a_block_holds_every_layer_in_one_contiguous_span() -> None:
    cache = allocate_kv_cache(5, 3, 4, 2, 8, torch.bfloat16, torch.device("cpu"))
    assert cache.shape == (5, 3, 2, 4, 2, 8) and not cache.any()
    layers = layer_views(cache)
    assert len(layers) == 3 and all(layer.shape == (2, 5, 4, 2, 8) for layer in layers)
    layers[2][1, 4, 3] = 7.0  # layer 2, V, block 4, token 3
    assert cache[4, 2, 1, 3].eq(7.0).all() and cache.count_nonzero() == 2 * 8
    span = cache[4].view(-1)  # block 4 alone, as a connector sends it
    assert span.data_ptr() == cache.data_ptr() + 4 * span.numel() * cache.element_size()
    assert layer_view(cache, 1)[0, 0].is_contiguous()  # a layer's K of one block: what kernels read as a run
    assert layer_view(cache, 1).stride(1) == cache.stride(0)  # blocks lie a whole cross-layer block apart
