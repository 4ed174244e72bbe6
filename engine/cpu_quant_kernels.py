"""Typed wrappers over the quantized-weight kernels (engine/csrc/quant_linear.c, quant_q8.c,
quant_q8k.c), which the CPU kernel library of :mod:`engine.cpu_kernels` carries:
``CPUKernels.quant``.

The weights are :class:`engine.models.quant_format.QuantizedWeight` blocks as the GGUF file
holds them (or INT8 rows); activations and outputs are float32 or bf16 (the model's compute
dtype). Like
the other wrappers these are on the per-token path: they allocate the output and pass
pointers, no more.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # at run time only its attributes are read: importing it would load engine.models
    from engine.models.quant_format import QuantizedWeight

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_DTYPES = {torch.bfloat16: 1, torch.float32: 0}
# Rows up to which :meth:`QuantKernels.linear` beats dequantizing slices of the weight for the
# float GEMM (engine/models/quantized_linear.py's docstring has the figures).
MAX_KERNEL_ROWS = 32


class QuantKernels:
    max_kernel_rows = MAX_KERNEL_ROWS

    def __init__(self, library: ctypes.CDLL, bind: Callable[..., Any]) -> None:
        """``bind(library, name, restype, argtypes)``: engine.cpu_kernels' binder, one for the library."""
        self._library = library  # keeps the handle alive as long as the bound functions
        linear_args = [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _INT, _INT]
        self._linear = bind(library, "quant_linear", _INT, linear_args)
        self._linear_q8 = bind(library, "quant_linear_q8", _INT, linear_args)
        self._dequantize_rows = bind(library, "quant_dequantize_rows", _INT, [_P, _P] + [_I64] * 4 + [_INT, _P, _INT])

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype in _DTYPES

    @staticmethod
    def keeps(weight: QuantizedWeight) -> bool:
        """Every format of engine.models.quant_format has a kernel here."""
        return True

    @staticmethod
    def place(weight: QuantizedWeight) -> QuantizedWeight:
        """The blocks stay where they are: on the CPU."""
        return weight

    def linear(
        self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, q8_activations: bool = False
    ) -> torch.Tensor:
        """x: [T, in] with contiguous rows, bias: [out], both of one :meth:`supports`-ed dtype.
        Returns ``x @ dequantize(weight).T + bias``: [T, out] in x's dtype, accumulated in float32.
        ``q8_activations``: x rounded to Q8_0 blocks first (Q8_K super-blocks for the K-quants),
        for integer dot products (engine/csrc/quant_q8.c, quant_q8k.c), where the weight
        :attr:`~QuantizedWeight.takes_q8_activations`; otherwise x stays float
        (engine/csrc/quant_linear.c)."""
        num_rows, in_features = x.shape
        out = torch.empty(num_rows, weight.out_features, dtype=x.dtype)
        status = (self._linear_q8 if q8_activations else self._linear)(
            x.data_ptr(),
            x.stride(0),
            weight.data.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            num_rows,
            in_features,
            weight.out_features,
            weight.format.code,
            _DTYPES[x.dtype],
        )
        if status == -1:
            raise MemoryError(f"quant_linear: no memory for a float32 copy of a {num_rows} x {in_features} input")
        if status != 0:
            raise RuntimeError(
                f"quant_linear{'_q8' if q8_activations else ''} refused a {weight.format.name} weight of "
                f"{weight.shape} (bug)"
            )
        return out

    def dequantize_rows(self, weight: QuantizedWeight, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``start..end`` of the weight as a float tensor [end - start, in_features] of ``dtype``."""
        out = torch.empty(end - start, weight.in_features, dtype=dtype)
        self._run_dequantize(weight, None, start, end - start, out)
        return out

    def embedding(self, weight: QuantizedWeight, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rows ``token_ids`` ([T] int64) name: [T, in_features] of ``dtype``."""
        token_ids = token_ids.contiguous()
        out = torch.empty(token_ids.shape[0], weight.in_features, dtype=dtype)
        self._run_dequantize(weight, token_ids.data_ptr(), 0, token_ids.shape[0], out)
        return out

    def _run_dequantize(
        self, weight: QuantizedWeight, row_ids: int | None, start: int, num_rows: int, out: torch.Tensor
    ) -> None:
        status = self._dequantize_rows(
            weight.data.data_ptr(),
            row_ids,
            start,
            num_rows,
            weight.out_features,
            weight.in_features,
            weight.format.code,
            out.data_ptr(),
            _DTYPES[out.dtype],
        )
        if status == -3:
            raise IndexError(f"a row id outside the {weight.out_features} rows of a {weight.format.name} weight")
        if status != 0:
            raise RuntimeError(f"quant_dequantize_rows refused a {weight.format.name} weight of {weight.shape} (bug)")
