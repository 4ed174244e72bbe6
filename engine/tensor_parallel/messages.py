"""What rank 0 sends its workers over their pipes: raw little-endian int64 words, never
pickles. A message is a kind word, then the kind's words:

- ``INIT``: the KV blocks every rank allocates;
- ``STEP``: a step's flat batch (engine/flat_batch.py): a header of sizes and scalars, then
  input ids, positions, slot mapping, query start locations, sequence lengths, the block
  table (row-major) and the logits rows, end to end;
- ``STOP``: exit.

A worker answers ``READY`` once its shard and KV are in place, or ``FAILED`` with the error's
text in UTF-8 after the word.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.attention.metadata import AttentionMetadata
from engine.flat_batch import FlatBatch

INIT, STEP, STOP, READY, FAILED = 1, 2, 3, 4, 5
_HEADER = 8  # kind, T, S, B, R, num_decodes, max_query_len, max_seq_len


def encode_words(*words: int) -> bytes:
    return np.asarray(words, dtype="<i8").tobytes()


def kind_of(message: bytes) -> int:
    return int(np.frombuffer(message[:8], dtype="<i8")[0])


def words_of(message: bytes) -> np.ndarray:
    """The words after the kind."""
    return np.frombuffer(message, dtype="<i8")[1:]


def failure(error: BaseException) -> bytes:
    return encode_words(FAILED) + f"{type(error).__name__}: {error}".encode()


def failure_text(message: bytes) -> str:
    return message[8:].decode(errors="replace")


def encode_step(batch: FlatBatch) -> bytes:
    metadata = batch.metadata
    arrays = [
        batch.input_ids,
        batch.positions,
        metadata.slot_mapping,
        metadata.query_start_loc,
        metadata.seq_lens,
        metadata.block_tables.reshape(-1),
        batch.logits_indices,
    ]
    num_seqs, max_blocks = metadata.block_tables.shape
    header = np.asarray(
        [
            STEP,
            batch.input_ids.shape[0],
            num_seqs,
            max_blocks,
            batch.logits_indices.shape[0],
            metadata.num_decodes,
            metadata.max_query_len,
            metadata.max_seq_len,
        ],
        dtype="<i8",
    )
    return b"".join([header.tobytes(), *(t.cpu().numpy().astype("<i8", copy=False).tobytes() for t in arrays)])


def decode_step(message: bytes, device: torch.device) -> FlatBatch:
    words = np.frombuffer(message, dtype="<i8")
    _, num_tokens, num_seqs, max_blocks, num_logits, num_decodes, max_query_len, max_seq_len = (
        int(w) for w in words[:_HEADER]
    )
    lengths = [num_tokens, num_tokens, num_tokens, num_seqs + 1, num_seqs, num_seqs * max_blocks, num_logits]
    offsets = np.cumsum([_HEADER, *lengths])
    parts = [words[start:end] for start, end in zip(offsets[:-1], offsets[1:])]
    input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables, logits_indices = parts

    def tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(array.copy()).to(device=device, dtype=dtype)

    metadata = AttentionMetadata(
        num_decodes=num_decodes,
        slot_mapping=tensor(slot_mapping, torch.int64),
        query_start_loc=tensor(query_start_loc, torch.int32),
        seq_lens=tensor(seq_lens, torch.int32),
        block_tables=tensor(block_tables.reshape(num_seqs, max_blocks), torch.int32),
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        query_start_loc_cpu=query_start_loc.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
    )
    return FlatBatch(
        tensor(input_ids, torch.int64), tensor(positions, torch.int64), metadata, tensor(logits_indices, torch.int64)
    )
