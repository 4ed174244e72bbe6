"""The quantized-weight kernels (engine/csrc/quant_linear.c, quant_q8.c) against the ``gguf``
package's own dequantizers, for every format, at the shape edges, on every ISA build this CPU
runs (the AVX-512 builds are compiled and checked only where the CPU runs them).

Float activations: ``x @ dequantize(W).T`` within float32 rounding. Q8 activations: the same
with x first rounded through gguf's own Q8_0 quantizer, which the kernels match exactly, so
that only summation order is left to tolerate.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine import cpu_kernels
from engine.cpu_features import cpu_features
from engine.cpu_quant_kernels import QuantKernels
from engine.models.quant_format import QUANT_FORMATS, QuantizedWeight, QuantType
from engine.models.quantized_linear import MAX_KERNEL_ROWS, QuantizedEmbedding, QuantizedLinear

DEFAULT = cpu_kernels.load()
pytestmark = pytest.mark.skipif(DEFAULT is None, reason="no C compiler here: the torch path is the only one")

ISAS = cpu_features().supported_isas
FORMATS: list[QuantType] = ["Q4_0", "Q4_1", "Q8_0"]
ROWS = [1, 2, 7, 16, 33]
# (out_features, in_features): odd output counts, input features one block and several.
SHAPES = [(1, 32), (33, 96), (67, 256)]


@pytest.fixture(params=ISAS)
def kernels(request: pytest.FixtureRequest) -> QuantKernels:
    loaded = cpu_kernels.load(request.param)
    if loaded is None:
        pytest.fail(f"the {request.param} build failed on a CPU that runs it (see the log)")
    return loaded.quant


def quantized(name: QuantType, out_features: int, in_features: int, seed: int) -> tuple[QuantizedWeight, torch.Tensor]:
    """A random weight in ``name``'s blocks, and gguf's dequantization of it."""
    values = np.random.default_rng(seed).standard_normal((out_features, in_features), dtype=np.float32)
    qtype = gguf.GGMLQuantizationType[name]
    data = gguf.quants.quantize(values, qtype)
    reference = torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32))
    return QuantizedWeight(QUANT_FORMATS[name], torch.from_numpy(data), in_features), reference


def through_q8(x: torch.Tensor) -> torch.Tensor:
    """x rounded to gguf's Q8_0 blocks and back: what the Q8 kernels compute with."""
    q8 = gguf.GGMLQuantizationType.Q8_0
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(x.float().numpy(), q8), q8))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, relative: float) -> None:
    """Within ``relative`` of the largest magnitude: summation order moves each output by a
    few ulps of the partial sums, which are as large as the largest output."""
    scale = expected.abs().max().item() or 1.0
    error = (actual.float() - expected).abs().max().item()
    assert error <= relative * scale, f"max error {error:.3g} against a scale of {scale:.3g}"


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_float_activations_equal_the_dequantized_matmul(kernels: QuantKernels, name: QuantType, shape) -> None:
    weight, reference = quantized(name, *shape, seed=shape[0])
    for num_rows in ROWS:
        x = torch.randn(num_rows, shape[1], generator=torch.Generator().manual_seed(num_rows))
        assert_close(kernels.linear(x, weight, None), x @ reference.T, 1e-5)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_q8_activations_equal_the_matmul_of_q8_rounded_inputs(kernels: QuantKernels, name: QuantType, shape) -> None:
    weight, reference = quantized(name, *shape, seed=shape[0])
    for num_rows in ROWS:
        x = torch.randn(num_rows, shape[1], generator=torch.Generator().manual_seed(num_rows)) * 3
        out = kernels.linear(x, weight, None, q8_activations=True)
        assert_close(out, through_q8(x) @ reference.T, 1e-5)
        # And what that rounding costs against float activations: about 1/254 per block.
        assert_close(out, x @ reference.T, 2e-2)


@pytest.mark.parametrize("q8", [False, True], ids=["float", "q8"])
def test_bf16_activations_bias_and_strided_rows(kernels: QuantKernels, q8: bool) -> None:
    weight, reference = quantized("Q4_1", 33, 96, seed=1)
    wide = torch.randn(7, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x = wide[:, :96]  # rows 128 elements apart
    bias = torch.randn(33, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out = kernels.linear(x, weight, bias, q8_activations=q8)
    assert out.dtype == torch.bfloat16
    inputs = through_q8(x) if q8 else x.float()
    # One bf16 rounding of the result: 2^-8 of it.
    assert_close(out, inputs @ reference.T + bias.float(), 2**-8)


@pytest.mark.parametrize("name", FORMATS)
def test_dequantized_rows_and_embedding_lookups_equal_gguf(kernels: QuantKernels, name: QuantType) -> None:
    weight, reference = quantized(name, 67, 96, seed=4)
    torch.testing.assert_close(
        kernels.dequantize_rows(weight, 5, 40, torch.float32), reference[5:40], rtol=0, atol=1e-6
    )
    ids = torch.tensor([66, 0, 3, 3, 17])
    torch.testing.assert_close(kernels.embedding(weight, ids, torch.float32), reference[ids], rtol=0, atol=1e-6)
    torch.testing.assert_close(kernels.embedding(weight, ids, torch.bfloat16), reference[ids].to(torch.bfloat16))
    with pytest.raises(IndexError, match="outside the 67 rows"):
        kernels.embedding(weight, torch.tensor([1, 67]), torch.float32)


@pytest.mark.parametrize("name", FORMATS)
def test_the_pytorch_dequantization_equals_gguf_exactly(name: QuantType) -> None:
    weight, reference = quantized(name, 33, 96, seed=5)
    assert torch.equal(weight.dequantize(), reference)


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


@pytest.mark.parametrize("q8", [False, True], ids=["float", "q8"])
def test_quantized_linear_takes_prefill_rows_through_dequantized_slices(q8: bool) -> None:
    weight, reference = quantized("Q4_0", 67, 96, seed=7)
    bias = torch.nn.Parameter(torch.randn(67))
    linear = QuantizedLinear(weight, bias, DEFAULT.quant, "q8" if q8 else "float")
    linear.slice_rows = 10  # several slices, the last one short
    x = torch.randn(MAX_KERNEL_ROWS + 5, 96)
    assert_close(linear(x), x @ reference.T + bias.detach(), 1e-5)
    # Without kernels: the PyTorch dequantization, same result.
    assert_close(QuantizedLinear(weight, bias, None)(x), x @ reference.T + bias.detach(), 1e-5)


def test_quantized_embedding_with_and_without_kernels() -> None:
    weight, reference = quantized("Q8_0", 50, 64, seed=8)
    ids = torch.tensor([3, 49, 0])
    for kernels in (DEFAULT.quant, None):
        torch.testing.assert_close(QuantizedEmbedding(weight, kernels, torch.float32)(ids), reference[ids])
