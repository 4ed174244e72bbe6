"""The Triton dequantizing matmul (engine/models/triton_quant_matmul.py) against the ``gguf``
package's own dequantizers, under the Triton interpreter on CPU (tests/conftest.py sets
``TRITON_INTERPRET=1``): every format it takes, at the shape edges (one row and rows past a
tile, one weight row and a tile's worth plus a few, input features of one block and several;
INT8 widths with a tail past the 32-column tiles), float32 and bfloat16 activations, with and
without a bias; and GGUF models loaded for it (``SPLITSERVE_QUANT_KERNELS=triton``, as a GPU loads
them) against their dequantized float models. A GPU is not here: on one the kernel is untested."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.models.quant_format import QuantType
from engine.models.quantized_linear import QuantizedLinear
from engine.models.quantized_model import QUANT_KERNELS_ENV
from engine.models.triton_quant_matmul import TritonQuantKernels, quant_matmul
from engine.sampling_params import SamplingParams
from tests.checkpoints import random_prompts
from tests.engine.gguf_checkpoints import K_QUANT_MODEL, make_gguf, mixed_qkv, q4_k_m
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
    assert not TritonQuantKernels.keeps(weight)
    with pytest.raises(ValueError, match="no Triton kernel for Q4_K"):
        quant_matmul(torch.zeros(1, 256), weight)


@pytest.fixture
def triton_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Load quantized weights for the Triton kernel, as on a GPU (here under the interpreter)."""
    monkeypatch.setenv(QUANT_KERNELS_ENV, "triton")


def _greedy(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with LLM(model=str(path), kv_cache_memory=1 << 22) as llm:
        return [output.outputs[0].token_ids for output in llm.generate(prompts, params)]


@pytest.mark.usefixtures("triton_kernels")
def test_a_gguf_model_on_the_triton_kernel_keeps_its_blocks_and_equals_the_float_model(tmp_path: Path) -> None:
    """Q in Q4_0, K and V in Q8_0, the rest Q4_1, and a tied Q8_0 embedding: every linear layer
    calls the Triton kernel (prefill rows and decode rows alike), and the greedy tokens are the
    dequantized float model's."""
    checkpoint = make_gguf(tmp_path, mixed_qkv, tie_word_embeddings=True)
    prompts = random_prompts([5, 23], seed=2)
    with LLM(model=str(checkpoint.path), kv_cache_memory=1 << 22) as llm:
        model = llm.engine.runner.model
        linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
        assert linears and all(isinstance(m.kernels, TritonQuantKernels) for m in linears)
        assert not any(type(m) is torch.nn.Linear for m in model.modules())
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        outputs = [output.outputs[0].token_ids for output in llm.generate(prompts, params)]
    assert outputs == _greedy(checkpoint.dequantized, prompts)


@pytest.mark.usefixtures("triton_kernels")
def test_k_quant_layers_load_dequantized_beside_the_triton_kernel(tmp_path: Path) -> None:
    """llama.cpp's Q4_K_M mix has no Triton kernel: its layers load as float ones."""
    checkpoint = make_gguf(tmp_path, q4_k_m, **K_QUANT_MODEL)
    prompts = random_prompts([7], seed=3)
    with LLM(model=str(checkpoint.path), kv_cache_memory=1 << 22) as llm:
        model = llm.engine.runner.model
        assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        outputs = [output.outputs[0].token_ids for output in llm.generate(prompts, params)]
    assert outputs == _greedy(checkpoint.dequantized, prompts)
