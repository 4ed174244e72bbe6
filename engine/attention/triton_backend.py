"""Paged attention through Triton kernels: the GPU backend, checked on CPU against the torch reference."""

from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.triton_kernels import paged_attention, store_kv


class TritonAttentionBackend:
    """Store the step's K/V, then one varlen kernel launch for the whole batch (decodes and prefills alike).

    Same contract as ``TorchAttentionBackend``: the new tokens' K/V go into the
    cache first, so every sequence, with or without a cached prefix, reads its
    whole context from the paged cache.
    """

    name = "triton"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """query: [T, H, D]; key, value: [T, H_kv, D] (this step's new tokens). Returns [T, H, D].

        layer_cache: [2, num_blocks, block_size, H_kv, D], written in place.
        """
        store_kv(layer_cache, key, value, metadata.slot_mapping)
        return paged_attention(
            query,
            layer_cache,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            metadata.max_query_len,
            scale,
        )
