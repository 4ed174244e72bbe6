"""A dequantizing matmul in Triton, for accelerators: ``y = x @ w.T + bias`` where ``w`` stays
in its quantized blocks (engine/models/quant_format.py) and each block is dequantized in
registers, tile by tile, so that a step reads the weight's 4.5 to 8.5 bits per element.

Formats: GGUF's 32-element ones (Q4_0, Q4_1, Q8_0) and splitserve's INT8 rows (the K-quants'
super-blocks are not here: a GPU loads them dequantized). Each program computes a
``[BLOCK_M, BLOCK_N]`` tile of ``y`` and walks the input features one 32-element block at a
time: it reads that block of ``BLOCK_N`` weight rows (its fp16 scale, Q4_1's fp16 minimum, its
16 bytes of nibbles or 32 int8 values), dequantizes it as ``gguf``'s dequantizers do (Q4_0:
``(q - 8) * d``; Q4_1: ``q * d + m``; Q8_0: ``q * d``, where element ``j < 16`` of a 4-bit block is
byte ``j``'s low nibble and ``j >= 16`` byte ``j - 16``'s high one) and multiplies it with the
activations' block. INT8 rows apply their per-row scale once, to the finished tile.

The activations are widened to float32 and the products accumulate in float32 (``tl.dot`` in
IEEE float32: no TF32 rounding), so the result equals ``x.float() @ w.dequantize().T`` up to
summation order. Tested under the Triton interpreter on CPU only (``TRITON_INTERPRET=1``,
tests/engine/test_triton_quant_matmul.py): **untested on a GPU**.

:class:`TritonQuantKernels` is the quantized modules' backend built on it
(engine/models/quantized_linear.py's ``QuantBackend``): what a GGUF file or ``--quantization
int8`` loads with on a GPU (engine/models/quantized_model.py), every row count through the
kernel; embedding rows are dequantized with PyTorch where they are looked up.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from engine.models.quant_format import QuantizedWeight

# FORMAT of the kernel.
_FORMATS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "INT8": 3}
_BLOCK_K = 32  # the 32-element formats' block; INT8 columns in runs of as many
# The smallest tile tl.dot takes on each side.
_MIN_DOT = 16


@triton.jit
def _fp16_at(row_ptrs, offset):
    """The little-endian fp16 at ``row_ptrs + offset`` (uint8 pointers), as float32."""
    low = tl.load(row_ptrs + offset).to(tl.uint16)
    high = tl.load(row_ptrs + offset + 1).to(tl.uint16)
    return (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _quant_matmul_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    row_bytes,
    FORMAT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < M
    col_mask = cols < N
    # Each output column's weight row, as bytes (rows past N read row 0, and are masked out).
    w_rows = w_ptr + tl.where(col_mask, cols, 0).to(tl.int64) * row_bytes
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for block in range(0, tl.cdiv(K, BLOCK_K)):
        k = block * BLOCK_K + ks
        k_mask = k < K
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_xm + k[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        if FORMAT == 3:  # INT8: 4 bytes of scale, then one int8 a column
            q = tl.load(w_rows[:, None] + 4 + k[None, :], mask=k_mask[None, :], other=0).to(tl.int8, bitcast=True)
            w = q.to(tl.float32)
        else:
            base = w_rows[:, None]
            if FORMAT == 0:  # Q4_0: fp16 d, 16 bytes of nibbles
                d = _fp16_at(w_rows, block * 18)
                nibble_at = base + block * 18 + 2 + (ks[None, :] % 16)
                q = (tl.load(nibble_at) >> ((ks[None, :] // 16) * 4)) & 0x0F
                w = (q.to(tl.float32) - 8.0) * d[:, None]
            elif FORMAT == 1:  # Q4_1: fp16 d, fp16 m, 16 bytes of nibbles
                d = _fp16_at(w_rows, block * 20)
                m = _fp16_at(w_rows, block * 20 + 2)
                nibble_at = base + block * 20 + 4 + (ks[None, :] % 16)
                q = (tl.load(nibble_at) >> ((ks[None, :] // 16) * 4)) & 0x0F
                w = q.to(tl.float32) * d[:, None] + m[:, None]
            else:  # Q8_0: fp16 d, 32 int8
                d = _fp16_at(w_rows, block * 34)
                q = tl.load(base + block * 34 + 2 + ks[None, :]).to(tl.int8, bitcast=True)
                w = q.to(tl.float32) * d[:, None]
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    if FORMAT == 3:
        acc *= tl.load(scale_ptr + cols, mask=col_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def quant_matmul(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None, block_n: int = 64
) -> torch.Tensor:
    """``x [M, in_features] @ weight.T (+ bias)`` -> ``[M, out_features]`` in ``x``'s dtype, with
    ``weight.data`` on ``x``'s device (the CPU under the interpreter)."""
    name = weight.format.name
    if name not in _FORMATS:
        raise ValueError(f"no Triton kernel for {name} weights (Q4_0, Q4_1, Q8_0 and INT8 have one)")
    if x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"activations {tuple(x.shape)} do not match a weight of shape {weight.shape}")
    if x.stride(1) != 1:
        x = x.contiguous()
    num_rows, num_out = x.shape[0], weight.out_features
    y = torch.empty((num_rows, num_out), dtype=x.dtype, device=x.device)
    if num_rows == 0 or num_out == 0:
        return y
    data = weight.data if weight.data.device == x.device else weight.data.to(x.device)
    scales = weight.row_scales.to(x.device) if name == "INT8" else data  # unread unless INT8
    block_m = max(_MIN_DOT, min(64, triton.next_power_of_2(num_rows)))
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(num_out, block_n))
    _quant_matmul_kernel[grid](
        x,
        data,
        scales,
        bias if bias is not None else y,
        y,
        num_rows,
        num_out,
        weight.in_features,
        x.stride(0),
        y.stride(0),
        data.shape[1],
        FORMAT=_FORMATS[name],
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=_BLOCK_K,
    )
    return y


class TritonQuantKernels:
    """The quantized modules' kernels on ``device``: :func:`quant_matmul` for every linear layer
    (prefill rows too: it tiles them), PyTorch for the embedding rows a step looks up."""

    max_kernel_rows = sys.maxsize

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype.is_floating_point

    @staticmethod
    def keeps(weight: QuantizedWeight) -> bool:
        """Whether the kernel takes the weight's format (a K-quant one is loaded dequantized)."""
        return weight.format.name in _FORMATS

    def place(self, weight: QuantizedWeight) -> QuantizedWeight:
        """The weight's blocks on this backend's device."""
        return QuantizedWeight(weight.format, weight.data.to(self.device), weight.in_features)

    def linear(
        self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, q8_activations: bool = False
    ) -> torch.Tensor:
        """``q8_activations`` is ignored: the activations stay float (float32 in the kernel)."""
        return quant_matmul(x, weight, bias)

    def dequantize_rows(self, weight: QuantizedWeight, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        return weight.rows(start, end - start).dequantize(dtype)

    def embedding(self, weight: QuantizedWeight, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows = QuantizedWeight(weight.format, weight.data[token_ids].contiguous(), weight.in_features)
        return rows.dequantize(dtype)
