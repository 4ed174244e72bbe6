"""Linear layers for the CPU at hand: which path each dtype takes, chosen once at load time.

- ``onednn-packed`` (float32 on x86; bf16 where oneDNN has a bf16 matmul: AVX-512
  BW/VL/DQ or AVX-NE-CONVERT): weights reordered once into oneDNN's blocked layout.
  ``F.linear`` in bf16 reorders them on every call; packing removes that (bit-identical
  results). In float32 the packed oneDNN kernels beat the default MKL path from one row to
  thousands; they sum in another order than MKL, which transformers uses, and greedy parity
  against transformers (tests/engine/test_parity.py) holds. Decode steps (up to 64
  float32 rows with AVX-512, 16 with AVX2; up to 48 bf16 rows with AVX512_BF16, four
  without) go to the native panel kernel instead (engine/csrc/linear_panels.c), which
  streams its own copy of the weight, laid out in panels of output features, closer to the
  memory's read bandwidth than oneDNN does. So on this path the weights are held twice
  (panels and oneDNN's), three times for a head tied to the embedding (the embedding keeps
  the plain weight).
- ``bf16-weights`` (bf16 anywhere else, e.g. an AVX2-only CPU): packing a bf16
  weight there raises in torch, and ``F.linear`` in bf16 falls back to a generic
  GEMM, far slower than float32 once more than one row comes in. Weights stay
  bf16 (half the bytes to read per token), in the panel kernel's layout. Up to
  ``_MAX_KERNEL_ROWS`` rows (decode steps) go through the panel kernel, which converts
  the weights in registers as they stream by; more rows (prefill, large decode batches)
  upcast the weight to float32 a slice of panels at a time and run the float32 GEMM.
  Products of two bf16 values are exact in float32 and the result is rounded to bf16
  once, as oneDNN's bf16 kernels do: only the summation order differs. Without the
  native kernels the weight stays plain and one row takes torch's bf16 GEMV (which
  also converts in registers).
- ``torch`` (float16, float32 off x86, other devices): ``F.linear`` as is.

The figures behind these choices: docs/benchmarks.md, "Runtime CPU dispatch and the default
dtype" (the paths, the upcast slice) and "Decode steps on weight panels" (the row limits).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_kernels
from engine.cpu_features import CPUFeatures, cpu_features
from engine.kv_cache_utils import cdiv

logger = logging.getLogger(__name__)

LinearPath = Literal["onednn-packed", "bf16-weights", "torch"]

# Float32 elements of one upcast weight slice (4 MiB): large enough for the GEMM to run at
# speed, small enough to stay in cache between the conversion and the GEMM (the sizes tried:
# docs/benchmarks.md, "Runtime CPU dispatch and the default dtype").
_UPCAST_SLICE_ELEMENTS = 1 << 20
# Rows up to which the panel kernel beats the float32 GEMM on an upcast weight (the same section).
_MAX_KERNEL_ROWS = 64


def _max_panel_rows_beside_packed(dtype: torch.dtype, isa: str, features: CPUFeatures) -> int:
    """Rows up to which the panel kernel beats oneDNN's packed kernels in whole decode steps:
    the crossovers per dtype and ISA are in docs/benchmarks.md, "Decode steps on weight panels";
    with AMX, oneDNN's bf16 tiles win from a few rows on ("Panels read ahead, and both dtypes
    beside vLLM")."""
    if dtype == torch.bfloat16:
        return 48 if isa == "avx512_bf16" and not features.amx_bf16 else 4
    return {"avx512": 64, "avx512_bf16": 64, "avx2": 16}.get(isa, 3)


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, kernels: cpu_kernels.CPUKernels | None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # An opaque oneDNN tensor: not a parameter, and never saved.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = linear.bias
        # The panel kernel's own copy (None: every call is packed).
        self.kernels = kernels
        self.panels = None if kernels is None else kernels.pack_panels(linear.weight)
        self.max_kernel_rows = (
            0 if kernels is None else _max_panel_rows_beside_packed(linear.weight.dtype, kernels.isa, cpu_features())
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in_features] -> [T, out_features]
        if self.panels is not None and x.shape[0] <= self.max_kernel_rows and x.stride(1) == 1:
            return self.kernels.linear(x, self.panels, self.out_features, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


class BF16WeightLinear(nn.Module):
    """bf16 weights where oneDNN has no bf16 matmul (see the module docstring)."""

    def __init__(self, linear: nn.Linear, kernels: cpu_kernels.CPUKernels | None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.kernels = kernels
        # With the kernels, the weight is held once, in their panels; without, as it is.
        self.panels = None if kernels is None else kernels.pack_panels(linear.weight)
        self.weight = linear.weight if kernels is None else None
        # Rows the panel kernel takes (the rest upcast the weight for the float32 GEMM).
        self.max_kernel_rows = 0 if kernels is None else _MAX_KERNEL_ROWS
        # Panels per upcast slice (without kernels: plain weight rows, panels one row wide).
        panel_width = 1 if kernels is None else kernels.panel_width
        self.slice_panels = max(1, _UPCAST_SLICE_ELEMENTS // (self.in_features * panel_width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in_features] -> [T, out_features]
        num_rows = x.shape[0]
        if self.panels is None and num_rows == 1:
            return F.linear(x, self.weight, self.bias)
        if self.panels is not None and num_rows <= self.max_kernel_rows and x.stride(1) == 1:
            return self.kernels.linear(x, self.panels, self.out_features, self.bias)
        x32 = x.float()
        out = torch.empty((num_rows, self.out_features), dtype=x.dtype)
        for start, end, columns in self._float32_slices():
            product = x32 @ columns
            out[:, start:end] = product if self.bias is None else product + self.bias[start:end].float()
        return out

    def _float32_slices(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        """The weight upcast a slice at a time, as float32 columns of its transpose: (start, end,
        [in_features, end - start]) for output features start..end."""
        if self.panels is None:
            for start in range(0, self.out_features, self.slice_panels):
                end = min(start + self.slice_panels, self.out_features)
                yield start, end, self.weight[start:end].float().T
            return
        width = self.kernels.panel_width
        num_panels = cdiv(self.out_features, width)
        for first in range(0, num_panels, self.slice_panels):
            last = min(first + self.slice_panels, num_panels)
            start, end = first * width, min(last * width, self.out_features)
            yield start, end, self.kernels.unpack_panels(self.panels, self.in_features, first, last)[:, : end - start]


def linear_path(device: torch.device, dtype: torch.dtype, features: CPUFeatures | None = None) -> LinearPath:
    """The path linear layers of ``dtype`` take on ``device`` (``features``: this CPU's by default)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return "torch"
    features = features or cpu_features()
    if dtype == torch.float32:
        # oneDNN's float32 kernels are only measured on x86 (AVX-512, and capped at AVX2).
        return "onednn-packed" if features.arch == "x86_64" and torch.backends.mkldnn.is_available() else "torch"
    # torch's own check is the one that raises; ours can only narrow it (SPLITSERVE_CPU_ISA).
    if features.onednn_bf16 and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "onednn-packed"
    return "bf16-weights"


def prepare_linears(model: nn.Module, path: LinearPath) -> int:
    """Replace every ``nn.Linear`` in ``model`` by the module of ``path``; returns how many."""
    if path == "torch":
        return 0
    kernels = cpu_kernels.load()
    targets = plain_linears(model)
    for name, module in targets:
        replacement = PackedLinear(module, kernels) if path == "onednn-packed" else BF16WeightLinear(module, kernels)
        replace_module(model, name, replacement)
    return len(targets)


def plain_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """Every ``nn.Linear`` of ``model`` that has rows, by name (a pipeline stage's absent LM head
    has none: nothing to pack, and oneDNN refuses it)."""
    return [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear and m.out_features > 0]


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` in place of ``model``'s submodule ``name`` (dotted)."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)
