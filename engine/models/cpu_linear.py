"""Linear layers for the CPU at hand: which path each dtype takes, chosen once at load time.

- ``onednn-packed`` (float32 on x86; bf16 where oneDNN has a bf16 matmul: AVX-512
  BW/VL/DQ or AVX-NE-CONVERT): weights reordered once into oneDNN's blocked layout.
  ``F.linear`` in bf16 reorders them on every call; packing removes that (~30% faster
  per matmul, bit-identical results). In float32 the packed oneDNN kernels beat the
  default MKL path by 10-25% from one row to thousands (docs/benchmarks.md, "Online speed");
  they sum in another order than MKL, which transformers uses, and greedy parity
  against transformers (tests/engine/test_parity.py) holds. Decode steps of a few
  rows (one to three in float32, one or two in bf16) go to the native few-row kernel instead
  (engine/csrc/linear.c), which streams the weights at close to the memory's read
  bandwidth where oneDNN reaches about half of it: ~30% less time per decode token.
  That kernel reads the plain weight, so on this path the weights are held twice
  (plain and packed).
- ``bf16-weights`` (bf16 anywhere else, e.g. an AVX2-only CPU): packing a bf16
  weight there raises in torch, and ``F.linear`` in bf16 falls back to a generic
  GEMM that is ~4x slower than float32 once more than one row comes in. Weights stay
  bf16 (half the bytes to read per token). Up to ``_MAX_KERNEL_ROWS`` rows (decode
  steps) go through the native few-row kernel, which converts each weight row in
  registers as it streams by; more rows (prefill, large decode batches) upcast the
  weight to float32 a slice at a time and run the float32 GEMM. Products of two bf16
  values are exact in float32 and the result is rounded to bf16 once, as oneDNN's
  bf16 kernels do: only the summation order differs. Without the native kernels, one
  row takes torch's bf16 GEMV (which also converts in registers).
- ``torch`` (float16, float32 off x86, other devices): ``F.linear`` as is.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_kernels
from engine.cpu_features import CPUFeatures, cpu_features

logger = logging.getLogger(__name__)

LinearPath = Literal["onednn-packed", "bf16-weights", "torch"]

# Float32 elements of one upcast weight slice (4 MiB): large enough for the GEMM to run at
# speed, small enough to stay in cache between the conversion and the GEMM. Measured on an
# AVX2-capped Zen 4 at 16 to 512 rows: 2^20 is within 10% of float32 weights, 2^16 and 2^22
# up to 60% slower.
_UPCAST_SLICE_ELEMENTS = 1 << 20
# Rows up to which the native kernel beats the float32 GEMM on an upcast weight (an AVX2-capped
# Zen 4: 3-4x at 1 row, 1.4x at 8; level by 16, since it reads its input rows again for every
# weight row).
_MAX_KERNEL_ROWS = 8
# Rows up to which it beats oneDNN's packed kernels, by dtype. Zen 4 with AVX-512, whole decode
# steps of SmolLM2-135M on 2 threads: float32 1.3-1.5x at 1 and 2 rows, 1.16x at 3 (32.4 against
# 37.6 ms a step), 0.87x at 4; bf16 1.3-1.5x at 1 and 2 rows, 0.86x at 3 (oneDNN's bf16 dot
# products outrun the kernel's conversions once three rows share each weight read).
_MAX_KERNEL_ROWS_BESIDE_PACKED = {torch.float32: 3, torch.bfloat16: 2}


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, kernels: cpu_kernels.CPUKernels | None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # An opaque oneDNN tensor: not a parameter, and never saved.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = linear.bias
        # The plain weight, for the few-row kernel (None: every call is packed).
        self.kernels = kernels
        self.weight = None if kernels is None else linear.weight
        self.max_kernel_rows = _MAX_KERNEL_ROWS_BESIDE_PACKED.get(linear.weight.dtype, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in_features] -> [T, out_features]
        if self.kernels is not None and x.shape[0] <= self.max_kernel_rows and x.stride(1) == 1:
            return self.kernels.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


class BF16WeightLinear(nn.Module):
    """bf16 weights where oneDNN has no bf16 matmul (see the module docstring)."""

    def __init__(self, linear: nn.Linear, kernels: cpu_kernels.CPUKernels | None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.kernels = kernels
        self.slice_rows = max(1, _UPCAST_SLICE_ELEMENTS // self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in_features] -> [T, out_features]
        num_rows = x.shape[0]
        if self.kernels is not None and num_rows <= _MAX_KERNEL_ROWS and x.stride(1) == 1:
            return self.kernels.linear(x, self.weight, self.bias)
        if num_rows == 1:
            return F.linear(x, self.weight, self.bias)
        x32 = x.float()
        out = torch.empty((num_rows, self.out_features), dtype=x.dtype)
        for start in range(0, self.out_features, self.slice_rows):
            end = min(start + self.slice_rows, self.out_features)
            bias = None if self.bias is None else self.bias[start:end].float()
            out[:, start:end] = F.linear(x32, self.weight[start:end].float(), bias)
        return out


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


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return linear_path(device, dtype) == "onednn-packed"


def prepare_linears(model: nn.Module, path: LinearPath) -> int:
    """Replace every ``nn.Linear`` in ``model`` by the module of ``path``; returns how many."""
    if path == "torch":
        return 0
    kernels = cpu_kernels.load()
    targets = [(name, module) for name, module in model.named_modules() if type(module) is nn.Linear]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        replacement = PackedLinear(module, kernels) if path == "onednn-packed" else BF16WeightLinear(module, kernels)
        setattr(parent, child, replacement)
    return len(targets)
