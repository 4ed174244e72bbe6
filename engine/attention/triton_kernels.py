"""Triton kernels for the paged KV cache: store new K/V, and one varlen paged attention for the whole step.

KV cache layout, per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 holds K, 1 holds V). Slot ``s`` is token ``s % block_size`` of block
``s // block_size``; this is the contract of ``engine.attention.torch_backend``,
against which these kernels are tested.

``paged_attention`` treats every sequence the same way: its ``q_len`` new query
tokens are the last ``q_len`` tokens of a context of ``seq_len`` tokens that is
already in the cache. A decode is ``q_len == 1``, a first prefill is
``q_len == seq_len``, a chunk of a prefill (or a prefill behind a prefix-cache
hit) is everything in between; one launch serves a mixed batch.

On CPU the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``),
whose ``tl.dot`` mishandles 16-bit floats (it multiplies their raw bits), so
there the operands are widened to fp32 first; see ``_dot``.

A quantized cache (engine/kv_cache_dtype.py: int8 or fp8 e4m3 values, a float32 scale after
each token-head row) is passed as two views of the same memory: its bytes, and float32 words
through which the scales are read. ``store_kv`` quantizes each row with the operations of
``engine.kv_cache_dtype.quantize`` (fp8 encoded with integer steps, not the hardware
conversion, so that the interpreter runs it). ``paged_attention`` widens the 8-bit values to
the query's dtype (exactly: both formats fit in bf16 and fp16) for the same ``tl.dot`` as an
unquantized cache, and applies each key row's scale to its scores and each value row's to its
softmax weights: nothing is dequantized into memory, for decodes and prefills alike. Tested
under the interpreter only: on a GPU the quantized paths are untested (Triton's fp32 division
there may also round a scale differently from torch's by an ulp).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kv_cache_dtype import SCALE_BYTES, layer_format

# Rows (query tokens x heads of one GQA group) one prefill program works on.
_PREFILL_BLOCK_M = 64
# Smallest tile for the K dimension of a 16-bit tl.dot on NVIDIA GPUs.
_MIN_DOT_SIZE = 16
# Keys per tile at least this many, so that small pages still feed the tensor cores.
_MIN_TILE_N = 32
# KV_FORMAT of the kernels: the cache's values as they are, or quantized rows (engine/csrc/kv_quant.h).
_KV_FORMATS = {torch.int8: 1, torch.float8_e4m3fn: 2}
_QMAX = {1: 127.0, 2: 448.0}


@triton.jit
def _float_to_fp8_e4m3(x):
    """float32 with |x| <= 448 -> fp8 e4m3 bits (as int32), to nearest even, as torch converts."""
    bits = x.to(tl.int32, bitcast=True)
    magnitude_bits = bits & 0x7FFFFFFF
    # Below 2^-6, fp8's smallest normal: adding 2^14 rounds to a multiple of 2^-9, its subnormal step.
    subnormal = (magnitude_bits.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    odd = (magnitude_bits >> 20) & 1
    normal = (magnitude_bits - (120 << 23) + 0x7FFFF + odd) >> 20  # rebias, round to 3 mantissa bits
    encoded = tl.where(magnitude_bits < (121 << 23), subnormal, normal)
    return encoded | tl.where(bits < 0, 128, 0)


@triton.jit
def _fp8_e4m3_to_float(bits):
    """fp8 e4m3 bits (int32) -> float32, exactly."""
    exponent = (bits >> 3) & 15
    mantissa = bits & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)
    return tl.where((bits & 128) != 0, -magnitude, magnitude)


@triton.jit
def _quantize_rows(x, KV_FORMAT: tl.constexpr, QMAX: tl.constexpr):
    """Rows x [R, D] float32 (masked entries 0) -> (their bytes [R, D] uint8, their scales [R])."""
    scale = tl.max(tl.abs(x), axis=1) / QMAX
    inverse = 1.0 / tl.where(scale > 0.0, scale, 1.0)
    scaled = tl.minimum(tl.maximum(x * inverse[:, None], -QMAX), QMAX)
    if KV_FORMAT == 1:
        # To nearest, ties to even (torch.round): adding 1.5 * 2^23 leaves no fraction bits.
        rounded = (scaled + 12582912.0) - 12582912.0
        encoded = rounded.to(tl.int32) & 0xFF
    else:
        encoded = _float_to_fp8_e4m3(scaled)
    return encoded.to(tl.uint8), scale


@triton.jit
def _dequantize_values(raw, KV_FORMAT: tl.constexpr):
    """Stored bytes (uint8) -> their values as float32, without the row's scale."""
    if KV_FORMAT == 1:
        return raw.to(tl.int8, bitcast=True).to(tl.float32)
    else:
        return _fp8_e4m3_to_float(raw.to(tl.int32))


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim (+ 4 bytes when quantized)]
    scale_ptr,  # quantized: the cache as float32 words (a row's scale is word SCALE_OFFSET); else unused
    slot_mapping_ptr,  # [num_tokens]
    stride_key_token,
    stride_key_head,
    stride_key_dim,
    stride_value_token,
    stride_value_head,
    stride_value_dim,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    stride_cache_dim,
    stride_scale_kv,
    stride_scale_block,
    stride_scale_token,
    stride_scale_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # next power of two >= NUM_KV_HEADS
    DIM_PAD: tl.constexpr,  # next power of two >= HEAD_DIM
    KV_FORMAT: tl.constexpr,  # 0: the cache's dtype as is; 1: int8 rows; 2: fp8 e4m3 rows
    QMAX: tl.constexpr,  # quantized: the format's largest magnitude
    SCALE_OFFSET: tl.constexpr,  # quantized: HEAD_DIM // 4, the scale's word in its row
):
    """One program per new token: copy (or quantize) its [num_kv_heads, head_dim] K and V into its slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block_id = slot // BLOCK_SIZE
    block_offset = slot % BLOCK_SIZE

    heads = tl.arange(0, HEADS_PAD)  # [HEADS_PAD]
    dims = tl.arange(0, DIM_PAD)  # [DIM_PAD]
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)  # [HEADS_PAD, DIM_PAD]

    key = tl.load(
        key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :] * stride_key_dim,
        mask=mask,
        other=0.0,
    )
    value = tl.load(
        value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :] * stride_value_dim,
        mask=mask,
        other=0.0,
    )
    # K and V live in one tensor (one kernel argument): V is K's slot moved by stride_cache_kv.
    slot_ptr = (
        cache_ptr
        + block_id * stride_cache_block
        + block_offset * stride_cache_token
        + heads[:, None] * stride_cache_head
        + dims[None, :] * stride_cache_dim
    )
    if KV_FORMAT == 0:
        tl.store(slot_ptr, key.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(slot_ptr + stride_cache_kv, value.to(cache_ptr.dtype.element_ty), mask=mask)
    else:
        key_bytes, key_scale = _quantize_rows(key.to(tl.float32), KV_FORMAT, QMAX)
        value_bytes, value_scale = _quantize_rows(value.to(tl.float32), KV_FORMAT, QMAX)
        tl.store(slot_ptr, key_bytes, mask=mask)
        tl.store(slot_ptr + stride_cache_kv, value_bytes, mask=mask)
        scale_slot_ptr = (
            scale_ptr
            + block_id * stride_scale_block
            + block_offset * stride_scale_token
            + heads * stride_scale_head
            + SCALE_OFFSET
        )
        tl.store(scale_slot_ptr, key_scale, mask=heads < NUM_KV_HEADS)
        tl.store(scale_slot_ptr + stride_scale_kv, value_scale, mask=heads < NUM_KV_HEADS)


@triton.jit
def _dot(a, b, WIDEN_TO_FP32: tl.constexpr):
    """a @ b with fp32 accumulation.

    With WIDEN_TO_FP32 the operands are widened and multiplied exactly (IEEE,
    not TF32): for fp32 inputs, and under the interpreter, whose tl.dot reads
    bf16/fp16 as raw integers. Otherwise 16-bit operands go to the tensor cores
    as they are; their products are exact in fp32 either way.
    """
    if WIDEN_TO_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    query_ptr,  # [num_tokens, num_heads, head_dim]
    cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim (+ 4 bytes when quantized)]
    scale_ptr,  # quantized: the cache as float32 words (a row's scale is word SCALE_OFFSET); else unused
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # [num_seqs]
    query_start_loc_ptr,  # [num_seqs + 1]
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    stride_out_token,
    stride_out_head,
    stride_out_dim,
    stride_query_token,
    stride_query_head,
    stride_query_dim,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    stride_cache_dim,
    stride_scale_kv,
    stride_scale_block,
    stride_scale_token,
    stride_scale_head,
    stride_block_tables_seq,
    NUM_QUERIES_PER_KV: tl.constexpr,  # num_heads // num_kv_heads
    HEADS_PAD: tl.constexpr,  # next power of two >= NUM_QUERIES_PER_KV
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows per program: >= BLOCK_Q * HEADS_PAD
    TILE_N: tl.constexpr,  # keys per inner step: a multiple of BLOCK_SIZE
    WIDEN_TO_FP32: tl.constexpr,
    KV_FORMAT: tl.constexpr,  # 0: the cache's dtype as is; 1: int8 rows; 2: fp8 e4m3 rows
    SCALE_OFFSET: tl.constexpr,  # quantized: HEAD_DIM // 4, the scale's word in its row
):
    """Grid (num_seqs, cdiv(max_query_len, BLOCK_Q), num_kv_heads).

    A program owns BLOCK_Q query tokens of one sequence for all the query heads
    that share one KV head, so each K/V tile is read once for the whole GQA
    group. Its BLOCK_M rows are (query token, head in group) pairs, row
    r = token * HEADS_PAD + head; spare rows are masked. It walks the context
    through the block table TILE_N keys at a time, up to the newest position
    its last query may see, with an online (flash-attention) softmax.
    """
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        # The grid is sized for the longest query of the batch; shorter ones
        # (all decodes, in a mixed batch) have nothing to do past their end.
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    num_prefix_tokens = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    q_idx = q_block * BLOCK_Q + rows // HEADS_PAD  # [BLOCK_M] query token within the sequence
    group_head = rows % HEADS_PAD  # [BLOCK_M]
    head = kv_head * NUM_QUERIES_PER_KV + group_head  # [BLOCK_M]
    row_valid = (rows // HEADS_PAD < BLOCK_Q) & (group_head < NUM_QUERIES_PER_KV) & (q_idx < q_len)
    # Causality: a query sees every context position up to its own.
    last_visible = num_prefix_tokens + q_idx  # [BLOCK_M]
    dims = tl.arange(0, HEAD_DIM)  # [HEAD_DIM]

    token = (q_start + q_idx).to(tl.int64)  # [BLOCK_M] index into the step's tokens
    q = tl.load(
        query_ptr
        + token[:, None] * stride_query_token
        + head[:, None] * stride_query_head
        + dims[None, :] * stride_query_dim,
        mask=row_valid[:, None],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM]

    # Running max (base 2), running denominator, unnormalised output. The max
    # starts finite so that a row with nothing visible yields 0, never NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # Keys past the newest position this program's last query sees are skipped.
    kv_end = tl.minimum(seq_len, num_prefix_tokens + (q_block + 1) * BLOCK_Q)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_block_tables_seq
    for tile_start in range(0, kv_end, TILE_N):
        kv_pos = tile_start + tl.arange(0, TILE_N)  # [TILE_N] context positions
        in_context = kv_pos < kv_end
        # One block id per key: a tile may span several small blocks.
        block_ids = tl.load(block_table_ptr + kv_pos // BLOCK_SIZE, mask=in_context, other=0).to(tl.int64)
        slot_offsets = (
            block_ids * stride_cache_block + (kv_pos % BLOCK_SIZE) * stride_cache_token + kv_head * stride_cache_head
        )  # [TILE_N]
        k_t = tl.load(
            cache_ptr + slot_offsets[None, :] + dims[:, None] * stride_cache_dim,
            mask=in_context[None, :],
            other=0.0,
        )  # [HEAD_DIM, TILE_N]
        # Masked keys must load as 0 too: 0 * garbage could be NaN.
        v = tl.load(
            cache_ptr + stride_cache_kv + slot_offsets[:, None] + dims[None, :] * stride_cache_dim,
            mask=in_context[:, None],
            other=0.0,
        )  # [TILE_N, HEAD_DIM]

        if KV_FORMAT == 0:
            scores = _dot(q, k_t, WIDEN_TO_FP32) * qk_scale  # [BLOCK_M, TILE_N]
        else:
            scale_offsets = (
                block_ids * stride_scale_block
                + (kv_pos % BLOCK_SIZE) * stride_scale_token
                + kv_head * stride_scale_head
                + SCALE_OFFSET
            )  # [TILE_N]
            k_scale = tl.load(scale_ptr + scale_offsets, mask=in_context, other=0.0)
            v_scale = tl.load(scale_ptr + stride_scale_kv + scale_offsets, mask=in_context, other=0.0)
            # The 8-bit values are exact in the query's dtype; each key row's scale scales its scores.
            k_t = _dequantize_values(k_t, KV_FORMAT).to(q.dtype)
            v = _dequantize_values(v, KV_FORMAT).to(q.dtype)
            scores = _dot(q, k_t, WIDEN_TO_FP32) * (k_scale[None, :] * qk_scale)
        visible = (kv_pos[None, :] <= last_visible[:, None]) & in_context[None, :]
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # [BLOCK_M]
        alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
        p = tl.exp2(scores - m_new[:, None])  # [BLOCK_M, TILE_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if KV_FORMAT != 0:
            p = p * v_scale[None, :]  # each value row's scale rides on its weights (l_i took them unscaled)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, WIDEN_TO_FP32)
        m_i = m_new

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :] * stride_out_dim,
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None],
    )


def _check_cache(layer_cache: torch.Tensor) -> None:
    if layer_cache.dim() != 5 or layer_cache.shape[0] != 2:
        raise ValueError(
            "layer_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(layer_cache.shape)}"
        )


def _kernel_views(layer_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(cache, scales, KV_FORMAT, head_dim) as the kernels take a layer cache: a quantized one as its
    bytes and as float32 words (its rows' byte counts are multiples of 4: head_dim is checked to be)."""
    value_dtype = layer_format(layer_cache)
    kv_format = 0 if value_dtype is None else _KV_FORMATS[value_dtype]
    if kv_format == 0:
        return layer_cache, layer_cache, 0, layer_cache.shape[-1]
    head_dim = layer_cache.shape[-1] - SCALE_BYTES
    if head_dim % 4:
        raise ValueError(f"the Triton backend needs head_dim a multiple of 4 for a quantized KV cache, got {head_dim}")
    return layer_cache.view(torch.uint8), layer_cache.view(torch.float32), kv_format, head_dim


def _scale_strides(scales: torch.Tensor, kv_format: int) -> tuple[int, int, int, int]:
    """The float32 view's (kv, block, token, head) strides; unused (zeros) for an unquantized cache."""
    return (scales.stride(0), scales.stride(1), scales.stride(2), scales.stride(3)) if kv_format else (0, 0, 0, 0)


def store_kv(layer_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V into their cache slots (in place); same contract as ``torch_backend.write_kv``.

    layer_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], or quantized rows [..., head_dim + 4]
    key, value: [num_tokens, num_kv_heads, head_dim], the cache's dtype (or any float dtype for a
        quantized cache; any strides)
    slot_mapping: [num_tokens] integer: block_id * block_size + offset of each token
    Slots are not range-checked on the device (that would cost a sync); they come from the block manager.
    """
    _check_cache(layer_cache)
    cache, scales, kv_format, head_dim = _kernel_views(layer_cache)
    _, _, block_size, num_kv_heads, _ = layer_cache.shape
    expected = (slot_mapping.shape[0], num_kv_heads, head_dim)
    if slot_mapping.dim() != 1 or tuple(key.shape) != expected or tuple(value.shape) != expected:
        raise ValueError(
            f"key and value must be [num_tokens, num_kv_heads, head_dim] = {expected} to match slot_mapping "
            f"and the cache, got key {tuple(key.shape)}, value {tuple(value.shape)}, "
            f"slot_mapping {tuple(slot_mapping.shape)}"
        )
    if kv_format == 0 and (key.dtype != layer_cache.dtype or value.dtype != layer_cache.dtype):
        raise ValueError(
            f"key/value dtype ({key.dtype}, {value.dtype}) must match the KV cache dtype {layer_cache.dtype}"
        )
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        cache,
        scales,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *cache.stride(),
        *_scale_strides(scales, kv_format),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
        KV_FORMAT=kv_format,
        QMAX=_QMAX.get(kv_format, 0.0),
        SCALE_OFFSET=head_dim // 4,
    )


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def paged_attention(
    query: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cached context, in one launch.

    query: [num_tokens, num_heads, head_dim], sequences laid end to end
    layer_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] (or quantized rows [..., head_dim + 4]),
        already holding the new tokens' K/V
    block_tables: [num_seqs, max_blocks_per_seq] integer, rows padded with any valid block id
    seq_lens: [num_seqs] integer: context length, new tokens included
    query_start_loc: [num_seqs + 1] integer: where each sequence's tokens start in ``query``
    max_query_len: the longest sequence's number of new tokens (sizes the grid; a smaller
        value than the truth leaves tokens uncomputed)
    Query token j of sequence i sees context positions <= seq_lens[i] - q_len_i + j.
    Returns [num_tokens, num_heads, head_dim] in the query's dtype.
    """
    _check_cache(layer_cache)
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim], got shape {tuple(query.shape)}")
    num_tokens, num_heads, head_dim = query.shape
    cache, scales, kv_format, cache_head_dim = _kernel_views(layer_cache)
    _, _, block_size, num_kv_heads, _ = layer_cache.shape
    if head_dim != cache_head_dim:
        raise ValueError(f"query head_dim {head_dim} does not match the KV cache's {cache_head_dim}")
    if not _is_power_of_two(head_dim) or head_dim < _MIN_DOT_SIZE:
        raise ValueError(
            f"the Triton backend needs head_dim to be a power of two >= {_MIN_DOT_SIZE}, got {head_dim}; "
            "use attention_backend='torch' for this model"
        )
    if not _is_power_of_two(block_size) or block_size < 8:
        raise ValueError(f"the Triton backend needs block_size to be a power of two >= 8, got {block_size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if kv_format == 0 and query.dtype != layer_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} must match the KV cache dtype {layer_cache.dtype}")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"for {num_seqs} sequences expected query_start_loc [{num_seqs + 1}] and block_tables "
            f"[{num_seqs}, max_blocks], got {tuple(query_start_loc.shape)} and {tuple(block_tables.shape)}"
        )

    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out

    num_queries_per_kv = num_heads // num_kv_heads
    heads_pad = triton.next_power_of_2(num_queries_per_kv)
    # Decode-only steps take one query token per program; prefills pack
    # several tokens so that the GQA group times tokens fills a tile.
    if max_query_len <= 1:
        block_q = 1
    else:
        block_q = min(max(1, _PREFILL_BLOCK_M // heads_pad), triton.next_power_of_2(max_query_len))
    block_m = max(_MIN_DOT_SIZE, block_q * heads_pad)
    tile_n = max(_MIN_TILE_N, block_size)
    # Interpreting (CPU tensors), or fp32 data: multiply in exact fp32.
    widen_to_fp32 = query.device.type != "cuda" or query.dtype == torch.float32

    grid = (num_seqs, triton.cdiv(max(max_query_len, 1), block_q), num_kv_heads)
    _paged_attention_kernel[grid](
        out,
        query,
        cache,
        scales,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * 1.4426950408889634,  # log2(e)
        *out.stride(),
        *query.stride(),
        *cache.stride(),
        *_scale_strides(scales, kv_format),
        block_tables.stride(0),
        NUM_QUERIES_PER_KV=num_queries_per_kv,
        HEADS_PAD=heads_pad,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        WIDEN_TO_FP32=widen_to_fp32,
        KV_FORMAT=kv_format,
        SCALE_OFFSET=cache_head_dim // 4,
    )
    return out
