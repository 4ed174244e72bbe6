"""The model's elementwise operations, in two implementations chosen at load time.

:class:`TorchOps` is the reference, plain PyTorch written to round exactly where
transformers does. :class:`NativeCPUOps` runs the fused C kernels of
:mod:`engine.cpu_kernels` (one pass each instead of 4 to 7 PyTorch ops and their
temporaries). In bfloat16 they round where transformers does, except
``silu_and_mul``, which rounds once as vLLM's fused kernel does (at most one ulp
apart); in float32 only summation order differs. Every other device uses the
reference.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from engine import cpu_kernels


class ModelOps(Protocol):
    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual = residual + x`` (or ``x`` when None), then ``weight * rms_norm(residual)``.
        x: [T, hidden]. Returns (normalised, residual); the residual may be updated in place."""
        ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [T, 2 * I], gate then up. Returns ``silu(gate) * up``: [T, I]."""
        ...

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Neox-style rotation of q: [T, H, D] and k: [T, H_kv, D] (rows may be strided) into new
        contiguous tensors. cos, sin: [max_positions, D / 2]; positions: [T]."""
        ...


class TorchOps:
    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x if residual is None else residual + x
        # Normalise in float32 and round before the weight, as transformers does.
        normed = torch.rms_norm(residual.float(), (residual.shape[-1],), eps=eps).to(residual.dtype)
        return weight * normed, residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [T, 1, D/2], looked up once
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


class NativeCPUOps:
    def __init__(self, kernels: cpu_kernels.CPUKernels) -> None:
        self.kernels = kernels

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.contiguous()
        normed = self.kernels.add_rms_norm(x, residual, weight, eps)
        return normed, x if residual is None else residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_and_mul(gate_up.contiguous())

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.rotary_embedding(q, k, cos, sin, positions)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin for x: [T, heads, D], cos/sin: [T, 1, D/2], one half at a
    time into a new tensor, without the concatenation."""
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out1, out2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=out1).sub_(x2 * sin)
    torch.mul(x2, cos, out=out2).add_(x1 * sin)
    return out


def select_ops(device: torch.device, dtype: torch.dtype) -> ModelOps:
    """Native kernels on CPU when they built and support the dtype; the reference otherwise."""
    if device.type == "cpu":
        kernels = cpu_kernels.load()
        if kernels is not None and kernels.supports(dtype):
            return NativeCPUOps(kernels)
    return TorchOps()
