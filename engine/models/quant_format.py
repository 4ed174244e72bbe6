"""Weights kept in GGUF's block formats: the formats splitserve computes on, and one tensor's
blocks with the row and column operations loading needs (fusing, tensor-parallel shards,
undoing llama.cpp's rotary permutation).

A :class:`QuantizedWeight` is an ``[out_features, in_features]`` matrix stored as the file
stores it: each row ``in_features / 32`` blocks back to back (engine/csrc/quant_blocks.h
gives the byte layout), so a row, or a run of whole blocks within every row, is a byte slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

QuantType = Literal["Q4_0", "Q4_1", "Q8_0"]


@dataclass(frozen=True, slots=True)
class QuantFormat:
    name: QuantType
    ggml_type: int  # gguf.GGMLQuantizationType's value: the kernels' type code
    block_size: int  # elements per block
    block_bytes: int


# The formats with kernels (engine/csrc/quant_linear.c); a file's other types load dequantized.
QUANT_FORMATS: dict[QuantType, QuantFormat] = {
    "Q4_0": QuantFormat("Q4_0", 2, 32, 18),
    "Q4_1": QuantFormat("Q4_1", 3, 32, 20),
    "Q8_0": QuantFormat("Q8_0", 8, 32, 34),
}


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """``data``: uint8 [out_features, row_bytes], contiguous, on the CPU."""

    format: QuantFormat
    data: torch.Tensor
    in_features: int

    def __post_init__(self) -> None:
        blocks, remainder = divmod(self.in_features, self.format.block_size)
        if remainder or self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise RuntimeError(
                f"a {self.format.name} weight of {self.in_features} columns laid out as {self.data} (bug)"
            )
        if self.data.shape[1] != blocks * self.format.block_bytes or not self.data.is_contiguous():
            raise RuntimeError(f"{self.format.name} rows of {self.in_features} elements need {blocks} blocks (bug)")

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, start: int, count: int) -> QuantizedWeight:
        return QuantizedWeight(self.format, self.data[start : start + count].contiguous(), self.in_features)

    def columns(self, start: int, count: int) -> QuantizedWeight:
        """Input features ``start..start + count`` of every row, which must fall on whole blocks."""
        size = self.format.block_size
        if start % size or count % size:
            raise ValueError(
                f"a {self.format.name} weight splits its input features only on whole {size}-element blocks, and "
                f"this shard takes features {start}..{start + count}: use a tensor parallel size that divides the "
                "heads and the MLP into multiples of 32 features, or a float checkpoint"
            )
        first, num_bytes = start // size * self.format.block_bytes, count // size * self.format.block_bytes
        return QuantizedWeight(self.format, self.data[:, first : first + num_bytes].contiguous(), count)

    def permute_rows(self, order: torch.Tensor) -> QuantizedWeight:
        """Row ``i`` of the result is row ``order[i]`` of this weight."""
        return QuantizedWeight(self.format, self.data[order].contiguous(), self.in_features)

    def pad_rows(self, count: int) -> QuantizedWeight:
        """``count`` zero rows appended (all-zero blocks dequantize to zero in every format)."""
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
        size, num_blocks = self.format.block_size, self.in_features // self.format.block_size
        blocks = self.data.view(self.out_features, num_blocks, self.format.block_bytes)
        scale = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [out, blocks, 1]
        if self.format.name == "Q8_0":
            values = blocks[..., 2:].contiguous().view(torch.int8).float() * scale
        else:
            nibbles = blocks[..., 4:] if self.format.name == "Q4_1" else blocks[..., 2:]
            q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).float()  # [out, blocks, 32]
            if self.format.name == "Q4_1":
                values = q * scale + blocks[..., 2:4].contiguous().view(torch.float16).float()
            else:
                values = (q - 8.0) * scale
        return values.reshape(self.out_features, num_blocks * size).to(dtype)
