"""The KV cache's memory layout: block-major, every block one contiguous span.

The whole cache is one tensor ``[num_blocks, num_layers, 2 (K, V), block_size,
num_kv_heads, head_dim]``. A block holds all layers' K and V for its ``block_size``
tokens in ``bytes_per_block`` consecutive bytes, so a KV connector moves a block as one
buffer, straight out of one cache and straight into another, with no gather or
scatter copy (as vLLM's cross-layer KV blocks do for the same reason). Attention sees
one layer at a time through :func:`layer_view`: ``[2, num_blocks, block_size,
num_kv_heads, head_dim]`` whose block stride spans all layers; within a block, each
layer's K (and V) is contiguous, which is all the kernels need.

With a quantized KV cache (engine/kv_cache_dtype.py) the tensor is ``uint8`` and its last axis
is a row of ``head_dim + 4`` bytes (the values, then their float32 scale); the layer views
carry the values' dtype (``torch.int8`` or ``torch.float8_e4m3fn``), which tells attention the
format. Connectors see bytes either way: a block is still one contiguous span.
"""

from __future__ import annotations

import torch

from engine.kv_cache_dtype import VALUE_DTYPES, KVCacheDType, KVCacheFormat


def allocate_kv_cache(
    num_blocks: int,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_dtype: KVCacheDType = "auto",
) -> torch.Tensor:
    """A zeroed cache in the layout above; ``dtype`` is the model's (what ``auto`` stores)."""
    kv_format = KVCacheFormat(kv_cache_dtype, dtype, head_dim)
    shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, kv_format.row_elements)
    return torch.zeros(shape, dtype=kv_format.cache_dtype, device=device)


def layer_view(kv_cache: torch.Tensor, layer: int, kv_cache_dtype: KVCacheDType = "auto") -> torch.Tensor:
    """Layer ``layer``'s K and V: a view ``[2, num_blocks, block_size, num_kv_heads, row]``, of the
    values' dtype when quantized (``row``: head_dim, or head_dim + 4 bytes)."""
    view = kv_cache[:, layer].transpose(0, 1)
    return view.view(VALUE_DTYPES[kv_cache_dtype]) if kv_cache_dtype != "auto" else view


def layer_views(kv_cache: torch.Tensor, kv_cache_dtype: KVCacheDType = "auto") -> list[torch.Tensor]:
    """Every layer's view, in order (what the model takes)."""
    return [layer_view(kv_cache, layer, kv_cache_dtype) for layer in range(kv_cache.shape[1])]
