"""The native CPU kernels against the pure-PyTorch reference, for every ISA build this CPU runs.

The build this CPU takes by default is one of them; weaker ones (AVX2 on an AVX-512
machine, the generic C build everywhere) are built with their explicit flags and
checked too, so a path that only some hosts take is still tested here.
"""

from __future__ import annotations

import pytest
import torch

from engine import cpu_kernels
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import (
    TorchAttentionBackend,
    decode_attention_bias,
    paged_decode_attention,
    write_kv,
)
from engine.cpu_features import CAP_ENV, cpu_features
from engine.models.ops import NativeCPUOps, TorchOps
from tests.engine.factories import in_block_major_cache

DEFAULT = cpu_kernels.load()
pytestmark = pytest.mark.skipif(DEFAULT is None, reason="no C compiler here: the torch path is the only one")

ISAS = cpu_features().supported_isas
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(params=ISAS)
def kernels(request: pytest.FixtureRequest) -> cpu_kernels.CPUKernels:
    loaded = cpu_kernels.load(request.param)
    if loaded is None:
        pytest.fail(f"the {request.param} build failed on a CPU that runs it (see the log)")
    return loaded


def test_the_default_build_is_the_best_this_cpu_runs() -> None:
    assert DEFAULT.isa == cpu_features().kernel_isa == ISAS[-1]
    assert "generic" in ISAS


def test_a_build_the_cpu_cannot_run_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Capped at the generic level, an AVX2 library would be an illegal instruction away."""
    monkeypatch.setenv(CAP_ENV, "generic")
    cpu_features.cache_clear()
    cpu_kernels.clear_cache()
    try:
        with pytest.raises(ValueError, match="would not run on this CPU"):
            cpu_kernels.load("avx2")
        assert cpu_kernels.load().isa == "generic"
    finally:
        monkeypatch.delenv(CAP_ENV)
        cpu_features.cache_clear()
        cpu_kernels.clear_cache()


def random_case(
    seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(sum(seq_lens) + head_dim)
    num_blocks_per_seq = -(-max(seq_lens) // block_size)
    num_blocks = len(seq_lens) * num_blocks_per_seq + 3
    cache = in_block_major_cache(
        torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    )
    # Each sequence owns a shuffled, non-contiguous set of blocks.
    block_tables = torch.randperm(num_blocks, generator=generator)[: len(seq_lens) * num_blocks_per_seq]
    block_tables = block_tables.view(len(seq_lens), num_blocks_per_seq).to(torch.int32)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=generator).to(dtype)
    return query, cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32)


def reference(query, cache, block_tables, seq_lens, scale):
    num_heads, num_kv_heads = query.shape[1], cache.shape[3]
    bias = decode_attention_bias(seq_lens, num_heads, num_kv_heads, block_tables.shape[1] * cache.shape[2])
    return paged_decode_attention(query.float(), cache.float(), block_tables, bias, scale)


# Head dims and block sizes that take each ISA's vector paths (multiples of 16 or 8) and its
# scalar ones (40 is a multiple of 8 only; block size 8 is below AVX-512's 16 tokens per group).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (8, 8, 128, 16), (4, 1, 32, 8), (6, 2, 48, 32), (4, 2, 40, 16), (2, 1, 20, 16)],
)
def test_decode_kernel_matches_reference(
    kernels: cpu_kernels.CPUKernels,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
) -> None:
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 70]
    query, cache, block_tables, lens = random_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    out = kernels.paged_decode_attention(query, cache, block_tables, lens, scale)
    assert out is not None and out.dtype == dtype
    torch.testing.assert_close(
        out.float(), reference(query, cache, block_tables, lens, scale), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_kernel_on_a_batch_big_enough_for_the_thread_team(
    kernels: cpu_kernels.CPUKernels, dtype: torch.dtype
) -> None:
    """Small batches run on the calling thread; this one is past the kernel's threshold for threads."""
    seq_lens = [300, 17, 290, 511, 64, 1, 333, 250]
    query, cache, block_tables, lens = random_case(seq_lens, 8, 2, 128, 16, dtype)
    out = kernels.paged_decode_attention(query, cache, block_tables, lens, 0.09)
    torch.testing.assert_close(
        out.float(), reference(query, cache, block_tables, lens, 0.09), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )


def verify_runs_case(
    num_heads: int, num_kv_heads: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows as a speculating batch has them: runs of verify rows, each a token longer than the one
    before over the same block table (across a block's end too), beside a lone row, a row one
    token longer over another request's blocks, and one length twice.
    Returns (query, K/V values [2, num_blocks, 16, H_kv, 64] in float32, block tables, seq_lens)."""
    head_dim, block_size = 64, 16
    generator = torch.Generator().manual_seed(7)
    num_blocks = 64
    values = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    owned = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    tables = [owned[0:6], owned[6:12], owned[12:18], owned[18:24]]
    shares_first = torch.cat([owned[12:13], owned[24:29]])  # another request's blocks after one shared
    rows: list[tuple[torch.Tensor, int]] = []
    rows += [(tables[0], 40 + i) for i in range(4)]  # a run of four, within one block
    rows += [(tables[1], 30)]  # a lone row
    rows += [(tables[2], 2 * block_size - 1 + i) for i in range(3)]  # a run across a block's end
    rows += [(shares_first, 2 * block_size + 2)]  # one longer, but over other blocks after the first
    rows += [(tables[3], 5 + i) for i in range(20)]  # a long run
    rows += [(tables[3], 70), (tables[3], 70)]  # the same length twice
    block_tables = torch.stack([table for table, _ in rows])
    seq_lens = torch.tensor([length for _, length in rows], dtype=torch.int32)
    query = torch.randn(len(rows), num_heads, head_dim, generator=generator).to(dtype)
    return query, values, block_tables, seq_lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (4, 1), (4, 4)])
def test_verify_rows_match_reference(
    kernels: cpu_kernels.CPUKernels, dtype: torch.dtype, num_heads: int, num_kv_heads: int
) -> None:
    """Each verify row sees its own length of the context, no more (a kernel that walks a run's
    cache once for all its rows must mask each row's end)."""
    query, values, block_tables, lens = verify_runs_case(num_heads, num_kv_heads, dtype)
    cache = in_block_major_cache(values.to(dtype))
    out = kernels.paged_decode_attention(query, cache, block_tables, lens, 0.125)
    assert out is not None
    torch.testing.assert_close(
        out.float(), reference(query, cache, block_tables, lens, 0.125), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )


def test_block_table_row_stride_is_honoured(kernels: cpu_kernels.CPUKernels) -> None:
    """The backend passes a wider block table than the decodes need (prefills share it)."""
    query, cache, block_tables, lens = random_case([20, 33], 4, 2, 32, 16, torch.float32)
    wide = torch.cat([block_tables, torch.zeros(2, 5, dtype=torch.int32)], dim=1)
    out = kernels.paged_decode_attention(query, cache, wide, lens, 0.2)
    torch.testing.assert_close(out, reference(query, cache, block_tables, lens, 0.2), atol=1e-5, rtol=1e-5)


def test_sizes_beyond_the_kernel_buffers_fall_back(kernels: cpu_kernels.CPUKernels) -> None:
    query, cache, block_tables, lens = random_case([5], 128, 128, 16, 16, torch.float32)  # 128 heads > 64
    assert kernels.paged_decode_attention(query, cache, block_tables, lens, 0.25) is None


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
    slow = TorchAttentionBackend(use_cpu_kernels=False).forward(
        query, key, value, in_block_major_cache(cache), metadata(), 0.125
    )
    torch.testing.assert_close(fast.float(), slow.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kv_store_writes_what_the_torch_path_writes(kernels: cpu_kernels.CPUKernels, dtype: torch.dtype) -> None:
    """A prefill's run of slots and scattered decode slots, from strided K/V rows (slices of qkv)."""
    generator = torch.Generator().manual_seed(4)
    num_tokens, num_kv_heads, head_dim = 21, 3, 64
    qkv = torch.randn(num_tokens, 5 * num_kv_heads * head_dim, generator=generator).to(dtype)
    key = qkv[:, 3 * 192 : 4 * 192].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, 4 * 192 :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.cat([torch.arange(32, 50), torch.tensor([7, 95, 64])])
    empty = torch.zeros(2, 6, 16, num_kv_heads, head_dim, dtype=dtype)
    expected, actual = in_block_major_cache(empty), in_block_major_cache(empty)
    write_kv(expected, key, value, slots)
    assert kernels.store_kv(actual, key, value, slots)
    torch.testing.assert_close(actual, expected, atol=0, rtol=0, equal_nan=True)  # the other layers stay NaN


def test_kv_store_declines_layouts_it_does_not_take(kernels: cpu_kernels.CPUKernels) -> None:
    cache = torch.zeros(2, 4, 16, 2, 8)
    key = value = torch.randn(3, 2, 8)
    assert not kernels.store_kv(cache, key, value, torch.tensor([1, 2, 3], dtype=torch.int32))
    assert not kernels.store_kv(cache, key.transpose(1, 2).contiguous().transpose(1, 2), value, torch.tensor([1, 2, 3]))
    assert cache.count_nonzero() == 0


def test_kernels_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_CPU_KERNELS", "0")
    cpu_kernels.clear_cache()
    try:
        assert cpu_kernels.load() is None
    finally:
        monkeypatch.delenv("SPLITSERVE_CPU_KERNELS")
        cpu_kernels.clear_cache()


# Widths with a tail past the last full vector (100 = 6 x 16 + 4 = 12 x 8 + 4), and row counts on
# both sides of the kernels' threshold for waking the thread team (1 << 16 elements).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["first-layer", "residual"])
@pytest.mark.parametrize(("num_rows", "hidden"), [(1, 576), (37, 100), (700, 100)])
def test_fused_add_rms_norm_matches_reference(
    kernels: cpu_kernels.CPUKernels, dtype: torch.dtype, with_residual: bool, num_rows: int, hidden: int
) -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(num_rows, hidden, generator=generator).to(dtype)
    residual = torch.randn(num_rows, hidden, generator=generator).to(dtype) if with_residual else None
    weight = torch.randn(hidden, generator=generator).to(dtype)
    expected, expected_residual = TorchOps().add_rms_norm(
        x, None if residual is None else residual.clone(), weight, 1e-5
    )
    out, new_residual = NativeCPUOps(kernels).add_rms_norm(x, residual, weight, 1e-5)
    # The residual add rounds exactly like PyTorch's; the norm's float32 sum may differ in order.
    torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("num_rows", "intermediate"), [(1, 1536), (9, 100), (90, 1000)])
def test_fused_silu_and_mul_matches_reference(
    kernels: cpu_kernels.CPUKernels, dtype: torch.dtype, num_rows: int, intermediate: int
) -> None:
    gate_up = (torch.randn(num_rows, 2 * intermediate, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: rounds once, transformers twice
    torch.testing.assert_close(
        NativeCPUOps(kernels).silu_and_mul(gate_up).float(),
        TorchOps().silu_and_mul(gate_up).float(),
        atol=tolerance,
        rtol=tolerance,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("num_tokens", "head_dim"), [(1, 64), (11, 32), (11, 40), (300, 64)])
def test_fused_rotary_matches_reference_on_strided_rows(
    kernels: cpu_kernels.CPUKernels, dtype: torch.dtype, num_tokens: int, head_dim: int
) -> None:
    generator = torch.Generator().manual_seed(3)
    num_heads, num_kv_heads = 4, 2
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(
        num_tokens, num_heads, head_dim
    )  # strided rows, as the model hands them over
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    cos = torch.randn(512, head_dim // 2, generator=generator).to(dtype)
    sin = torch.randn(512, head_dim // 2, generator=generator).to(dtype)
    positions = torch.randint(0, 512, (num_tokens,), generator=generator)
    outputs = NativeCPUOps(kernels).rotary(q, k, cos, sin, positions)
    assert all(out.is_contiguous() for out in outputs)
    for out, expected in zip(outputs, TorchOps().rotary(q, k, cos, sin, positions), strict=True):
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_rows", [1, 3, 4, 7, 8, 9, 17])
@pytest.mark.parametrize(("in_features", "out_features"), [(101, 37), (576, 960)], ids=["small", "threaded"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_panel_linear_matches_a_float32_matmul(
    kernels: cpu_kernels.CPUKernels,
    dtype: torch.dtype,
    num_rows: int,
    in_features: int,
    out_features: int,
    with_bias: bool,
) -> None:
    """576 x 960 is past the kernel's threshold for threads; 37 output features leave a padded
    panel, 101 input features a padded pair (bf16 pairs with AVX512_BF16); 7 to 17 rows take
    every tile height and more than one tile (6 or 8 rows). The input rows are strided, as a
    slice of a wider activation would be."""
    generator = torch.Generator().manual_seed(num_rows + in_features)
    wide = torch.randn(num_rows, in_features + 12, generator=generator).to(dtype)
    x = wide[:, 5 : 5 + in_features]
    weight = (torch.randn(out_features, in_features, generator=generator) * 0.05).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype) if with_bias else None
    expected = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    panels = kernels.pack_panels(weight)
    out = kernels.linear(x, panels, out_features, bias)
    assert out.dtype == dtype and out.shape == (num_rows, out_features)
    # float32: another summation order. bf16: rounded once from that float32 sum, within one step.
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(
        out.float(), expected, atol=max(tolerance, 1e-2 if dtype == torch.bfloat16 else 0), rtol=tolerance
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_panel_prefetch_distance_is_a_build_setting_that_changes_no_result(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """SPLITSERVE_PANEL_PREFETCH_BYTES reaches the build (the library reports it), and the kernel
    reads ahead of itself without changing a bit of its output; a bad value is refused at load."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(9, 576, generator=generator).to(dtype)
    weight = (torch.randn(960, 576, generator=generator) * 0.05).to(dtype)
    outputs = {}
    try:
        for setting in [None, "0", "64"]:
            if setting is None:
                monkeypatch.delenv("SPLITSERVE_PANEL_PREFETCH_BYTES", raising=False)
            else:
                monkeypatch.setenv("SPLITSERVE_PANEL_PREFETCH_BYTES", setting)
            cpu_kernels.clear_cache()
            loaded = cpu_kernels.load()
            outputs[loaded.panel_prefetch_bytes] = loaded.linear(x, loaded.pack_panels(weight), 960, None)
        assert sorted(outputs) == [0, 64, DEFAULT.panel_prefetch_bytes] and DEFAULT.panel_prefetch_bytes > 64
        assert all(torch.equal(out, outputs[0]) for out in outputs.values())
        monkeypatch.setenv("SPLITSERVE_PANEL_PREFETCH_BYTES", "2k")
        cpu_kernels.clear_cache()
        with pytest.raises(ValueError, match="SPLITSERVE_PANEL_PREFETCH_BYTES must be a byte count"):
            cpu_kernels.load(DEFAULT.isa)
    finally:
        monkeypatch.delenv("SPLITSERVE_PANEL_PREFETCH_BYTES", raising=False)
        cpu_kernels.clear_cache()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_unpacked_panels_are_the_transposed_weight(kernels: cpu_kernels.CPUKernels, dtype: torch.dtype) -> None:
    """Any run of panels comes back as the float32 columns of weight^T it holds, zero past the last
    output feature (the padding of the last panel); an odd in_features leaves a padded bf16 pair."""
    out_features, in_features, width = 3 * kernels.panel_width + 5, 25, kernels.panel_width
    weight = torch.randn(out_features, in_features).to(dtype)
    panels = kernels.pack_panels(weight)
    padded = torch.zeros(4 * width, in_features)
    padded[:out_features] = weight.float()
    for start, end in [(0, 4), (1, 3), (3, 4)]:
        columns = kernels.unpack_panels(panels, in_features, start, end)
        assert torch.equal(columns, padded[start * width : end * width].T)
