"""The KV cache's memory layout: block-major, every block one contiguous span.

The whole cache is one tensor ``[num_blocks, num_layers, 2 (K, V), block_size,
num_kv_heads, head_dim]``. A block holds all layers' K and V for its ``block_size``
tokens in ``bytes_per_block`` consecutive bytes, so a KV connector moves a block as one
buffer, straight out of one cache and straight into another, with no gather or
scatter copy (as vLLM's cross-layer KV blocks do for the same reason). Attention sees
one layer at a time through :func:`layer_view`: ``[2, num_blocks, block_size,
num_kv_heads, head_dim]`` whose block stride spans all layers; within a block, each
layer's K (and V) is contiguous, which is all the kernels need.
"""

from __future__ import annotations

import torch


def allocate_kv_cache(
    num_blocks: int,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """A zeroed cache in the layout above."""
    return torch.zeros((num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim), dtype=dtype, device=device)


def layer_view(kv_cache: torch.Tensor, layer: int) -> torch.Tensor:
    """Layer ``layer``'s K and V: a view ``[2, num_blocks, block_size, num_kv_heads, head_dim]``."""
    return kv_cache[:, layer].transpose(0, 1)


def layer_views(kv_cache: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's view, in order (what the model takes)."""
    return [layer_view(kv_cache, layer) for layer in range(kv_cache.shape[1])]
