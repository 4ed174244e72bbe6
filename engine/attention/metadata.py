"""What an attention backend needs to know about one step's flattened batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """The step's tokens laid end to end, one sequence after another, decodes first.

    A *decode* sequence contributes exactly one query token; every other
    sequence (a prefill, or a chunk of one) contributes ``query_lens[i]`` tokens
    whose K/V are written to the cache before attention, so every backend reads
    the whole context (cached prefix + new tokens) from the paged cache.

    Shapes (``S`` sequences, ``T`` tokens, ``B`` max blocks per sequence):
    """

    num_decodes: int  # the first num_decodes sequences (and tokens) are decodes
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of each new token
    query_start_loc: torch.Tensor  # [S + 1] int32: where each sequence's tokens start in the batch
    seq_lens: torch.Tensor  # [S] int32: context length of each sequence, new tokens included
    block_tables: torch.Tensor  # [S, B] int32: the blocks of each sequence, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host copies for backends that loop over sequences in Python.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # Torch backend: the decode mask, built by the first layer and reused by the rest.
    decode_bias: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]
