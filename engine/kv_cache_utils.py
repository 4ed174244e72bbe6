"""Block hashing for prefix caching, and the arithmetic of KV cache sizing.

Two block hashes (``--prefix-cache-hash``), both 128 bits, chained the same way:

- ``xxh3`` (the default): xxh3-128, the fastest. Not collision resistant: whoever chooses
  prompts can craft two prefixes with one hash (vLLM's CVE-2025-25183), and a later request
  would then reuse KV computed for the other prefix (a hit checks only the block's own tokens).
- ``sha256``: SHA-256 over an unambiguous encoding of (parent hash, extra keys, token ids),
  truncated to 128 bits; HMAC-SHA256 when given a key (the instances and the gateway derive
  one from the cluster secret, ``cluster/derived_keys.py``), so hashes cannot even be
  computed without the secret. Its cost on a decode step and on prefix-cache lookups is in
  docs/benchmarks.md ("Prefix-cache hash").

The gateway hashes prompts with the same chain (``gateway/prefix_index.py``), told which one an
instance uses by its KV events (:attr:`BlockHasher.name`).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, NewType

import xxhash

# A full block's identity: chained from its parent block's hash, its own token
# ids and any extra keys, so equal hashes mean equal whole prefixes.
BlockHash = NewType("BlockHash", int)

PrefixCacheHash = Literal["xxh3", "sha256"]
PREFIX_CACHE_HASHES: tuple[PrefixCacheHash, ...] = ("xxh3", "sha256")
_ROOT = b"root"
_SHA256_ROOT = bytes(17)  # tag 0 + 16 zero bytes: no chained parent (tag 1 + its 16 bytes)
_SHA256_BLOCK_BYTES = 64


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """How full blocks are hashed: ``algorithm`` and, for sha256, an optional HMAC ``key``
    (never shown). Hashable: the gateway keeps a prompt's chains per hasher."""

    algorithm: PrefixCacheHash = "xxh3"
    key: bytes | None = field(default=None, repr=False)
    # HMAC-SHA256's inner and outer hashes with the key absorbed (RFC 2104), copied per block:
    # a third of hmac.digest's time per call.
    _hmac_pads: tuple[hashlib._Hash, hashlib._Hash] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.algorithm not in PREFIX_CACHE_HASHES:
            raise ValueError(
                f"prefix_cache_hash must be one of {', '.join(PREFIX_CACHE_HASHES)}; got {self.algorithm!r}"
            )
        if self.key is None:
            return
        if self.algorithm != "sha256":
            raise RuntimeError("only the sha256 prefix-cache hash takes a key (bug)")
        key = hashlib.sha256(self.key).digest() if len(self.key) > _SHA256_BLOCK_BYTES else self.key
        key = key.ljust(_SHA256_BLOCK_BYTES, b"\0")
        pads = (hashlib.sha256(bytes(b ^ 0x36 for b in key)), hashlib.sha256(bytes(b ^ 0x5C for b in key)))
        object.__setattr__(self, "_hmac_pads", pads)

    @property
    def name(self) -> str:
        """What the KV events call this hash: ``xxh3``, ``sha256`` or ``hmac-sha256``."""
        return "hmac-sha256" if self.key is not None else self.algorithm

    def __call__(self, parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: bytes = b"") -> BlockHash:
        # Little-endian int64s; struct packs a short list of ints faster than numpy converts it.
        tokens = struct.pack(f"<{len(token_ids)}q", *token_ids)
        if self.algorithm == "xxh3":
            hasher = xxhash.xxh3_128()
            hasher.update(_ROOT if parent_hash is None else parent_hash.to_bytes(16, "little"))
            hasher.update(tokens)
            hasher.update(extra_keys)
            return BlockHash(hasher.intdigest())
        # Fixed-width parent and a length-prefixed salt: no two inputs share an encoding.
        parent = _SHA256_ROOT if parent_hash is None else b"\x01" + parent_hash.to_bytes(16, "little")
        message = b"".join((parent, len(extra_keys).to_bytes(4, "little"), extra_keys, tokens))
        if self._hmac_pads is None:
            digest = hashlib.sha256(message).digest()
        else:
            inner, outer = self._hmac_pads[0].copy(), self._hmac_pads[1].copy()
            inner.update(message)
            outer.update(inner.digest())
            digest = outer.digest()
        return BlockHash(int.from_bytes(digest[:16], "little"))


XXH3 = BlockHasher()


def cdiv(numerator: int, denominator: int) -> int:
    """Ceiling division of non-negative integers: ``cdiv(num_tokens, block_size)`` is how
    many blocks hold ``num_tokens`` tokens."""
    return -(-numerator // denominator)


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: bytes = b"", hasher: BlockHasher = XXH3
) -> BlockHash:
    """Hash one full block. ``extra_keys`` (a cache salt, say) matter only for the
    first block: every later hash inherits them through the chain."""
    return hasher(parent_hash, token_ids, extra_keys)


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: bytes = b"",
    hasher: BlockHasher = XXH3,
) -> None:
    """Append the hashes of every block of ``token_ids`` that is full but not hashed yet."""
    num_full_blocks = len(token_ids) // block_size
    for block_index in range(len(block_hashes), num_full_blocks):
        start = block_index * block_size
        parent = block_hashes[-1] if block_hashes else None
        salt = extra_keys if parent is None else b""
        block_hashes.append(hasher(parent, token_ids[start : start + block_size], salt))


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
