"""Triton attention kernels against the torch reference, run on CPU under the Triton interpreter.

Shapes are tiny on purpose: the interpreter executes every program in Python.
16-bit kernels are compared against the reference run in fp32 on the same
(rounded) inputs, so the tolerance measures the kernel's own error.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import (
    TorchAttentionBackend,
    decode_attention_bias,
    gather_context,
    paged_decode_attention,
    prefill_attention,
    write_kv,
)
from engine.attention.triton_backend import TritonAttentionBackend
from engine.attention.triton_kernels import paged_attention, store_kv
from tests.engine.factories import in_block_major_cache

# (atol, rtol) against an fp32 reference; 16-bit kernels also round P to 16 bits before P @ V.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
}
NUM_BLOCKS = 24


def param_id(value: object) -> str:
    """Readable test ids: bfloat16 rather than dtype1."""
    return str(value).removeprefix("torch.")


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    block_size: int = 16,
    num_blocks: int = NUM_BLOCKS,
    seed: int = 0,
) -> AttentionMetadata:
    """A step over sequences whose blocks are drawn from a shuffled pool (never block 0, the padding id).

    Sequence i brings query_lens[i] new tokens at the end of a context of seq_lens[i] tokens;
    decodes (query_len 1) must come first, as the scheduler lays them out.
    """
    generator = torch.Generator().manual_seed(seed)
    free_blocks = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    slots: list[int] = []
    for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        blocks = [free_blocks.pop() for _ in range(blocks_per_seq[i])]
        block_tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        for pos in range(seq_len - query_len, seq_len):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    return AttentionMetadata(
        num_decodes=num_decodes,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
    )


def make_cache(
    metadata: AttentionMetadata, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int = 16
) -> torch.Tensor:
    """[2, NUM_BLOCKS, block_size, H_kv, D] of random K/V, with NaN in every block no sequence owns,
    as one layer of a block-major cache (the other layers NaN too).

    Block 0 is the block tables' padding, which the reference reads (and masks), so it stays finite;
    a NaN anywhere in the kernel's output means it read a block it had no business reading.
    """
    cache = torch.randn(2, NUM_BLOCKS, block_size, num_kv_heads, head_dim).to(dtype)
    owned = torch.zeros(NUM_BLOCKS, dtype=torch.bool)
    owned[metadata.block_tables.flatten().long()] = True
    owned[0] = True
    cache[:, ~owned] = float("nan")
    return in_block_major_cache(cache)


def make_qkv(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=generator).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
    return query, key, value


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    assert actual.dtype == dtype
    assert not actual.isnan().any()
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=param_id)
def test_store_kv_matches_write_kv_exactly(dtype: torch.dtype) -> None:
    metadata = make_batch([1, 1, 7], [17, 32, 20], block_size=8)
    cache = make_cache(metadata, num_kv_heads=2, head_dim=32, dtype=dtype, block_size=8)
    _, key, value = make_qkv(metadata.num_tokens, 4, 2, 32, dtype)
    expected = cache.clone()
    write_kv(expected, key, value, metadata.slot_mapping)

    # K and V as strided views of one fused projection, as a model would hand them over.
    kv = torch.stack([key, value], dim=1)  # [T, 2, H_kv, D]
    store_kv(cache, kv[:, 0], kv[:, 1], metadata.slot_mapping)

    assert torch.equal(cache.nan_to_num(), expected.nan_to_num())
    assert torch.equal(cache.isnan(), expected.isnan())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=param_id)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (2, 2)])
def test_decode_matches_reference(dtype: torch.dtype, num_heads: int, num_kv_heads: int) -> None:
    # Lengths on, just past and well past block boundaries, one token alone.
    seq_lens = [1, 15, 16, 17, 40]
    metadata = make_batch([1] * len(seq_lens), seq_lens)
    head_dim = 32
    cache = make_cache(metadata, num_kv_heads, head_dim, dtype)
    query, _, _ = make_qkv(len(seq_lens), num_heads, num_kv_heads, head_dim, dtype)
    scale = 1 / math.sqrt(head_dim)

    out = paged_attention(query, cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc, 1, scale)

    block_size = cache.shape[2]
    num_blocks = -(-metadata.max_seq_len // block_size)
    bias = decode_attention_bias(metadata.seq_lens, num_heads, num_kv_heads, num_blocks * block_size)
    # The reference reads whole blocks, padding included; only the kernel must avoid the NaN poison.
    expected = paged_decode_attention(
        query.float(), cache.float().nan_to_num(), metadata.block_tables[:, :num_blocks], bias, scale
    )
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=param_id)
def test_prefill_without_prefix_matches_reference(dtype: torch.dtype) -> None:
    query_lens = [5, 19]
    metadata = make_batch(query_lens, query_lens, block_size=8)
    num_heads, num_kv_heads, head_dim = 4, 2, 16
    cache = make_cache(metadata, num_kv_heads, head_dim, dtype, block_size=8)
    query, key, value = make_qkv(metadata.num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    store_kv(cache, key, value, metadata.slot_mapping)
    scale = 0.3

    out = paged_attention(
        query, cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc, max(query_lens), scale
    )

    starts = metadata.query_start_loc_cpu
    for i in range(len(query_lens)):
        rows = slice(starts[i], starts[i + 1])
        expected = prefill_attention(
            query[rows][None].float(), key[rows][None].float(), value[rows][None].float(), scale, 0
        )[0]
        assert_close(out[rows], expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=param_id)
@pytest.mark.parametrize("block_size", [8, 16, 64])
def test_prefill_with_cached_prefix_matches_reference(dtype: torch.dtype, block_size: int) -> None:
    # Chunked prefill: chunks that start mid-block, on a block boundary, and end mid-tile.
    query_lens = [6, 16, 3]
    seq_lens = [21, 48, 40]
    metadata = make_batch(query_lens, seq_lens, block_size=block_size)
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    cache = make_cache(metadata, num_kv_heads, head_dim, dtype, block_size=block_size)
    query, key, value = make_qkv(metadata.num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    store_kv(cache, key, value, metadata.slot_mapping)
    scale = 1 / math.sqrt(head_dim)

    out = paged_attention(
        query, cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc, max(query_lens), scale
    )

    starts = metadata.query_start_loc_cpu
    for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        rows = slice(starts[i], starts[i + 1])
        k, v = gather_context(cache.float(), metadata.block_tables[i], seq_len)
        expected = prefill_attention(query[rows][None].float(), k[None], v[None], scale, seq_len - query_len)[0]
        assert_close(out[rows], expected, dtype)


@pytest.mark.parametrize(
    ("dtype", "num_heads", "num_kv_heads"),
    [(torch.float32, 4, 2), (torch.float32, 2, 2), (torch.bfloat16, 4, 2), (torch.float16, 4, 1)],
    ids=param_id,
)
def test_mixed_batch_matches_torch_backend(dtype: torch.dtype, num_heads: int, num_kv_heads: int) -> None:
    # Two decodes, a first prefill, and a prefill chunk behind a cached prefix.
    query_lens = [1, 1, 9, 7]
    seq_lens = [33, 16, 9, 25]
    metadata = make_batch(query_lens, seq_lens)
    head_dim = 16
    cache = make_cache(metadata, num_kv_heads, head_dim, dtype)
    query, key, value = make_qkv(metadata.num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    torch_cache = cache.nan_to_num()  # the reference reads padding blocks; only the kernel must skip NaN
    scale = 1 / math.sqrt(head_dim)

    out = TritonAttentionBackend().forward(query, key, value, cache, metadata, scale)
    expected = TorchAttentionBackend().forward(query, key, value, torch_cache, metadata, scale)

    assert torch.equal(cache.nan_to_num(), torch_cache.nan_to_num())
    # The reference ran in `dtype` too, so its own rounding counts: allow both errors.
    atol, rtol = TOLERANCES[dtype]
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=2 * atol, rtol=2 * rtol)


def test_attention_depends_on_causal_position() -> None:
    """A guard on the guard: the same tokens with a different prefix length must give different outputs."""
    metadata = make_batch([4], [12])
    shifted = make_batch([4], [13])
    cache = make_cache(metadata, 1, 16, torch.float32)
    query, _, _ = make_qkv(4, 1, 1, 16, torch.float32)
    shifted.block_tables = metadata.block_tables

    out = paged_attention(query, cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc, 4, 0.25)
    out_shifted = paged_attention(
        query, cache, shifted.block_tables, shifted.seq_lens, shifted.query_start_loc, 4, 0.25
    )

    assert (out - out_shifted).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "message"),
    [
        (2, 2, 24, 16, "head_dim"),
        (2, 2, 8, 16, "head_dim"),
        (2, 2, 16, 4, "block_size"),
        (3, 2, 16, 16, "multiple"),
    ],
)
def test_paged_attention_rejects_unsupported_shapes(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, message: str
) -> None:
    cache = torch.zeros(2, 4, block_size, num_kv_heads, head_dim)
    query = torch.zeros(1, num_heads, head_dim)
    with pytest.raises(ValueError, match=message):
        paged_attention(
            query,
            cache,
            torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32),
            1,
            1.0,
        )


def test_store_kv_rejects_dtype_mismatch() -> None:
    cache = torch.zeros(2, 4, 16, 2, 16, dtype=torch.bfloat16)
    key = torch.zeros(1, 2, 16)
    with pytest.raises(ValueError, match="dtype"):
        store_kv(cache, key, key, torch.zeros(1, dtype=torch.int64))
