"""The attention backend contract, and picking one for the device."""

from __future__ import annotations

import logging
from typing import Literal, Protocol

import torch

from engine.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Called once per layer per step. Writes this step's new K/V ([T, H_kv, D]) into
        their slots of ``layer_cache`` ([2, num_blocks, block_size, H_kv, D]), then returns
        each query token's ([T, H, D]) causal attention over its sequence's whole context."""
        ...


def select_backend(name: Literal["auto", "torch", "triton"], device: torch.device) -> AttentionBackend:
    """Triton kernels on CUDA, the torch reference elsewhere (or when asked for by name)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    raise ValueError(f"attention_backend must be auto, torch or triton; got {name!r}")
