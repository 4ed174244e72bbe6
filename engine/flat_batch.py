"""Lay a step's sequences end to end for the model: token ids, positions, attention metadata
and the rows whose logits are wanted. The model runner builds the target's batch with it, and
the draft model its own over the same block tables."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.metadata import AttentionMetadata
from engine.kv_cache_utils import cdiv


@dataclass(slots=True)
class FlatBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [R] rows of the batch whose next-token logits are needed


def build_flat_batch(
    input_ids: list[int],
    num_new: np.ndarray,
    num_computed: np.ndarray,
    block_id_rows: Sequence[list[int]],
    wants_logits: np.ndarray,
    num_decodes: int,
    block_size: int,
    to_device: Callable[[np.ndarray], torch.Tensor],
) -> FlatBatch:
    """One row per attention sequence: ``num_new[i]`` tokens (of ``input_ids``, laid end to end)
    after ``num_computed[i]`` cached ones, in blocks ``block_id_rows[i]``; the first
    ``num_decodes`` rows have one token each. ``wants_logits[i]``: the logits of row i's last
    token are needed (``logits_indices`` lists them in row order)."""
    num_seqs = len(num_new)
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(num_new, out=query_start_loc[1:])
    seq_lens = num_computed + num_new
    num_tokens = int(query_start_loc[-1])
    # positions: each sequence's tokens continue from its computed prefix
    positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(query_start_loc[:-1] - num_computed, num_new)

    max_seq_len = int(seq_lens.max())
    max_blocks = cdiv(max_seq_len, block_size)
    block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
    for row, block_ids in enumerate(block_id_rows):
        ids = block_ids[:max_blocks]
        block_tables[row, : len(ids)] = ids
    seq_index = np.repeat(np.arange(num_seqs), num_new)
    slot_mapping = block_tables[seq_index, positions // block_size].astype(np.int64) * block_size + (
        positions % block_size
    )
    logits_indices = query_start_loc[1:][wants_logits] - 1

    metadata = AttentionMetadata(
        num_decodes=num_decodes,
        slot_mapping=to_device(slot_mapping),
        query_start_loc=to_device(query_start_loc.astype(np.int32)),
        seq_lens=to_device(seq_lens.astype(np.int32)),
        block_tables=to_device(block_tables),
        max_query_len=int(num_new.max()),
        max_seq_len=max_seq_len,
        query_start_loc_cpu=query_start_loc.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
    )
    return FlatBatch(
        to_device(np.asarray(input_ids, dtype=np.int64)), to_device(positions), metadata, to_device(logits_indices)
    )
