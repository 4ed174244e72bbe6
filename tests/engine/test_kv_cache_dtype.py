"""The quantized KV cache (engine/kv_cache_dtype.py): its rows against the formats' error bounds,
every writer against the torch reference's bytes, every reader against attention over the
dequantized rows (each native kernel build this CPU runs, and the Triton kernels under the
interpreter), and the engine's layout and sizing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from engine import LLM, cpu_kernels
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import (
    TorchAttentionBackend,
    decode_attention_bias,
    paged_decode_attention,
    write_kv,
)
from engine.cpu_features import cpu_features
from engine.kv_cache_dtype import (
    KV_CACHE_DTYPES,
    SCALE_BYTES,
    VALUE_DTYPES,
    KVCacheDType,
    KVCacheFormat,
    dequantize,
    layer_format,
    quantize,
    round_trip,
)
from engine.kv_cache_layout import allocate_kv_cache, layer_view, layer_views
from engine.kv_cache_utils import kv_cache_bytes_per_block
from tests.checkpoints import make_checkpoint, random_prompts
from tests.engine.test_cpu_kernels import verify_runs_case
from tests.engine.test_parity import GREEDY, MAX_TOKENS, VARIED_LENGTHS, Reference, assert_matches, assert_no_leaks

QUANTIZED: list[KVCacheDType] = ["int8", "fp8_e4m3"]
QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
PREEMPTION_LENGTHS = [5, 20, 33, 45, 12, 40, 8, 30, 17, 25, 44, 3, 36, 28, 15, 41]
DEFAULT_KERNELS = cpu_kernels.load()
needs_kernels = pytest.mark.skipif(DEFAULT_KERNELS is None, reason="no C compiler here: the torch path is the only one")


@pytest.fixture(params=cpu_features().supported_isas)
def kernels(request: pytest.FixtureRequest) -> cpu_kernels.CPUKernels:
    """Every native build this CPU runs (ISAs it lacks are not built: they would not run here)."""
    if DEFAULT_KERNELS is None:
        pytest.skip("no C compiler here: the torch path is the only one")
    loaded = cpu_kernels.load(request.param)
    if loaded is None:
        pytest.fail(f"the {request.param} build failed on a CPU that runs it (see the log)")
    return loaded


def scales_of(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scale of each stored row [...]."""
    return rows.view(torch.uint8)[..., -SCALE_BYTES:].contiguous().view(torch.float32)[..., 0]


def spread_rows(
    shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32, decades: float = 6.0
) -> torch.Tensor:
    """Random rows whose magnitudes span ``decades`` decades around 1, row to row (as K and V do
    across heads and tokens): each row gets a scale of its own."""
    generator = torch.Generator().manual_seed(seed)
    magnitude = 10 ** ((torch.rand(*shape[:-1], 1, generator=generator) - 0.5) * decades)
    return (torch.randn(*shape, generator=generator) * magnitude).to(dtype)


def in_quantized_cache(
    values: torch.Tensor, kv_cache_dtype: KVCacheDType, num_layers: int = 3, layer: int = 1
) -> torch.Tensor:
    """``values`` ([2, num_blocks, block_size, H_kv, D], float) quantized into layer ``layer`` of a
    block-major cache, as the engine hands a layer to attention. Every other byte is 0xFF: NaN as
    an fp8 value and as a float32 scale, so a kernel that strays into another layer (or reads a
    row's scale from the wrong place) poisons its output."""
    rows = quantize(values, VALUE_DTYPES[kv_cache_dtype])
    _, num_blocks, block_size, num_kv_heads, row = rows.shape
    full = torch.full((num_blocks, num_layers, 2, block_size, num_kv_heads, row), 0xFF, dtype=torch.uint8)
    layer_view(full, layer).copy_(rows)
    return layer_view(full, layer, kv_cache_dtype)


def all_bytes(layer_cache: torch.Tensor) -> torch.Tensor:
    """Every byte of the cache a layer view belongs to, every layer's."""
    return torch.empty(0, dtype=torch.uint8).set_(layer_cache.untyped_storage())


# ------------------------------------------------------------------------------------------- rows


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_round_trip_error_is_within_half_a_step_of_the_format(kv_cache_dtype: KVCacheDType, dtype: torch.dtype) -> None:
    x = spread_rows((50, 3, 64), seed=1, dtype=dtype)
    x[7, 1] = 0.0  # an all-zero row
    rows = quantize(x, VALUE_DTYPES[kv_cache_dtype])
    assert rows.dtype == torch.uint8 and rows.shape == (50, 3, 64 + SCALE_BYTES)
    scale = scales_of(rows)
    assert torch.equal(scale, x.float().abs().amax(-1) / QMAX[kv_cache_dtype])
    back = dequantize(rows, VALUE_DTYPES[kv_cache_dtype], torch.float32)
    error = (back - x.float()).abs()
    if kv_cache_dtype == "int8":
        # Half of one step of the row's scale (plus the float32 rounding of x / scale and of value * scale).
        bound = scale[..., None] * 0.5001 + x.float().abs() * 1e-6
    else:
        # 3 mantissa bits: half a step is 2^-4 of the value's binade; below 2^-6 the steps are 2^-9.
        scaled = x.float().abs() / scale[..., None].clamp(min=1e-30)
        bound = scale[..., None] * torch.maximum(scaled * 2**-4, torch.tensor(2**-10)) * 1.0001
    assert (error <= bound).all()
    assert (error > 0.25 * bound).any(), "the bound is loose: the test would pass a coarser format"
    assert not back[7, 1].any() and scale[7, 1] == 0  # zeros stay zeros


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_a_row_takes_head_dim_bytes_and_a_float32_scale(kv_cache_dtype: KVCacheDType) -> None:
    x = torch.tensor([[1.0, -2.0, 0.5, 4.0]])
    rows = quantize(x, VALUE_DTYPES[kv_cache_dtype])
    scale = 4.0 / QMAX[kv_cache_dtype]
    assert rows[0, 4:].tolist() == list(torch.tensor([scale]).view(torch.uint8).tolist())
    values = rows[0, :4].view(VALUE_DTYPES[kv_cache_dtype]).float()
    assert values[3] == QMAX[kv_cache_dtype]  # the row's largest magnitude takes the format's largest value
    assert torch.allclose(values * scale, x[0], rtol=2**-4)


def test_the_formats_fingerprints_and_sizes() -> None:
    auto = KVCacheFormat("auto", torch.bfloat16, 64)
    int8 = KVCacheFormat("int8", torch.bfloat16, 64)
    fp8 = KVCacheFormat("fp8_e4m3", torch.float32, 64)
    assert (auto.fingerprint_dtype, int8.fingerprint_dtype, fp8.fingerprint_dtype) == (
        "bfloat16",
        "int8/f32-token-head",
        "fp8_e4m3/f32-token-head",
    )
    assert (auto.bytes_per_row, int8.bytes_per_row, fp8.bytes_per_row) == (128, 68, 68)
    assert (int8.cache_dtype, int8.layer_dtype, fp8.layer_dtype) == (torch.uint8, torch.int8, torch.float8_e4m3fn)
    assert int8.bytes_per_row / auto.bytes_per_row < 0.55
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8_e4m3"):
        KVCacheFormat("fp8", torch.float32, 64)  # type: ignore[arg-type]


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_the_layout_keeps_a_block_one_span_of_bytes(kv_cache_dtype: KVCacheDType) -> None:
    cache = allocate_kv_cache(5, 3, 4, 2, 8, torch.bfloat16, torch.device("cpu"), kv_cache_dtype)
    assert cache.shape == (5, 3, 2, 4, 2, 8 + SCALE_BYTES) and cache.dtype == torch.uint8 and cache.is_contiguous()
    assert cache[0].numel() == kv_cache_bytes_per_block(3, 4, 2, 8 + SCALE_BYTES, 1)
    layers = layer_views(cache, kv_cache_dtype)
    assert all(layer.dtype == VALUE_DTYPES[kv_cache_dtype] and layer.shape == (2, 5, 4, 2, 12) for layer in layers)
    assert all(layer_format(layer) == VALUE_DTYPES[kv_cache_dtype] for layer in layers)
    assert layer_format(layer_views(allocate_kv_cache(5, 3, 4, 2, 8, torch.float32, torch.device("cpu")))[0]) is None
    # A write through layer 2's view lands in block 4's span, in its row's bytes.
    key = torch.ones(1, 2, 8)
    write_kv(layers[2], key, key, torch.tensor([4 * 4 + 3]))
    assert cache[4, 2, :, 3].count_nonzero() > 0 and cache.count_nonzero() == cache[4, 2, :, 3].count_nonzero()


# ------------------------------------------------------------------------------- native kernels


def strided_kv(num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """K and V as strided slices of one fused projection, as the model hands them over."""
    qkv = spread_rows((num_tokens, 5 * num_kv_heads * head_dim), seed=seed, dtype=dtype)
    width = num_kv_heads * head_dim
    key = qkv[:, 3 * width : 4 * width].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, 4 * width :].view(num_tokens, num_kv_heads, head_dim)
    return key, value


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 20])
def test_native_store_writes_the_reference_bytes(
    kernels: cpu_kernels.CPUKernels, kv_cache_dtype: KVCacheDType, dtype: torch.dtype, head_dim: int
) -> None:
    """A prefill's run of slots and scattered decode slots; the other layers' bytes stay as they were."""
    num_tokens, num_kv_heads = 21, 3
    key, value = strided_kv(num_tokens, num_kv_heads, head_dim, dtype, seed=4)
    key[0, 1] = 0.0  # an all-zero row: scale 0
    slots = torch.cat([torch.arange(32, 50), torch.tensor([7, 95, 64])])
    empty = torch.zeros(2, 6, 16, num_kv_heads, head_dim)
    expected, actual = in_quantized_cache(empty, kv_cache_dtype), in_quantized_cache(empty, kv_cache_dtype)
    write_kv(expected, key, value, slots)
    assert kernels.store_kv(actual, key, value, slots)
    assert torch.equal(all_bytes(actual), all_bytes(expected))
    assert not torch.equal(all_bytes(actual), all_bytes(in_quantized_cache(empty, kv_cache_dtype)))


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_native_store_rounds_ties_and_every_fp8_value_as_torch_does(
    kernels: cpu_kernels.CPUKernels, kv_cache_dtype: KVCacheDType
) -> None:
    """Rows whose largest magnitude is the format's own make the scale exactly 1: each value is then
    stored as the format rounds it, here every fp8 value, every midpoint between two (ties go to
    even) and int8's half-integers."""
    qmax = QMAX[kv_cache_dtype]
    if kv_cache_dtype == "int8":
        values = torch.arange(-127, 127).float() + 0.5
    else:
        finite = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        finite = finite[finite.isfinite()].sort().values
        values = torch.cat([finite, (finite[1:] + finite[:-1]) / 2, finite * 0.999])
    head_dim = 16
    values = torch.cat([values, torch.zeros(-len(values) % (head_dim - 1))]).view(-1, head_dim - 1)
    rows = torch.cat([torch.full((len(values), 1), qmax), values.clamp(-qmax, qmax)], dim=1)[:, None]  # [T, 1, D]
    slots = torch.arange(len(rows))
    empty = torch.zeros(2, len(rows) // 16 + 1, 16, 1, head_dim)
    expected, actual = in_quantized_cache(empty, kv_cache_dtype), in_quantized_cache(empty, kv_cache_dtype)
    write_kv(expected, rows, rows, slots)
    assert kernels.store_kv(actual, rows, rows, slots)
    assert torch.equal(all_bytes(actual), all_bytes(expected))


def decode_case(
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    spread: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query, K/V values [2, num_blocks, block_size, H_kv, D] in float32, block tables, seq_lens);
    ``spread``: rows of magnitudes two decades apart (wider would leave float32 softmaxes so sharp
    that the order of a dot product's sums shows), else standard normal: softmaxes that two paths
    rounding in bf16 agree on."""
    generator = torch.Generator().manual_seed(sum(seq_lens) + head_dim)
    num_blocks_per_seq = -(-max(seq_lens) // block_size)
    num_blocks = len(seq_lens) * num_blocks_per_seq + 3
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    values = spread_rows(shape, seed=head_dim, decades=2.0) if spread else torch.randn(shape, generator=generator)
    block_tables = torch.randperm(num_blocks, generator=generator)[: len(seq_lens) * num_blocks_per_seq]
    block_tables = block_tables.view(len(seq_lens), num_blocks_per_seq).to(torch.int32)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=generator).to(dtype)
    return query, values, block_tables, torch.tensor(seq_lens, dtype=torch.int32)


def dequantized_reference(
    query: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Float32 attention over the dequantized cache (the torch reference's own decode path)."""
    num_heads, num_kv_heads = query.shape[1], cache.shape[3]
    value_dtype = layer_format(cache)
    assert value_dtype is not None
    plain = dequantize(cache, value_dtype, torch.float32)
    bias = decode_attention_bias(seq_lens, num_heads, num_kv_heads, block_tables.shape[1] * cache.shape[2])
    return paged_decode_attention(query.float(), plain, block_tables, bias, scale)


# Head dims and block sizes that take each ISA's vector paths (multiples of 16 or 8) and its
# scalar ones (40 is a multiple of 8 only, 20 of neither; block size 8 is below AVX-512's 16).
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (8, 8, 128, 16), (4, 1, 32, 8), (6, 2, 48, 32), (4, 2, 40, 16), (2, 1, 20, 16)],
)
def test_native_decode_over_quantized_kv_matches_attention_over_its_dequantized_rows(
    kernels: cpu_kernels.CPUKernels,
    kv_cache_dtype: KVCacheDType,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
) -> None:
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 70]
    query, values, block_tables, lens = decode_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
    cache = in_quantized_cache(values, kv_cache_dtype)
    scale = head_dim**-0.5
    out = kernels.paged_decode_attention(query, cache, block_tables, lens, scale)
    assert out is not None and out.dtype == dtype and not out.isnan().any()
    expected = dequantized_reference(query, cache, block_tables, lens, scale)
    # Outputs are averages of V rows up to 10x the unit: the absolute tolerance scales with them.
    atol = TOLERANCE[dtype] * float(values.abs().max())
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (4, 4)])
def test_verify_rows_over_quantized_kv_match_its_dequantized_rows(
    kernels: cpu_kernels.CPUKernels, kv_cache_dtype: KVCacheDType, num_heads: int, num_kv_heads: int
) -> None:
    """test_cpu_kernels.py's verify rows over quantized rows."""
    query, values, block_tables, lens = verify_runs_case(num_heads, num_kv_heads, torch.float32)
    cache = in_quantized_cache(values, kv_cache_dtype)
    out = kernels.paged_decode_attention(query, cache, block_tables, lens, 0.125)
    assert out is not None
    expected = dequantized_reference(query, cache, block_tables, lens, 0.125)
    torch.testing.assert_close(out, expected, atol=1e-5 * float(values.abs().max()), rtol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
@pytest.mark.parametrize("head_dim", [64, 20])
def test_native_decode_reads_every_code_of_the_format(
    kernels: cpu_kernels.CPUKernels, kv_cache_dtype: KVCacheDType, head_dim: int
) -> None:
    """A context of one token returns its V row exactly: each of the format's byte codes (fp8's two
    NaNs aside; its subnormals included) comes back as torch reads it, times the row's scale, on the
    vector path (head_dim 64) and the scalar one (20)."""
    codes = torch.arange(256, dtype=torch.uint8)
    if kv_cache_dtype == "fp8_e4m3":
        codes = codes[(codes & 0x7F) != 0x7F]
    codes = torch.cat([codes, torch.zeros(-len(codes) % head_dim, dtype=torch.uint8)]).view(-1, head_dim)
    num_seqs = len(codes)
    scale = torch.tensor([0.5]).view(torch.uint8)
    full = torch.full((num_seqs, 3, 2, 16, 1, head_dim + SCALE_BYTES), 0xFF, dtype=torch.uint8)
    rows = layer_view(full, 1)  # [2, blocks, 16, 1, row] bytes
    rows.zero_()
    rows[:, :, 0, 0, :head_dim] = codes  # token 0 of block i: K and V rows of codes[i]
    rows[:, :, 0, 0, head_dim:] = scale
    cache = layer_view(full, 1, kv_cache_dtype)
    query = torch.randn(num_seqs, 2, head_dim)
    block_tables = torch.arange(num_seqs, dtype=torch.int32)[:, None]
    out = kernels.paged_decode_attention(query, cache, block_tables, torch.ones(num_seqs, dtype=torch.int32), 0.125)
    expected = codes.view(VALUE_DTYPES[kv_cache_dtype]).float() * 0.5
    assert torch.equal(out, expected[:, None].expand(-1, 2, -1))


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_native_decode_over_quantized_kv_on_a_batch_big_enough_for_the_thread_team(
    kernels: cpu_kernels.CPUKernels, kv_cache_dtype: KVCacheDType
) -> None:
    seq_lens = [300, 17, 290, 511, 64, 1, 333, 250]
    query, values, block_tables, lens = decode_case(seq_lens, 8, 2, 128, 16, torch.float32)
    cache = in_quantized_cache(values, kv_cache_dtype)
    out = kernels.paged_decode_attention(query, cache, block_tables, lens, 0.09)
    expected = dequantized_reference(query, cache, block_tables, lens, 0.09)
    torch.testing.assert_close(out, expected, atol=1e-5 * float(values.abs().max()), rtol=1e-5)


def decode_and_prefill_metadata(block_tables: torch.Tensor, seq_lens: list[int], prefill_len: int) -> AttentionMetadata:
    """Decodes of ``seq_lens`` (their last tokens new) and, last, a first prefill of ``prefill_len``
    tokens in the block tables' last row."""
    block_size = 16
    slots = [
        int(block_tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size for i, n in enumerate(seq_lens)
    ]
    prefill_row = block_tables[len(seq_lens)]
    slots += [int(prefill_row[p // block_size]) * block_size + p % block_size for p in range(prefill_len)]
    num_decodes = len(seq_lens)
    starts = list(range(num_decodes + 1)) + [num_decodes + prefill_len]
    return AttentionMetadata(
        num_decodes=num_decodes,
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([*seq_lens, prefill_len], dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=prefill_len,
        max_seq_len=max(*seq_lens, prefill_len),
        query_start_loc_cpu=starts,
        seq_lens_cpu=[*seq_lens, prefill_len],
    )


@needs_kernels
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_torch_backend_with_and_without_kernels_agree_on_quantized_kv(
    kv_cache_dtype: KVCacheDType, dtype: torch.dtype
) -> None:
    """Decodes and a prefill in one step: the same bytes stored, and attention within float tolerance."""
    seq_lens = [17, 40, 5]
    query, values, block_tables, _ = decode_case([*seq_lens, 21], 4, 2, 64, 16, dtype, spread=False)
    metadata = decode_and_prefill_metadata(block_tables, seq_lens, 21)
    num_tokens = metadata.num_tokens
    generator = torch.Generator().manual_seed(5)
    query = torch.randn(num_tokens, 4, 64, generator=generator).to(dtype)
    key, value = (torch.randn(num_tokens, 2, 64, generator=generator).to(dtype) for _ in range(2))
    fast_cache, slow_cache = in_quantized_cache(values, kv_cache_dtype), in_quantized_cache(values, kv_cache_dtype)
    native = TorchAttentionBackend(use_cpu_kernels=True)
    fast = native.forward(query, key, value, fast_cache, metadata, 0.125)
    slow = TorchAttentionBackend(use_cpu_kernels=False).forward(query, key, value, slow_cache, metadata, 0.125)
    assert torch.equal(all_bytes(fast_cache), all_bytes(slow_cache))
    torch.testing.assert_close(fast.float(), slow.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_the_kernels_take_no_float16_rows_into_a_quantized_cache(kernels: cpu_kernels.CPUKernels) -> None:
    """Their quantizer reads bf16 or float32; float16 K/V go the torch way instead."""
    cache = in_quantized_cache(torch.zeros(2, 4, 16, 2, 8), "int8")
    key = torch.randn(3, 2, 8, dtype=torch.float16)
    assert not kernels.store_kv(cache, key, key, torch.tensor([1, 2, 3]))
    assert torch.equal(all_bytes(cache), all_bytes(in_quantized_cache(torch.zeros(2, 4, 16, 2, 8), "int8")))


# ------------------------------------------------------------------------------ Triton (interpreter)


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_store_writes_the_reference_bytes(kv_cache_dtype: KVCacheDType, dtype: torch.dtype) -> None:
    from engine.attention.triton_kernels import store_kv

    key, value = strided_kv(7, 2, 32, dtype, seed=6)
    key[2, 0] = 0.0
    slots = torch.tensor([3, 17, 18, 19, 40, 41, 0])
    empty = torch.zeros(2, 4, 16, 2, 32)
    expected, actual = in_quantized_cache(empty, kv_cache_dtype), in_quantized_cache(empty, kv_cache_dtype)
    write_kv(expected, key, value, slots)
    store_kv(actual, key, value, slots)
    assert torch.equal(all_bytes(actual), all_bytes(expected))


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_attention_over_quantized_kv_matches_the_torch_backend(
    kv_cache_dtype: KVCacheDType, dtype: torch.dtype
) -> None:
    """Decodes, and a first prefill, in one launch: both backends read the rows the cache holds
    (the torch backend's prefill rounds its fresh K/V through the format, the kernel reads them
    back from the cache)."""
    from engine.attention.triton_backend import TritonAttentionBackend

    seq_lens = [33, 16, 1]
    query, values, block_tables, _ = decode_case([*seq_lens, 19], 4, 2, 16, 16, dtype, spread=False)
    metadata = decode_and_prefill_metadata(block_tables, seq_lens, 19)
    generator = torch.Generator().manual_seed(7)
    query = torch.randn(metadata.num_tokens, 4, 16, generator=generator).to(dtype)
    key, value = (torch.randn(metadata.num_tokens, 2, 16, generator=generator).to(dtype) for _ in range(2))
    triton_cache, torch_cache = in_quantized_cache(values, kv_cache_dtype), in_quantized_cache(values, kv_cache_dtype)
    scale = 1 / math.sqrt(16)
    out = TritonAttentionBackend().forward(query, key, value, triton_cache, metadata, scale)
    expected = TorchAttentionBackend().forward(query, key, value, torch_cache, metadata, scale)
    assert torch.equal(all_bytes(triton_cache), all_bytes(torch_cache))
    assert not out.isnan().any()
    atol = 2 * TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=atol)


# ----------------------------------------------------------------------------------------- engine


def test_the_engine_sizes_and_lays_out_a_quantized_cache(tmp_path) -> None:
    path = make_checkpoint(tmp_path / "model")  # float32, head_dim 16, 2 KV heads, 2 layers
    plain = LLM(model=str(path), kv_cache_memory=1 << 20).engine.runner
    int8 = LLM(model=str(path), kv_cache_memory=1 << 20, kv_cache_dtype="int8").engine.runner
    assert plain.bytes_per_block == 2 * 2 * 16 * 2 * 16 * 4
    assert int8.bytes_per_block == 2 * 2 * 16 * 2 * (16 + SCALE_BYTES) == int8.kv_cache[0].numel()
    assert int8.kv_cache.dtype == torch.uint8 and int8.kv_format.fingerprint_dtype == "int8/f32-token-head"
    assert all(layer.dtype == torch.int8 for layer in int8.layer_caches)
    assert (
        int8.num_blocks == (1 << 20) // int8.bytes_per_block > 3 * plain.num_blocks
    )  # the same memory, 3.2x the tokens


def test_an_unknown_kv_cache_dtype_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8_e4m3; got 'fp8'"):
        LLM(kv_cache_dtype="fp8")
    assert KV_CACHE_DTYPES == ("auto", "int8", "fp8_e4m3")


def test_round_trip_is_what_a_write_then_a_gather_gives() -> None:
    """The torch backend's prefill without a prefix attends to round_trip(K, V): what its cache holds."""
    from engine.attention.torch_backend import gather_context

    for kv_cache_dtype in QUANTIZED:
        key, value = strided_kv(20, 2, 16, torch.bfloat16, seed=8)
        cache = in_quantized_cache(torch.zeros(2, 3, 16, 2, 16), kv_cache_dtype)
        write_kv(cache, key, value, torch.arange(16, 36))
        k, v = gather_context(cache, torch.tensor([1, 2]), 20, torch.bfloat16)
        value_dtype = VALUE_DTYPES[kv_cache_dtype]
        assert torch.equal(k, round_trip(key, value_dtype)) and torch.equal(v, round_trip(value, value_dtype))


# ------------------------------------------------------------------------------ greedy parity


class RoundTripCache(DynamicCache):
    """transformers' cache, handing attention every K and V as a quantized cache holds them."""

    def __init__(self, value_dtype: torch.dtype, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.value_dtype = value_dtype

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        key_states, value_states = round_trip(key_states, self.value_dtype), round_trip(value_states, self.value_dtype)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class RoundTripReference(Reference):
    """float32 transformers on one prompt at a time, its attention reading K and V rounded through
    the KV format (memoized): what the engine must give over a quantized cache, whose attention
    reads the rows it holds, a prompt's own new ones included."""

    def __init__(self, model_path: Path, kv_cache_dtype: KVCacheDType) -> None:
        super().__init__(model_path)
        self.value_dtype = VALUE_DTYPES[kv_cache_dtype]

    def generate_kwargs(self) -> dict[str, object]:
        return {"cache": RoundTripCache(self.value_dtype, config=self.model.config)}


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_greedy_output_over_a_quantized_kv_cache_equals_transformers_reading_the_same_rows(
    checkpoint: Path, kv_cache_dtype: KVCacheDType
) -> None:
    """Batched prompts across block boundaries, prompts in chunks, prefix-cache hits and preemption
    over 8-bit KV: token for token what float32 transformers gives when its attention reads K and V
    rounded through the same format. (Against unrounded transformers the tokens differ: the figure
    is the next test's.)"""
    path, reference = checkpoint, RoundTripReference(checkpoint, kv_cache_dtype)
    llm = LLM(model=str(path), kv_cache_memory=1 << 24, kv_cache_dtype=kv_cache_dtype)
    assert_matches(llm, random_prompts(VARIED_LENGTHS, seed=1), reference)
    chunked = LLM(model=str(path), kv_cache_memory=1 << 24, max_num_batched_tokens=24, kv_cache_dtype=kv_cache_dtype)
    assert_matches(chunked, random_prompts(VARIED_LENGTHS, seed=1), reference)
    shared = random_prompts([40], seed=2)[0]
    prompts = [shared + suffix for suffix in random_prompts([1, 9, 17, 30], seed=3)]
    assert_matches(llm, prompts[:1], reference)
    outputs = llm.generate(prompts[1:], GREEDY)
    assert [o.num_cached_tokens for o in outputs] == [32, 32, 32]
    assert [o.outputs[0].token_ids for o in outputs] == [reference(p) for p in prompts[1:]]
    assert_no_leaks(llm)
    tight = LLM(model=str(path), num_blocks_override=10, max_num_batched_tokens=64, kv_cache_dtype=kv_cache_dtype)
    assert_matches(tight, random_prompts(PREEMPTION_LENGTHS, seed=4), reference)
    assert tight.engine.scheduler.num_preemptions > 0


# Of the greedy tokens the tiny checkpoints give with float32 KV, the share an engine over 8-bit KV
# gives before its first divergence: measured 0.71 / 0.77 / 0.71 (int8) and 0.38 / 0.40 / 0.38
# (fp8 e4m3) for the Llama / Qwen2 / Mistral checkpoints on an AVX2 EPYC. These random-weight
# models amplify any change of K and V (that is what makes their argmax robust to float rounding
# and not to a format's half step), so the floors below sit well under the figures; a reader that
# gets the rows wrong keeps only the first token, computed from the prompt: about 1 in 12.
AGREEMENT_FLOOR = {"int8": 0.5, "fp8_e4m3": 0.2}


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_greedy_agreement_with_float32_kv_is_measured(checkpoint: Path, kv_cache_dtype: KVCacheDType) -> None:
    reference = Reference(checkpoint)
    prompts = random_prompts(VARIED_LENGTHS, seed=1) + random_prompts(PREEMPTION_LENGTHS, seed=4)
    llm = LLM(model=str(checkpoint), kv_cache_memory=1 << 24, kv_cache_dtype=kv_cache_dtype)
    num_agreeing = 0
    for prompt, output in zip(prompts, llm.generate(prompts, GREEDY), strict=True):
        expected, tokens = reference(prompt), output.outputs[0].token_ids
        num_agreeing += next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), len(expected))
    agreement = num_agreeing / (len(prompts) * MAX_TOKENS)
    assert agreement >= AGREEMENT_FLOOR[kv_cache_dtype], f"{agreement:.3f} agree before the first divergence"
