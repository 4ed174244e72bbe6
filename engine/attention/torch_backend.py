"""Reference attention in plain PyTorch: runs anywhere, and is what the Triton kernels are checked against.

KV cache layout, per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 holds K, 1 holds V), each block contiguous but blocks a whole cross-layer
block apart (engine/kv_cache_layout.py). Slot ``s`` is token ``s % block_size`` of
block ``s // block_size``.

A quantized cache (engine/kv_cache_dtype.py: a layer view of dtype int8 or float8_e4m3fn, rows of
``head_dim + 4`` bytes) is written through :func:`engine.kv_cache_dtype.quantize`; decodes read it
through the native kernel, which dequantizes in registers; prefills behind a cached prefix, and the
pure-PyTorch decode fallback, dequantize the context they gather (a full-precision copy of it,
as the fallback already makes of the gathered blocks for any dtype).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import cpu_kernels
from engine.attention.metadata import AttentionMetadata
from engine.kv_cache_dtype import dequantize, layer_format, quantize, round_trip
from engine.kv_cache_utils import cdiv


def write_kv(layer_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V into their cache slots.

    layer_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], or quantized rows [..., head_dim + 4]
    key, value: [num_tokens, num_kv_heads, head_dim]
    slot_mapping: [num_tokens] int64
    """
    # Indexed by (block, offset): blocks are not one layer's block apart, so slots are not one flat axis.
    block_size = layer_cache.shape[2]
    slots = (slot_mapping // block_size, slot_mapping % block_size)
    value_dtype = layer_format(layer_cache)
    if value_dtype is not None:
        layer_cache = layer_cache.view(torch.uint8)
        key, value = quantize(key, value_dtype), quantize(value, value_dtype)
    layer_cache[0].index_put_(slots, key)
    layer_cache[1].index_put_(slots, value)


def gather_context(
    layer_cache: torch.Tensor, block_table: torch.Tensor, context_len: int, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K and V, each [context_len, num_kv_heads, head_dim], read from its blocks: in
    the cache's dtype, or for a quantized cache dequantized to ``dtype`` (the query's)."""
    block_size, num_kv_heads, row = layer_cache.shape[2:]
    num_blocks = cdiv(context_len, block_size)
    blocks = layer_cache[:, block_table[:num_blocks]]  # [2, n, block_size, H, row]
    blocks = blocks.reshape(2, num_blocks * block_size, num_kv_heads, row)[:, :context_len]
    value_dtype = layer_format(layer_cache)
    if value_dtype is not None:
        if dtype is None:
            raise RuntimeError("gather_context of a quantized cache needs the dtype to dequantize to (bug)")
        blocks = dequantize(blocks, value_dtype, dtype)
    return blocks[0], blocks[1]


def decode_attention_bias(seq_lens: torch.Tensor, num_heads: int, num_kv_heads: int, padded_len: int) -> torch.Tensor:
    """Additive float32 mask [num_seqs, num_heads, padded_len * num_kv_heads] for
    :func:`paged_decode_attention`: 0 where query head h may attend (its own KV head,
    a position inside the sequence), -inf elsewhere. Depends only on the step's
    sequence lengths, so it is built once per step and shared by every layer."""
    group = num_heads // num_kv_heads
    device = seq_lens.device
    own_kv_head = (
        torch.arange(num_kv_heads, device=device)[None, :] == (torch.arange(num_heads, device=device) // group)[:, None]
    )
    in_sequence = torch.arange(padded_len, device=device)[None, :] < seq_lens[:, None]  # [num_seqs, padded_len]
    allowed = own_kv_head[None, :, None, :] & in_sequence[:, None, :, None]  # [num_seqs, H, padded_len, H_kv]
    bias = torch.zeros(allowed.shape, dtype=torch.float32, device=device)
    return bias.masked_fill_(~allowed, float("-inf")).view(len(seq_lens), num_heads, padded_len * num_kv_heads)


def paged_decode_attention(
    query: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one query token per sequence over its whole cached context.

    query: [num_seqs, num_heads, head_dim]; block_tables: [num_seqs, num_blocks];
    bias: from :func:`decode_attention_bias` for num_blocks * block_size positions.
    Returns [num_seqs, num_heads, head_dim].

    Every query head is scored against every KV head of its sequence, and the bias
    keeps only its own: 3x (the GQA group) more multiply-adds than needed, but two
    plain batched matmuls over the gathered blocks without any transpose copy. On
    CPU, SDPA with a padding mask takes a slow generic path instead (docs/benchmarks.md,
    "What moved the figure").
    """
    num_seqs, num_heads, head_dim = query.shape
    # Gather the sequences' blocks: [2, num_seqs * num_blocks, block_size * H_kv * row]
    kv = layer_cache.flatten(2).index_select(1, block_tables.flatten())
    kv = kv.view(2, num_seqs, -1, layer_cache.shape[-1])  # [2, num_seqs, padded_len * H_kv, row]: (position, kv head)
    value_dtype = layer_format(layer_cache)
    if value_dtype is not None:
        kv = dequantize(kv, value_dtype, query.dtype)  # rows of head_dim values
    scores = torch.bmm(query, kv[0].transpose(1, 2)).float()  # [num_seqs, H, padded_len * H_kv]
    scores.mul_(scale).add_(bias)
    probs = torch.softmax(scores, dim=-1).to(query.dtype)
    return torch.bmm(probs, kv[1])


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    num_prefix_tokens: int,
) -> torch.Tensor:
    """Causal attention of ``q_len`` new tokens over ``num_prefix_tokens`` cached tokens plus themselves,
    for ``n`` sequences of equal lengths at once.

    query: [n, q_len, num_heads, head_dim]; key, value: [n, num_prefix_tokens + q_len, num_kv_heads, head_dim].
    Returns [n, q_len, num_heads, head_dim].
    """
    q_len, num_heads = query.shape[1:3]
    kv_len, num_kv_heads = key.shape[1:3]
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
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
    return out.transpose(1, 2)


def prefill_runs(metadata: AttentionMetadata) -> list[tuple[int, int, int, int]]:
    """The step's prefills as runs ``(first_seq, num_seqs, q_len, num_prefix_tokens)``.

    Consecutive prefills with no cached prefix and the same length form one run,
    computed in one batched SDPA call (their tokens are adjacent in the batch);
    a prefill behind a cached prefix is a run of its own.
    """
    runs: list[tuple[int, int, int, int]] = []
    starts, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    for i in range(metadata.num_decodes, metadata.num_seqs):
        q_len = starts[i + 1] - starts[i]
        num_prefix_tokens = seq_lens[i] - q_len
        if runs and num_prefix_tokens == 0 and runs[-1][2:] == (q_len, 0):
            first, count, _, _ = runs[-1]
            runs[-1] = (first, count + 1, q_len, 0)
        else:
            runs.append((i, 1, q_len, num_prefix_tokens))
    return runs


class TorchAttentionBackend:
    """Paged attention: one batched call for all decodes, one per run of alike prefills.

    On CPU, the new K/V rows are stored and decodes attend through the native kernels of
    :mod:`engine.cpu_kernels` when they could be built (they read and write the paged
    cache in place, one call each per layer); otherwise, and on other devices, through
    :func:`write_kv` and :func:`paged_decode_attention`.
    """

    name = "torch"

    def __init__(self, use_cpu_kernels: bool = True) -> None:
        self.cpu_kernels = cpu_kernels.load() if use_cpu_kernels else None

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
        if not (
            self.cpu_kernels is not None
            and key.device.type == "cpu"
            and self.cpu_kernels.store_kv(layer_cache, key, value, metadata.slot_mapping)
        ):
            write_kv(layer_cache, key, value, metadata.slot_mapping)
        num_decodes = metadata.num_decodes
        decode_output = self._decode(query[:num_decodes], layer_cache, metadata, scale) if num_decodes else None
        if num_decodes == metadata.num_seqs:
            return decode_output
        output = torch.empty_like(query)
        if decode_output is not None:
            output[:num_decodes] = decode_output
        value_dtype = layer_format(layer_cache)
        starts = metadata.query_start_loc_cpu
        for first, count, q_len, num_prefix_tokens in prefill_runs(metadata):
            start, end = starts[first], starts[first + count]
            q = query[start:end].unflatten(0, (count, q_len))
            if num_prefix_tokens == 0:
                k, v = key[start:end].unflatten(0, (count, q_len)), value[start:end].unflatten(0, (count, q_len))
                if value_dtype is not None:  # as the cache holds them, which later steps read
                    k, v = round_trip(k, value_dtype), round_trip(v, value_dtype)
            else:
                k, v = gather_context(
                    layer_cache, metadata.block_tables[first], metadata.seq_lens_cpu[first], query.dtype
                )
                k, v = k[None], v[None]
            output[start:end] = prefill_attention(q, k, v, scale, num_prefix_tokens).flatten(0, 1)
        return output

    def _decode(
        self, query: torch.Tensor, layer_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        num_decodes = metadata.num_decodes
        if self.cpu_kernels is not None and query.device.type == "cpu" and self.cpu_kernels.supports(query.dtype):
            output = self.cpu_kernels.paged_decode_attention(
                query, layer_cache, metadata.block_tables, metadata.seq_lens[:num_decodes], scale
            )
            if output is not None:
                return output
        block_size, num_kv_heads = layer_cache.shape[2], layer_cache.shape[3]
        num_blocks = cdiv(max(metadata.seq_lens_cpu[:num_decodes]), block_size)
        if metadata.decode_bias is None:
            metadata.decode_bias = decode_attention_bias(
                metadata.seq_lens[:num_decodes], query.shape[1], num_kv_heads, num_blocks * block_size
            )
        block_tables = metadata.block_tables[:num_decodes, :num_blocks]
        return paged_decode_attention(query, layer_cache, block_tables, metadata.decode_bias, scale)
