"""The Triton dequantizing matmul (engine/models/triton_quant_matmul.py) against the ``gguf``
package's own dequantizers, under the Triton interpreter on CPU (tests/conftest.py sets
``TRITON_INTERPRET=1``): every format it takes, at the shape edges (one row and rows past a
tile, one weight row and a tile's worth plus a few, input features of one block and several;
INT8 widths with a tail past the 32-column tiles), float32 and bfloat16 activations, with and
without a bias. A GPU is not here: on one the kernel is untested."""

from __future__ import annotations

import pytest
import torch

from engine.models.quant_format import QuantType
from engine.models.triton_quant_matmul import quant_matmul, supports
from tests.engine.test_quantized_kernels import SHAPES, quantized

FORMATS: list[QuantType] = ["Q4_0", "Q4_1", "Q8_0", "INT8"]
CASES = [(name, shape) for name in FORMATS for shape in SHAPES[name]]
ROWS = [1, 7, 17]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("name", "shape"), CASES, ids=[f"{n}-{s[0]}x{s[1]}" for n, s in CASES])
def test_equals_the_dequantized_weights_matmul(name: QuantType, shape: tuple[int, int], rows: int) -> None:
    out_features, in_features = shape
    weight, reference = quantized(name, out_features, in_features, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(out_features))
    bias = torch.randn(out_features)
    y = quant_matmul(x, weight, bias)
    expected = x @ reference.T + bias
    assert y.dtype == torch.float32 and y.shape == (rows, out_features)
    torch.testing.assert_close(y, expected, atol=1e-4 * in_features**0.5, rtol=1e-4)


@pytest.mark.parametrize("name", FORMATS)
def test_bfloat16_activations_accumulate_in_float32(name: QuantType) -> None:
    weight, reference = quantized(name, 40, 96, seed=1)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    y = quant_matmul(x, weight)
    assert y.dtype == torch.bfloat16
    # The float32 product of the same (bf16) inputs, rounded once to bf16 as the kernel stores it.
    torch.testing.assert_close(y, (x.float() @ reference.T).to(torch.bfloat16), atol=2e-2, rtol=1e-2)


def test_a_strided_view_of_activations_reads_its_own_rows() -> None:
    weight, reference = quantized("Q4_1", 33, 96, seed=3)
    wide = torch.randn(6, 200, generator=torch.Generator().manual_seed(4))
    x = wide[:, 50:146]  # rows 200 elements apart
    torch.testing.assert_close(quant_matmul(x, weight), x @ reference.T, atol=1e-3, rtol=1e-4)


def test_formats_without_a_kernel_are_refused() -> None:
    weight, _ = quantized("Q4_K", 1, 256, seed=0)
    assert not supports(weight)
    with pytest.raises(ValueError, match="no Triton kernel for Q4_K"):
        quant_matmul(torch.zeros(1, 256), weight)
