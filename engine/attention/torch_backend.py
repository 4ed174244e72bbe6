"""Reference attention in plain PyTorch: runs anywhere, and is what the Triton kernels are checked against.

KV cache layout, per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 holds K, 1 holds V). Slot ``s`` is token ``s % block_size`` of block
``s // block_size``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata


def write_kv(layer_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V into their cache slots.

    layer_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]
    key, value: [num_tokens, num_kv_heads, head_dim]
    slot_mapping: [num_tokens] int64
    """
    num_kv_heads, head_dim = layer_cache.shape[-2:]
    layer_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    layer_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def gather_context(layer_cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K and V, each [context_len, num_kv_heads, head_dim], read from its blocks."""
    block_size, num_kv_heads, head_dim = layer_cache.shape[2:]
    num_blocks = -(-context_len // block_size)
    blocks = layer_cache[:, block_table[:num_blocks]]  # [2, n, block_size, H, D]
    blocks = blocks.reshape(2, num_blocks * block_size, num_kv_heads, head_dim)[:, :context_len]
    return blocks[0], blocks[1]


def paged_decode_attention(
    query: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    """Attention of one query token per sequence over its whole cached context.

    query: [num_seqs, num_heads, head_dim]; block_tables: [num_seqs, >= ceil(max_seq_len / block_size)];
    seq_lens: [num_seqs]. Returns [num_seqs, num_heads, head_dim].
    """
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = layer_cache.shape[2], layer_cache.shape[3]
    num_blocks = -(-max_seq_len // block_size)
    padded_len = num_blocks * block_size
    # kv: [2, num_seqs, num_blocks, block_size, H_kv, D] -> [2, num_seqs, H_kv, padded_len, D]
    kv = layer_cache[:, block_tables[:, :num_blocks]]
    kv = kv.view(2, num_seqs, padded_len, num_kv_heads, head_dim).transpose(2, 3)
    positions = torch.arange(padded_len, device=query.device)
    mask = positions[None, :] < seq_lens[:, None]  # [num_seqs, padded_len]
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2),  # [num_seqs, H, 1, D]
        kv[0],
        kv[1],
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return out.squeeze(2)


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    num_prefix_tokens: int,
) -> torch.Tensor:
    """Causal attention of ``q_len`` new tokens over ``num_prefix_tokens`` cached tokens plus themselves.

    query: [q_len, num_heads, head_dim]; key, value: [num_prefix_tokens + q_len, num_kv_heads, head_dim].
    Returns [q_len, num_heads, head_dim].
    """
    q_len, num_heads, _ = query.shape
    kv_len, num_kv_heads, _ = key.shape
    q, k, v = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
    if num_prefix_tokens == 0:
        mask, is_causal = None, True
    else:
        # SDPA's is_causal aligns the diagonal top-left; with a cached prefix the
        # last query must see the last key, so the diagonal is shifted explicitly.
        rows = torch.arange(q_len, device=query.device)[:, None] + num_prefix_tokens
        mask, is_causal = torch.arange(kv_len, device=query.device)[None, :] <= rows, False
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=num_heads != num_kv_heads
    )
    return out.transpose(0, 1)


class TorchAttentionBackend:
    """Paged attention with a Python loop over prefills and one batched call for all decodes."""

    name = "torch"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """query: [T, H, D]; key, value: [T, H_kv, D] (this step's new tokens). Returns [T, H, D]."""
        write_kv(layer_cache, key, value, metadata.slot_mapping)
        num_decodes = metadata.num_decodes
        if num_decodes == metadata.num_seqs:
            return paged_decode_attention(
                query, layer_cache, metadata.block_tables, metadata.seq_lens, metadata.max_seq_len, scale
            )
        output = torch.empty_like(query)
        if num_decodes:
            decode_seq_lens = metadata.seq_lens_cpu[:num_decodes]
            output[:num_decodes] = paged_decode_attention(
                query[:num_decodes],
                layer_cache,
                metadata.block_tables[:num_decodes],
                metadata.seq_lens[:num_decodes],
                max(decode_seq_lens),
                scale,
            )
        starts = metadata.query_start_loc_cpu
        for i in range(num_decodes, metadata.num_seqs):
            start, end, context_len = starts[i], starts[i + 1], metadata.seq_lens_cpu[i]
            num_prefix_tokens = context_len - (end - start)
            if num_prefix_tokens == 0:
                k, v = key[start:end], value[start:end]
            else:
                k, v = gather_context(layer_cache, metadata.block_tables[i], context_len)
            output[start:end] = prefill_attention(query[start:end], k, v, scale, num_prefix_tokens)
        return output
