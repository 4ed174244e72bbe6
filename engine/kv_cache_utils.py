"""Block hashing for prefix caching, and the arithmetic of KV cache sizing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NewType

import numpy as np
import xxhash

# A full block's identity: chained from its parent block's hash, its own token
# ids and any extra keys, so equal hashes mean equal whole prefixes.
BlockHash = NewType("BlockHash", int)


def cdiv(numerator: int, denominator: int) -> int:
    """Ceiling division of non-negative integers: ``cdiv(num_tokens, block_size)`` is how
    many blocks hold ``num_tokens`` tokens."""
    return -(-numerator // denominator)


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: bytes = b"") -> BlockHash:
    """Hash one full block. ``extra_keys`` (a cache salt, say) matter only for the
    first block: every later hash inherits them through the chain."""
    hasher = xxhash.xxh3_128()
    hasher.update(b"root" if parent_hash is None else parent_hash.to_bytes(16, "little"))
    hasher.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    hasher.update(extra_keys)
    return BlockHash(hasher.intdigest())


def extend_block_hashes(
    block_hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, extra_keys: bytes = b""
) -> None:
    """Append the hashes of every block of ``token_ids`` that is full but not hashed yet."""
    num_full_blocks = len(token_ids) // block_size
    for block_index in range(len(block_hashes), num_full_blocks):
        start = block_index * block_size
        parent = block_hashes[-1] if block_hashes else None
        block_hashes.append(
            hash_block_tokens(parent, token_ids[start : start + block_size], extra_keys if parent is None else b"")
        )


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype_bytes: int
) -> int:
    """Bytes one block occupies across all layers: per layer
    ``2 (K and V) * block_size * num_kv_heads * head_dim * dtype_bytes``."""
    return num_layers * 2 * block_size * num_kv_heads * head_dim * dtype_bytes


def num_blocks_for_budget(memory_bytes: int, bytes_per_block: int) -> int:
    """How many blocks fit in ``memory_bytes``; at least one, or the budget is a user error."""
    num_blocks = memory_bytes // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"KV cache budget of {memory_bytes} bytes holds no block of {bytes_per_block} bytes; "
            "raise kv_cache_memory (or gpu_memory_utilization)"
        )
    return num_blocks
