"""The KV cache's storage format (``--kv-cache-dtype``, vLLM's flag): the model's own dtype, or
8-bit values with one float32 scale per token and KV head.

``auto`` stores K and V in the model's compute dtype, as computed. ``int8`` and ``fp8_e4m3``
quantize each row (one token's K, or V, of one KV head: ``head_dim`` values) symmetrically by
its largest magnitude: ``scale = max|x| / QMAX`` (127 for int8, 448 for fp8 e4m3, its largest
finite value), each value stored as ``x / scale`` rounded to the format (to nearest, ties to
even), and ``scale`` stored right after the row as 4 little-endian float32 bytes. A row is then
``head_dim + 4`` bytes instead of ``2 * head_dim`` (bf16) or ``4 * head_dim`` (float32): 68
against 128 and 256 for SmolLM2's 64-wide heads, so a block, and what a KV connector moves
for it, is 0.53x its bf16 size and 0.27x its float32 size.

Why a scale per token and head, in float32, inside the row: the row is what attention reads
and what a connector moves per head (a tensor-parallel pull takes a span of heads, the lmcache
connector stores each head apart), so a scale living in its row travels with it and a block
stays one contiguous span of bytes (engine/kv_cache_layout.py) with no second tensor to keep
in step. A per-token scale is set when the token is written and never changes (a per-block
scale would have to rescale the block's earlier tokens as later ones arrive). float32 rather
than float16 costs 2 bytes a row (3% of 66) and keeps the scale exact, in range for any
activation, aligned to 4 bytes, and free to read on CPUs without F16C.

Storage: the whole cache is one ``uint8`` tensor (what connectors and stores move as bytes;
LMCache's remote stores know uint8, not int8), and the model sees each layer through a view
whose dtype names the values' format (``torch.int8`` or ``torch.float8_e4m3fn``, one byte a
value, the last 4 bytes of each row being the scale): the attention backends and kernels read
the format off the layer cache they are handed (:func:`layer_format`).

Attention always reads K and V as the cache holds them: decode kernels widen each row in
registers as they read it (engine/csrc/paged_decode.c, which shares a block's rows between the
query heads of a GQA group through a one-block tile, and the Triton kernels), and a prefill
that attends to its own new tokens (no cached prefix) rounds them through the format first
(:func:`round_trip`), so a prompt's logits do not depend on how it was chunked, preempted or
migrated, or where its KV came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

KVCacheDType = Literal["auto", "int8", "fp8_e4m3"]
KV_CACHE_DTYPES: tuple[KVCacheDType, ...] = ("auto", "int8", "fp8_e4m3")

SCALE_BYTES = 4  # one float32 scale after each row
# What the fingerprint says of the scales (kv_connector/fingerprint.py): a peer with another
# scale layout must not pair, even with the same value format.
SCALE_LAYOUT = "f32-token-head"

# The value dtype of each quantized format, as layer views carry it, and its largest magnitude.
VALUE_DTYPES: dict[KVCacheDType, torch.dtype] = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
_QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


@dataclass(frozen=True, slots=True)
class KVCacheFormat:
    """How one engine stores its KV rows; made once by the model runner."""

    kv_cache_dtype: KVCacheDType
    model_dtype: torch.dtype  # the compute dtype: what ``auto`` stores, and what attention computes in
    head_dim: int

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def row_elements(self) -> int:
        """The cache tensor's last axis: ``head_dim`` values, or ``head_dim + 4`` bytes."""
        return self.head_dim + SCALE_BYTES if self.quantized else self.head_dim

    @property
    def cache_dtype(self) -> torch.dtype:
        """The whole cache tensor's dtype (what connectors move)."""
        return torch.uint8 if self.quantized else self.model_dtype

    @property
    def layer_dtype(self) -> torch.dtype:
        """The dtype of the layer views attention is handed: names the values' format."""
        return VALUE_DTYPES[self.kv_cache_dtype] if self.quantized else self.model_dtype

    @property
    def bytes_per_row(self) -> int:
        return self.row_elements * self.cache_dtype.itemsize

    @property
    def fingerprint_dtype(self) -> str:
        """The fingerprint's ``dtype``: ``float32``, ``bfloat16``, ...; ``int8/f32-token-head``."""
        if self.quantized:
            return f"{self.kv_cache_dtype}/{SCALE_LAYOUT}"
        return str(self.model_dtype).removeprefix("torch.")


def layer_format(layer_cache: torch.Tensor) -> torch.dtype | None:
    """The value dtype of a quantized layer cache (``torch.int8`` or ``torch.float8_e4m3fn``);
    None for one that holds the model's dtype."""
    return layer_cache.dtype if layer_cache.dtype in _QMAX else None


def quantize(x: torch.Tensor, value_dtype: torch.dtype) -> torch.Tensor:
    """Rows ``x`` [..., head_dim] (any float dtype) in the stored form: uint8 [..., head_dim + 4].

    The reference for every writer (engine/csrc/kv_store.c, the Triton store kernel), which
    compute the same float32 operations in the same order and so write the same bytes.
    """
    qmax = _QMAX[value_dtype]
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / qmax  # [..., 1]
    # An all-zero row keeps scale 0 and stores zeros; the reciprocal of 1 keeps it finite.
    inverse = 1.0 / torch.where(scale > 0, scale, torch.ones_like(scale))
    scaled = (x * inverse).clamp_(-qmax, qmax)
    values = torch.round(scaled).to(torch.int8) if value_dtype == torch.int8 else scaled.to(value_dtype)
    return torch.cat([values.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def dequantize(rows: torch.Tensor, value_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows [..., head_dim + 4] (uint8, or a layer view's 1-byte dtype) as values
    [..., head_dim] of ``dtype``: each value times its row's scale, in float32."""
    raw = rows.view(torch.uint8)
    head_dim = raw.shape[-1] - SCALE_BYTES
    values = raw[..., :head_dim].view(value_dtype).float()
    scale = raw[..., head_dim:].contiguous().view(torch.float32)  # [..., 1]
    return (values * scale).to(dtype)


def round_trip(x: torch.Tensor, value_dtype: torch.dtype) -> torch.Tensor:
    """``x`` [..., head_dim] as attention reads it back from the cache, in ``x``'s dtype."""
    return dequantize(quantize(x, value_dtype), value_dtype, x.dtype)
