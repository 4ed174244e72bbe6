"""The quantized-weight kernels (engine/csrc/quant_linear.c, quant_bf16.c, quant_q8.c, quant_q8k.c) against
the ``gguf`` package's own dequantizers, for every format, at the shape edges, on every ISA
build this CPU runs (the others are skipped, saying why: the AVX-512 builds are compiled and
checked only where the CPU runs them).

Float activations: ``x @ dequantize(W).T`` within float32 rounding. Q8 activations: the same
with x first rounded through gguf's own Q8_0 quantizer (for the K-quants, llama.cpp's Q8_K
rounding, tests/engine/kquants.py), which the kernels match exactly, so that only summation
order is left to tolerate. The K-quant weights are blocks built by tests/engine/kquants.py
(gguf cannot quantize them) and dequantized by gguf; INT8 rows have no gguf type, and their
reference is their definition, ``scale * q``.
"""

from __future__ import annotations

from unittest import mock

import gguf
import numpy as np
import pytest
import torch

from engine import cpu_kernels
from engine.cpu_features import KERNEL_ISAS, cpu_features
from engine.cpu_quant_kernels import QuantKernels
from engine.models.int8_quantize import quantize_int8
from engine.models.quant_format import QUANT_FORMATS, QuantizedWeight, QuantType
from engine.models.quantized_linear import MAX_KERNEL_ROWS, QuantizedEmbedding, QuantizedLinear
from tests.engine.kquants import quantize, through_q8_k

DEFAULT = cpu_kernels.load()
pytestmark = pytest.mark.skipif(DEFAULT is None, reason="no C compiler here: the torch path is the only one")

FORMATS: list[QuantType] = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "INT8"]
K_QUANTS: tuple[QuantType, ...] = ("Q4_K", "Q5_K", "Q6_K")
ROWS = [1, 2, 7, 16, 33]
# (out_features, in_features): odd output counts; input features one block and several (INT8:
# widths that leave a tail past the 32-element blocks and the SIMD width, and one under a block).
SHAPES: dict[QuantType, list[tuple[int, int]]] = {
    **{name: [(1, 32), (33, 96), (67, 256)] for name in ("Q4_0", "Q4_1", "Q8_0")},
    **{name: [(1, 256), (33, 512), (67, 768)] for name in K_QUANTS},
    "INT8": [(1, 5), (33, 96), (67, 301)],
}
CASES = [(name, shape) for name in FORMATS for shape in SHAPES[name]]


def case_id(case: tuple[QuantType, tuple[int, int]]) -> str:
    return f"{case[0]}-{case[1][0]}x{case[1][1]}"


@pytest.fixture(params=KERNEL_ISAS)
def kernels(request: pytest.FixtureRequest) -> QuantKernels:
    features = cpu_features()
    if request.param not in features.supported_isas:
        pytest.skip(f"this CPU ({features.describe()}) does not run the {request.param} build")
    loaded = cpu_kernels.load(request.param)
    if loaded is None:
        pytest.fail(f"the {request.param} build failed on a CPU that runs it (see the log)")
    return loaded.quant


def quantized(name: QuantType, out_features: int, in_features: int, seed: int) -> tuple[QuantizedWeight, torch.Tensor]:
    """A random weight in ``name``'s blocks, and gguf's dequantization of it (INT8's: scale * q)."""
    values = np.random.default_rng(seed).standard_normal((out_features, in_features), dtype=np.float32)
    if name == "INT8":
        weight = quantize_int8(torch.from_numpy(values))
        return weight, weight.data[:, 4:].view(torch.int8).float() * weight.row_scales.unsqueeze(1)
    qtype = gguf.GGMLQuantizationType[name]
    data = quantize(values, qtype)
    reference = torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32))
    return QuantizedWeight(QUANT_FORMATS[name], torch.from_numpy(data), in_features), reference


def through_q8(x: torch.Tensor, name: QuantType = "Q8_0") -> torch.Tensor:
    """x rounded to the blocks the Q8 kernels take and back: gguf's Q8_0 blocks, or for the
    K-quants llama.cpp's Q8_K super-blocks."""
    if name in K_QUANTS:
        return torch.from_numpy(through_q8_k(x.float().numpy()))
    q8 = gguf.GGMLQuantizationType.Q8_0
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(x.float().numpy(), q8), q8))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, relative: float) -> None:
    """Within ``relative`` of the largest magnitude: summation order moves each output by a
    few ulps of the partial sums, which are as large as the largest output."""
    scale = expected.abs().max().item() or 1.0
    error = (actual.float() - expected).abs().max().item()
    assert error <= relative * scale, f"max error {error:.3g} against a scale of {scale:.3g}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_float_activations_equal_the_dequantized_matmul(kernels: QuantKernels, case) -> None:
    name, (out_features, in_features) = case
    weight, reference = quantized(name, out_features, in_features, seed=out_features)
    for num_rows in ROWS:
        x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(num_rows))
        assert_close(kernels.linear(x, weight, None), x @ reference.T, 1e-5)


@pytest.mark.parametrize("case", [case for case in CASES if case[1][1] % 32 == 0], ids=case_id)
def test_q8_activations_equal_the_matmul_of_q8_rounded_inputs(kernels: QuantKernels, case) -> None:
    name, (out_features, in_features) = case
    weight, reference = quantized(name, out_features, in_features, seed=out_features)
    for num_rows in ROWS:
        x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(num_rows)) * 3
        out = kernels.linear(x, weight, None, q8_activations=True)
        assert_close(out, through_q8(x, name) @ reference.T, 1e-5)
        # And what that rounding costs against float activations: about 1/254 per block.
        assert_close(out, x @ reference.T, 2e-2)


def test_q8_activations_match_llama_cpp_rounding_at_its_edges(kernels: QuantKernels) -> None:
    """Q8_K's scale follows the signed extreme of each super-block (a positive one maps to -127),
    and an all-zero super-block has scale 0: both against the reference rounding."""
    weight, reference = quantized("Q6_K", 9, 512, seed=11)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(12))
    x[0, 7], x[1, 300] = 40.0, -40.0  # a positive and a negative extreme
    x[2, 256:] = 0.0
    assert_close(kernels.linear(x, weight, None, q8_activations=True), through_q8(x, "Q6_K") @ reference.T, 1e-5)


@pytest.mark.parametrize("case", [case for case in CASES if case[0] in ("Q4_0", "Q4_1")], ids=case_id)
def test_bf16_activations_on_4_bit_blocks_lose_only_the_outputs_rounding(kernels: QuantKernels, case) -> None:
    """bf16 inputs against Q4_0 / Q4_1 blocks (where the CPU has AVX512_BF16, its dot products:
    quant_bf16.c) keep the weights exact: each output is within its own bf16 rounding of the exact
    product, plus float32 summation error, for every tile height."""
    name, (out_features, in_features) = case
    weight, reference = quantized(name, out_features, in_features, seed=out_features)
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    for num_rows in ROWS:
        x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(num_rows)).to(torch.bfloat16)
        out = kernels.linear(x, weight, bias)
        exact = x.double() @ reference.double().T + bias.double()
        error = (out.double() - exact).abs()
        bound = 2**-8 * exact.abs() + 1e-5 * exact.abs().max()
        assert bool((error <= bound).all()), f"{num_rows} rows: worst excess {(error - bound).max().item():.3g}"


@pytest.mark.parametrize("q8", [False, True], ids=["float", "q8"])
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q4_K", "Q6_K", "INT8"])
def test_bf16_activations_bias_and_strided_rows(kernels: QuantKernels, q8: bool, name: QuantType) -> None:
    in_features = 256 if name in K_QUANTS else 96
    weight, reference = quantized(name, 33, in_features, seed=1)
    wide = torch.randn(7, in_features + 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x = wide[:, :in_features]  # rows in_features + 32 elements apart
    bias = torch.randn(33, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out = kernels.linear(x, weight, bias, q8_activations=q8)
    assert out.dtype == torch.bfloat16
    inputs = through_q8(x, name) if q8 else x.float()
    # One bf16 rounding of the result: 2^-8 of it.
    assert_close(out, inputs @ reference.T + bias.float(), 2**-8)


@pytest.mark.parametrize("name", FORMATS)
def test_dequantized_rows_and_embedding_lookups_equal_gguf(kernels: QuantKernels, name: QuantType) -> None:
    weight, reference = quantized(name, 67, {"INT8": 101, **dict.fromkeys(K_QUANTS, 512)}.get(name, 96), seed=4)
    torch.testing.assert_close(
        kernels.dequantize_rows(weight, 5, 40, torch.float32), reference[5:40], rtol=0, atol=1e-6
    )
    # bf16 slices (a prefill's GEMM in bf16): each value rounded once, to nearest even, as torch rounds.
    bf16_rows = kernels.dequantize_rows(weight, 5, 40, torch.bfloat16)
    assert torch.equal(bf16_rows, kernels.dequantize_rows(weight, 5, 40, torch.float32).to(torch.bfloat16))
    ids = torch.tensor([66, 0, 3, 3, 17])
    torch.testing.assert_close(kernels.embedding(weight, ids, torch.float32), reference[ids], rtol=0, atol=1e-6)
    torch.testing.assert_close(kernels.embedding(weight, ids, torch.bfloat16), reference[ids].to(torch.bfloat16))
    with pytest.raises(IndexError, match="outside the 67 rows"):
        kernels.embedding(weight, torch.tensor([1, 67]), torch.float32)


@pytest.mark.parametrize("name", FORMATS)
def test_the_pytorch_dequantization_equals_gguf_exactly(name: QuantType) -> None:
    weight, reference = quantized(name, 33, 512 if name in K_QUANTS else 96, seed=5)
    assert torch.equal(weight.dequantize(), reference)


def test_the_k_quant_blocks_built_for_the_tests_hold_their_values() -> None:
    """tests/engine/kquants.py lays its blocks out as llama.cpp does: gguf's dequantizers read them
    back to the values within each format's step (so a layout slip cannot pass as rounding)."""
    values = np.random.default_rng(9).standard_normal((16, 512), dtype=np.float32)
    for name, bound in (("Q4_K", 0.25), ("Q5_K", 0.12), ("Q6_K", 0.08)):
        qtype = gguf.GGMLQuantizationType[name]
        error = np.abs(gguf.quants.dequantize(quantize(values, qtype), qtype) - values)
        assert error.max() < bound, name


def test_int8_rows_are_per_channel_symmetric_and_within_half_a_step() -> None:
    values = torch.randn(9, 70, generator=torch.Generator().manual_seed(10)) * torch.arange(1, 10).unsqueeze(1)
    values[4] = 0.0
    weight = quantize_int8(values)
    assert weight.nbytes == 9 * (70 + 4)
    scale = weight.row_scales
    torch.testing.assert_close(scale, values.abs().amax(dim=1) / 127)
    assert weight.data[:, 4:].view(torch.int8).abs().max() == 127 and scale[4] == 0
    assert ((weight.dequantize() - values).abs() <= scale.unsqueeze(1) / 2 + 1e-6).all()


def test_rows_and_block_aligned_columns_slice_the_blocks() -> None:
    weight, reference = quantized("Q4_1", 33, 128, seed=6)
    assert torch.equal(weight.rows(3, 10).dequantize(), reference[3:13])
    assert torch.equal(weight.columns(32, 64).dequantize(), reference[:, 32:96])
    assert torch.equal(weight.permute_rows(torch.arange(33).flip(0)).dequantize(), reference.flip(0))
    assert torch.equal(weight.pad_rows(2).dequantize()[33:], torch.zeros(2, 128))
    both = QuantizedWeight.cat_rows([weight.rows(0, 5), weight.rows(5, 28)])
    assert torch.equal(both.data, weight.data)
    with pytest.raises(ValueError, match="whole 32-element blocks"):
        weight.columns(16, 32)
    k_weight, k_reference = quantized("Q5_K", 5, 768, seed=6)
    assert torch.equal(k_weight.columns(256, 512).dequantize(), k_reference[:, 256:])
    with pytest.raises(ValueError, match="whole 256-element blocks"):
        k_weight.columns(128, 256)
    int8_weight, int8_reference = quantized("INT8", 5, 70, seed=6)
    assert torch.equal(int8_weight.columns(3, 50).dequantize(), int8_reference[:, 3:53])  # any split, scale kept


@pytest.mark.parametrize("q8", [False, True], ids=["float", "q8"])
@pytest.mark.parametrize("name", ["Q4_0", "Q5_K", "INT8"])
def test_quantized_linear_takes_prefill_rows_through_dequantized_slices(q8: bool, name: QuantType) -> None:
    in_features = 256 if name in K_QUANTS else 96
    weight, reference = quantized(name, 67, in_features, seed=7)
    bias = torch.nn.Parameter(torch.randn(67))
    linear = QuantizedLinear(weight, bias, DEFAULT.quant, "q8" if q8 else "float")
    linear.slice_rows = 10  # several slices, the last one short
    x = torch.randn(MAX_KERNEL_ROWS + 5, in_features)
    assert_close(linear(x), x @ reference.T + bias.detach(), 1e-5)
    # Without kernels: the PyTorch dequantization, same result.
    assert_close(QuantizedLinear(weight, bias, None)(x), x @ reference.T + bias.detach(), 1e-5)


@pytest.mark.parametrize("fast_bf16_gemm", [True, False], ids=["bf16 GEMM", "float32 GEMM"])
def test_bf16_prefill_rows_run_the_gemm_in_bf16_where_onednn_has_one(fast_bf16_gemm: bool) -> None:
    """bf16 activations take the slices in bf16 where oneDNN has a bf16 matmul (the float
    folder's bf16 layers' path: in float32 a 1,024-token prefill took 1.7x as long), in
    float32 elsewhere; either way the result is the bf16 model's up to bf16 rounding."""
    weight, reference = quantized("Q4_1", 67, 96, seed=8)
    torch.manual_seed(8)
    bias = torch.nn.Parameter(torch.randn(67, dtype=torch.bfloat16))
    linear = QuantizedLinear(weight, bias, DEFAULT.quant)
    linear.slice_rows = 10
    x = torch.randn(MAX_KERNEL_ROWS + 5, 96).to(torch.bfloat16)
    slice_dtypes = []
    dequantize_rows = DEFAULT.quant.dequantize_rows

    def recorded(*args: object) -> torch.Tensor:
        rows = dequantize_rows(*args)  # type: ignore[arg-type]
        slice_dtypes.append(rows.dtype)
        return rows

    with (
        mock.patch("engine.models.quantized_linear._fast_bf16_gemm", return_value=fast_bf16_gemm),
        mock.patch.object(DEFAULT.quant, "dequantize_rows", recorded),
    ):
        out = linear(x)
    assert out.dtype == torch.bfloat16
    assert set(slice_dtypes) == {torch.bfloat16 if fast_bf16_gemm else torch.float32}
    expected = x.float() @ reference.T + bias.detach().float()
    # Weights and output rounded to bf16 (2^-9 each, relative) at most, summed over the products.
    bound = 2.0**-7 * (x.float().abs() @ reference.abs().T + bias.detach().float().abs())
    assert bool(((out.float() - expected).abs() <= bound).all())


def test_quantized_embedding_with_and_without_kernels() -> None:
    weight, reference = quantized("Q8_0", 50, 64, seed=8)
    ids = torch.tensor([3, 49, 0])
    for kernels in (DEFAULT.quant, None):
        torch.testing.assert_close(QuantizedEmbedding(weight, kernels, torch.float32)(ids), reference[ids])


def test_int8_layers_whose_width_is_not_whole_q8_blocks_keep_float_activations() -> None:
    weight, reference = quantized("INT8", 9, 301, seed=13)
    linear = QuantizedLinear(weight, None, DEFAULT.quant, "q8")
    assert not linear.q8_activations
    x = torch.randn(3, 301)
    assert_close(linear(x), x @ reference.T, 1e-5)
    assert QuantizedLinear(quantized("INT8", 9, 96, seed=13)[0], None, DEFAULT.quant, "q8").q8_activations
