"""The native CPU decode kernel against the pure-PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from engine import cpu_kernels
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend, decode_attention_bias, paged_decode_attention
from tests.engine.factories import in_block_major_cache

KERNELS = cpu_kernels.load()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C compiler here: the torch path is the only one")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def random_case(
    seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(sum(seq_lens) + head_dim)
    num_blocks_per_seq = -(-max(seq_lens) // block_size)
    num_blocks = len(seq_lens) * num_blocks_per_seq + 3
    cache = in_block_major_cache(torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype))
    # Each sequence owns a shuffled, non-contiguous set of blocks.
    block_tables = torch.randperm(num_blocks, generator=generator)[: len(seq_lens) * num_blocks_per_seq]
    block_tables = block_tables.view(len(seq_lens), num_blocks_per_seq).to(torch.int32)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=generator).to(dtype)
    return query, cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32)


def reference(query, cache, block_tables, seq_lens, scale):
    num_heads, num_kv_heads = query.shape[1], cache.shape[3]
    bias = decode_attention_bias(seq_lens, num_heads, num_kv_heads, block_tables.shape[1] * cache.shape[2])
    return paged_decode_attention(query.float(), cache.float(), block_tables, bias, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (8, 8, 128, 16), (4, 1, 32, 8), (6, 2, 48, 32)],
)
def test_decode_kernel_matches_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 70]
    query, cache, block_tables, lens = random_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    out = KERNELS.paged_decode_attention(query, cache, block_tables, lens, scale)
    assert out is not None and out.dtype == dtype
    torch.testing.assert_close(out.float(), reference(query, cache, block_tables, lens, scale), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_block_table_row_stride_is_honoured() -> None:
    """The backend passes a wider block table than the decodes need (prefills share it)."""
    query, cache, block_tables, lens = random_case([20, 33], 4, 2, 32, 16, torch.float32)
    wide = torch.cat([block_tables, torch.zeros(2, 5, dtype=torch.int32)], dim=1)
    out = KERNELS.paged_decode_attention(query, cache, wide, lens, 0.2)
    torch.testing.assert_close(out, reference(query, cache, block_tables, lens, 0.2), atol=1e-5, rtol=1e-5)


def test_sizes_beyond_the_kernel_buffers_fall_back() -> None:
    query, cache, block_tables, lens = random_case([5], 128, 128, 16, 16, torch.float32)  # 128 heads > 64
    assert KERNELS.paged_decode_attention(query, cache, block_tables, lens, 0.25) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backend_with_and_without_kernel_agree(dtype: torch.dtype) -> None:
    seq_lens = [17, 40, 5]
    query, cache, block_tables, lens = random_case(seq_lens, 4, 2, 64, 16, dtype)
    key = torch.randn(3, 2, 64).to(dtype)
    value = torch.randn(3, 2, 64).to(dtype)
    last_slots = [int(block_tables[i, (n - 1) // 16]) * 16 + (n - 1) % 16 for i, n in enumerate(seq_lens)]

    def metadata() -> AttentionMetadata:
        return AttentionMetadata(
            num_decodes=3,
            slot_mapping=torch.tensor(last_slots),
            query_start_loc=torch.arange(4, dtype=torch.int32),
            seq_lens=lens,
            block_tables=block_tables,
            max_query_len=1,
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=[0, 1, 2, 3],
            seq_lens_cpu=seq_lens,
        )

    native = TorchAttentionBackend(use_cpu_kernels=True)
    assert native.cpu_kernels is not None
    fast = native.forward(query, key, value, in_block_major_cache(cache), metadata(), 0.125)
    slow = TorchAttentionBackend(use_cpu_kernels=False).forward(query, key, value, in_block_major_cache(cache), metadata(), 0.125)
    torch.testing.assert_close(fast.float(), slow.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_kernels_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_CPU_KERNELS", "0")
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load() is None
    finally:
        monkeypatch.delenv("SPLITSERVE_CPU_KERNELS")
        cpu_kernels.load.cache_clear()


@pytest.fixture(scope="module")
def ops_pair() -> tuple[object, object]:
    from engine.models.ops import NativeCPUOps, TorchOps

    return NativeCPUOps(KERNELS), TorchOps()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["first-layer", "residual"])
def test_fused_add_rms_norm_matches_reference(ops_pair, dtype: torch.dtype, with_residual: bool) -> None:
    native, reference = ops_pair
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(37, 96, generator=generator).to(dtype)
    residual = torch.randn(37, 96, generator=generator).to(dtype) if with_residual else None
    weight = torch.randn(96, generator=generator).to(dtype)
    expected, expected_residual = reference.add_rms_norm(x, None if residual is None else residual.clone(), weight, 1e-5)
    out, new_residual = native.add_rms_norm(x, residual, weight, 1e-5)
    # The residual add rounds exactly like PyTorch's; the norm's float32 sum may differ in order.
    torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_silu_and_mul_matches_reference(ops_pair, dtype: torch.dtype) -> None:
    native, reference = ops_pair
    gate_up = (torch.randn(9, 2 * 80, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: rounds once, transformers twice
    torch.testing.assert_close(
        native.silu_and_mul(gate_up).float(), reference.silu_and_mul(gate_up).float(), atol=tolerance, rtol=tolerance
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_rotary_matches_reference_on_strided_rows(ops_pair, dtype: torch.dtype) -> None:
    native, reference = ops_pair
    generator = torch.Generator().manual_seed(3)
    qkv = torch.randn(11, 3 * 4 * 32, generator=generator).to(dtype)
    q = qkv[:, : 4 * 32].view(11, 4, 32)  # strided rows, as the model hands them over
    k = qkv[:, 4 * 32 : 6 * 32].view(11, 2, 32)
    cos = torch.randn(64, 16, generator=generator).to(dtype)
    sin = torch.randn(64, 16, generator=generator).to(dtype)
    positions = torch.randint(0, 64, (11,), generator=generator)
    outputs = native.rotary(q, k, cos, sin, positions)
    assert all(out.is_contiguous() for out in outputs)
    for out, expected in zip(outputs, reference.rotary(q, k, cos, sin, positions), strict=True):
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
