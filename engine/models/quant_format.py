"""Weights kept in quantized block formats: the formats splitserve computes on, and one tensor's
blocks with the row and column operations loading needs (fusing, tensor-parallel shards,
undoing llama.cpp's rotary permutation).

A :class:`QuantizedWeight` is an ``[out_features, in_features]`` matrix stored row by row, each
row a run of blocks back to back (engine/csrc/quant_blocks.h and quant_kblocks.h give the byte
layouts), so a row, or a run of whole blocks within every row, is a byte slice:

- GGUF's formats, as the file stores them: Q4_0, Q4_1 and Q8_0 in 32-element blocks; the
  K-quants Q4_K, Q5_K and Q6_K in 256-element super-blocks (sub-blocks of 32 or 16 elements,
  each with its own 6- or 8-bit scale).
- ``INT8``, splitserve's own (``--quantization int8``, engine/models/int8_quantize.py): each
  row is its float32 scale, then ``in_features`` int8 values, ``w = scale * q``: per output
  channel, symmetric. Its "blocks" are single elements, so its columns split anywhere.

The PyTorch dequantizations here are the reference and the path without native kernels; they
do the ``gguf`` package's arithmetic in its order, so they equal its dequantizers exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

QuantType = Literal["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "INT8"]


@dataclass(frozen=True, slots=True)
class QuantFormat:
    name: QuantType
    # The kernels' type code: gguf.GGMLQuantizationType's value for GGUF's formats.
    code: int
    block_size: int  # elements per block (per super-block for the K-quants)
    block_bytes: int
    # Bytes before a row's blocks: INT8's float32 scale.
    row_header_bytes: int = 0
    in_gguf: bool = True  # a type GGUF files hold (the loader maps them by code)

    def row_bytes(self, in_features: int) -> int:
        return self.row_header_bytes + in_features // self.block_size * self.block_bytes


# INT8's code lies outside ggml's type numbers (which a GGUF tensor's type is looked up among).
INT8_CODE = 200

# The formats with kernels (engine/csrc/quant_linear.c); a GGUF file's other types load dequantized.
QUANT_FORMATS: dict[QuantType, QuantFormat] = {
    "Q4_0": QuantFormat("Q4_0", 2, 32, 18),
    "Q4_1": QuantFormat("Q4_1", 3, 32, 20),
    "Q8_0": QuantFormat("Q8_0", 8, 32, 34),
    "Q4_K": QuantFormat("Q4_K", 12, 256, 144),
    "Q5_K": QuantFormat("Q5_K", 13, 256, 176),
    "Q6_K": QuantFormat("Q6_K", 14, 256, 210),
    "INT8": QuantFormat("INT8", INT8_CODE, 1, 1, row_header_bytes=4, in_gguf=False),
}


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """``data``: uint8 [out_features, row_bytes], contiguous, on the CPU."""

    format: QuantFormat
    data: torch.Tensor
    in_features: int

    def __post_init__(self) -> None:
        remainder = self.in_features % self.format.block_size
        if remainder or self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise RuntimeError(
                f"a {self.format.name} weight of {self.in_features} columns laid out as {self.data} (bug)"
            )
        if self.data.shape[1] != self.format.row_bytes(self.in_features) or not self.data.is_contiguous():
            raise RuntimeError(
                f"{self.format.name} rows of {self.in_features} elements take "
                f"{self.format.row_bytes(self.in_features)} bytes, not {self.data.shape[1]} (bug)"
            )

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def takes_q8_activations(self) -> bool:
        """Whether the integer kernels take it (engine/csrc/quant_q8.c): inputs go in 32-element
        Q8_0 blocks (Q8_K super-blocks for the K-quants), which an INT8 row must divide into."""
        return self.in_features % 32 == 0

    @property
    def row_scales(self) -> torch.Tensor:
        """An INT8 weight's scales, float32 [out_features] (a copy)."""
        if self.format.name != "INT8":
            raise RuntimeError(f"a {self.format.name} weight keeps its scales in its blocks (bug: INT8 only)")
        return self.data[:, :4].flatten().clone().view(torch.float32)

    def rows(self, start: int, count: int) -> QuantizedWeight:
        return QuantizedWeight(self.format, self.data[start : start + count].contiguous(), self.in_features)

    def columns(self, start: int, count: int) -> QuantizedWeight:
        """Input features ``start..start + count`` of every row, which must fall on whole blocks
        (an INT8 row keeps its scale: per output channel, it holds for any columns)."""
        size, header = self.format.block_size, self.format.row_header_bytes
        if start % size or count % size:
            raise ValueError(
                f"a {self.format.name} weight splits its input features only on whole {size}-element blocks, and "
                f"this shard takes features {start}..{start + count}: use a tensor parallel size that divides the "
                f"heads and the MLP into multiples of {size} features, or a float checkpoint"
            )
        first = header + start // size * self.format.block_bytes
        body = self.data[:, first : first + count // size * self.format.block_bytes]
        data = torch.cat([self.data[:, :header], body], dim=1) if header else body.contiguous()
        return QuantizedWeight(self.format, data, count)

    def permute_rows(self, order: torch.Tensor) -> QuantizedWeight:
        """Row ``i`` of the result is row ``order[i]`` of this weight."""
        return QuantizedWeight(self.format, self.data[order].contiguous(), self.in_features)

    def pad_rows(self, count: int) -> QuantizedWeight:
        """``count`` zero rows appended (all-zero rows dequantize to zero in every format)."""
        zeros = self.data.new_zeros(count, self.data.shape[1])
        return QuantizedWeight(self.format, torch.cat([self.data, zeros]), self.in_features)

    @staticmethod
    def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """The parts' rows, one after another (a fused projection); all of one format and width."""
        first = parts[0]
        if any(part.format != first.format or part.in_features != first.in_features for part in parts):
            raise RuntimeError("cat_rows of weights in different formats or widths (bug: the loader checks)")
        return QuantizedWeight(first.format, torch.cat([part.data for part in parts]), first.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as a float tensor [out_features, in_features], in plain PyTorch (the kernels'
        ``dequantize_rows`` does the same faster): where no kernels run, and for reference."""
        name, rows = self.format.name, self.out_features
        if name == "INT8":
            return (self.data[:, 4:].view(torch.int8).float() * self.row_scales.unsqueeze(1)).to(dtype)
        num_blocks = self.in_features // self.format.block_size
        blocks = self.data.view(rows * num_blocks, self.format.block_bytes)
        if name in ("Q4_K", "Q5_K"):
            values = _dequantize_q45_k(blocks, with_high_bits=name == "Q5_K")
        elif name == "Q6_K":
            values = _dequantize_q6_k(blocks)
        else:
            values = _dequantize_32(blocks, name)
        return values.reshape(rows, self.in_features).to(dtype)


def _half(raw: torch.Tensor) -> torch.Tensor:
    """[n, 2] bytes of fp16 -> [n, 1] float32."""
    return raw.contiguous().view(torch.float16).float()


def _dequantize_32(blocks: torch.Tensor, name: QuantType) -> torch.Tensor:
    """[n, block_bytes] Q4_0 / Q4_1 / Q8_0 blocks -> [n, 32]."""
    scale = _half(blocks[:, 0:2])
    if name == "Q8_0":
        return blocks[:, 2:].contiguous().view(torch.int8).float() * scale
    nibbles = blocks[:, 4:] if name == "Q4_1" else blocks[:, 2:]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).float()
    if name == "Q4_1":
        return q * scale + _half(blocks[:, 2:4])
    return (q - 8.0) * scale


def _k_scales_and_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> the 8 sub-blocks' 6-bit scales and mins, [n, 8] each."""
    packed = scales.reshape(-1, 3, 4)
    d, m, high = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = torch.cat([d & 0x3F, (high & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (high >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mins


def _dequantize_q45_k(blocks: torch.Tensor, with_high_bits: bool) -> torch.Tensor:
    """[n, 144] Q4_K or [n, 176] Q5_K super-blocks -> [n, 256]: w = d * sc * q - dmin * m."""
    n = blocks.shape[0]
    sc, mins = _k_scales_and_mins(blocks[:, 4:16])
    scale = (_half(blocks[:, 0:2]) * sc.float()).reshape(n, 8, 1)
    offset = (_half(blocks[:, 2:4]) * mins.float()).reshape(n, 8, 1)
    qs = blocks[:, 48:] if with_high_bits else blocks[:, 16:]
    # Sub-blocks 2j and 2j + 1 are the low and high nibbles of bytes 32j..32j + 31.
    q = torch.stack([qs.reshape(n, 4, 32) & 0x0F, qs.reshape(n, 4, 32) >> 4], dim=2).reshape(n, 8, 32)
    if with_high_bits:  # bit s of byte l is element l's fifth bit in sub-block s
        shifts = torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
        q = q | (((blocks[:, 16:48].reshape(n, 1, 32) >> shifts) & 1) << 4)
    return (scale * q.float() - offset).reshape(n, 256)


def _dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """[n, 210] Q6_K super-blocks -> [n, 256]: w = d * sc * (q - 32), a scale per 16 elements."""
    n = blocks.shape[0]
    ql, qh = blocks[:, :128].reshape(n, 2, 1, 64), blocks[:, 128:192].reshape(n, 2, 1, 32)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    scale = (_half(blocks[:, 208:210]) * scales).reshape(n, 16, 1)
    low = (ql >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)) & 0x0F  # [n, 2, 2, 64]
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)) & 0x03  # [n, 2, 4, 32]
    q = (low.reshape(n, 8, 32) | (high.reshape(n, 8, 32) << 4)).view(torch.int8) - 32
    return (scale * q.reshape(n, 16, 16).float()).reshape(n, 256)
