"""Rotary position embeddings, with the frequencies computed by transformers itself
so every RoPE variant it knows (default, linear, llama3, yarn, ...) matches it exactly."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.models.ops import ModelOps

# Variants whose frequencies depend on the current sequence length; a paged
# cache stores K already rotated, so they cannot be served exactly.
_LENGTH_DEPENDENT = {"dynamic"}


def _inv_freq(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    rope_parameters = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type in _LENGTH_DEPENDENT:
        raise ValueError(f"rope type {rope_type!r} is not supported (its frequencies change with sequence length)")
    if rope_type == "default":
        base = rope_parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope type {rope_type!r} is unknown to transformers {ROPE_INIT_FUNCTIONS.keys()}")
    # On the device being built on (meta, for a GGUF file: engine/models/gguf_loader.py).
    return ROPE_INIT_FUNCTIONS[rope_type](config, torch.get_default_device())


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin for every position up to ``max_positions``, applied neox-style (rotate half)."""

    def __init__(
        self, config: PretrainedConfig, head_dim: int, max_positions: int, dtype: torch.dtype, ops: ModelOps
    ) -> None:
        super().__init__()
        inv_freq, scaling = _inv_freq(config, head_dim)
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        # Half width: transformers repeats the same values in both halves. Rounded to
        # the model dtype, as transformers does before applying them.
        self.register_buffer("cos", (freqs.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (freqs.sin() * scaling).to(dtype), persistent=False)
        self.ops = ops

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, H_kv, D] (rows may be strided); positions: [T].
        Returns both rotated, contiguous."""
        return self.ops.rotary(q, k, self.cos, self.sin, positions)
