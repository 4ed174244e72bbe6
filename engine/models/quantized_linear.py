"""Linear layers and embeddings on weights kept in quantized block formats
(engine/models/quant_format.py: GGUF's Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K; INT8 rows).

- Up to ``MAX_KERNEL_ROWS`` rows (decode steps, small batches) go to the native kernels, which
  dequantize each weight block in registers (engine/csrc/quant_linear.c) and so read the
  weight's 4.5 to 8.5 bits per element instead of the 16 or 32 of a float copy. The
  activations stay float32: the result equals the float model of the dequantized weights up
  to summation order. bf16 activations on Q4_0 / Q4_1 blocks, where the CPU has AVX512_BF16,
  take its dot products instead (engine/csrc/quant_bf16.c: the nibbles as exact bf16 integers,
  the block's scale and minimum applied in float32, so the same result up to summation order).
  ``--quant-activations q8`` quantizes them on the fly instead,
  as llama.cpp does, for integer dot products: to Q8_0 blocks for the 32-element formats and
  INT8 (engine/csrc/quant_q8.c), to Q8_K super-blocks for the K-quants (quant_q8k.c); faster,
  and no longer equal to the float model (greedy output can part from it). An INT8 layer
  whose width is not a multiple of 32 keeps float activations.
- More rows (prefill) dequantize the weight a slice of rows at a time and run the float GEMM
  on it, as BF16WeightLinear does for bf16 panels (engine/models/cpu_linear.py): in bf16 for
  bf16 activations where oneDNN has a bf16 matmul (the path the float folder's bf16 layers
  take), else in float32, which on such a CPU made long prefills of the Q4_1 file markedly
  slower than the bf16 folder's (docs/benchmarks.md, "The step thread's OpenMP team").
- Without native kernels (no C compiler) every call dequantizes the whole weight in PyTorch:
  correct, and slow (the GGUF loader dequantizes at load instead, in that case).

Why the row count decides the path: the quantized kernel streams each weight once per call,
which wins while few rows share it; past a few dozen rows, dequantizing slices for the float
GEMM wins. The figures behind both choices are in docs/benchmarks.md, "Quantized weights:
K-quants and int8".
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.cpu_quant_kernels import MAX_KERNEL_ROWS
from engine.models.cpu_linear import linear_path
from engine.models.quant_format import QuantizedWeight

if TYPE_CHECKING:
    from engine.config import QuantActivations

__all__ = ["MAX_KERNEL_ROWS", "QuantBackend", "QuantizedEmbedding", "QuantizedLinear", "MixedQuantizedLinear"]

# Float32 elements of one dequantized weight slice (4 MiB), as cpu_linear's upcast slices.
_SLICE_ELEMENTS = 1 << 20


class QuantBackend(Protocol):
    """The kernels the quantized modules call: the native CPU ones (engine.cpu_quant_kernels) or
    the Triton matmul (engine.models.triton_quant_matmul), same arguments and results."""

    max_kernel_rows: int  # rows up to which ``linear`` beats the float GEMM on dequantized slices

    def supports(self, dtype: torch.dtype) -> bool: ...

    def keeps(self, weight: QuantizedWeight) -> bool:
        """Whether these kernels take the weight's format (one they lack loads dequantized)."""
        ...

    def place(self, weight: QuantizedWeight) -> QuantizedWeight:
        """The weight's blocks where these kernels read them."""
        ...

    def linear(
        self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, q8_activations: bool = False
    ) -> torch.Tensor: ...

    def dequantize_rows(self, weight: QuantizedWeight, start: int, end: int, dtype: torch.dtype) -> torch.Tensor: ...

    def embedding(self, weight: QuantizedWeight, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...


@functools.cache
def _fast_bf16_gemm() -> bool:
    """Whether bf16 slices go through oneDNN's bf16 matmul here (else float32 is the faster GEMM)."""
    return linear_path(torch.device("cpu"), torch.bfloat16) == "onednn-packed"


class QuantizedLinear(nn.Module):
    def __init__(
        self,
        weight: QuantizedWeight,
        bias: nn.Parameter | None,
        kernels: QuantBackend | None,
        activations: QuantActivations = "float",
    ) -> None:
        super().__init__()
        self.qweight = weight
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.bias = bias
        self.kernels = kernels
        self.q8_activations = activations == "q8" and weight.takes_q8_activations
        self.max_kernel_rows = 0 if kernels is None else kernels.max_kernel_rows
        self.slice_rows = max(1, _SLICE_ELEMENTS // self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in_features] -> [T, out_features]
        num_rows = x.shape[0]
        if self.kernels is None or not self.kernels.supports(x.dtype):
            return F.linear(x, self.qweight.dequantize(x.dtype), self.bias)
        if num_rows <= self.max_kernel_rows and x.stride(1) == 1:
            return self.kernels.linear(x, self.qweight, self.bias, self.q8_activations)
        gemm_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 and _fast_bf16_gemm() else torch.float32
        xg = x.to(gemm_dtype)
        out = torch.empty((num_rows, self.out_features), dtype=x.dtype, device=x.device)
        for start in range(0, self.out_features, self.slice_rows):
            end = min(start + self.slice_rows, self.out_features)
            bias = None if self.bias is None else self.bias[start:end].to(gemm_dtype)
            out[:, start:end] = F.linear(xg, self.kernels.dequantize_rows(self.qweight, start, end, gemm_dtype), bias)
        return out

    def extra_repr(self) -> str:
        mode = "q8" if self.q8_activations else "float"
        return f"{self.qweight.format.name}, in={self.in_features}, out={self.out_features}, activations={mode}"


class QuantizedEmbedding(nn.Module):
    """Token embeddings from a quantized table: each lookup dequantizes the rows it reads,
    into the model's compute dtype. A tied LM head multiplies by the same table
    (a :class:`QuantizedLinear` over the same :class:`QuantizedWeight`)."""

    def __init__(self, weight: QuantizedWeight, kernels: QuantBackend | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.qweight = weight
        self.kernels = kernels
        self.dtype = dtype

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        # token_ids: [T] -> [T, hidden]
        if self.kernels is not None and self.kernels.supports(self.dtype):
            return self.kernels.embedding(self.qweight, token_ids.to(torch.int64), self.dtype)
        rows = QuantizedWeight(self.qweight.format, self.qweight.data[token_ids].contiguous(), self.qweight.in_features)
        return rows.dequantize(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.qweight.format.name}, {self.qweight.out_features} x {self.qweight.in_features}"


class MixedQuantizedLinear(nn.Module):
    """A fused projection (q/k/v, gate/up) whose parts come in different formats, as llama.cpp's
    mixes write them (a Q4_K_M file's V rows in Q6_K beside Q and K in Q4_K): one
    :class:`QuantizedLinear` per run of rows of one format, outputs side by side, and the fused
    bias added once."""

    def __init__(self, parts: list[QuantizedLinear], bias: nn.Parameter | None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)
        self.bias = bias
        self.max_kernel_rows = min(part.max_kernel_rows for part in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in_features] -> [T, out_features]
        out = torch.cat([part(x) for part in self.parts], dim=-1)
        return out if self.bias is None else out + self.bias
