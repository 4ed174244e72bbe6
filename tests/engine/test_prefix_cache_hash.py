"""The prefix cache's block hash (``--prefix-cache-hash``): xxh3 as before, or SHA-256 over an
unambiguous encoding, HMAC-SHA256 under a key, truncated to 128 bits; the engine caches and
hits under whichever it is configured with."""

from __future__ import annotations

import hashlib
import hmac
import struct

import pytest

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.kv_cache_utils import XXH3, BlockHasher, extend_block_hashes
from engine.request import Request
from engine.sampling_params import SamplingParams

KEY = bytes(range(32))
TOKENS = [5, 6, 7, 8]


def _sha256_message(parent: int | None, tokens: list[int], salt: bytes = b"") -> bytes:
    head = bytes(17) if parent is None else b"\x01" + parent.to_bytes(16, "little")
    return head + len(salt).to_bytes(4, "little") + salt + struct.pack(f"<{len(tokens)}q", *tokens)


def test_sha256_hashes_are_sha256_or_hmac_sha256_of_the_block_cut_to_128_bits() -> None:
    plain, keyed = BlockHasher("sha256"), BlockHasher("sha256", KEY)
    root = plain(None, TOKENS, b"salt")
    assert root == int.from_bytes(hashlib.sha256(_sha256_message(None, TOKENS, b"salt")).digest()[:16], "little")
    assert plain(root, TOKENS) == int.from_bytes(hashlib.sha256(_sha256_message(root, TOKENS)).digest()[:16], "little")
    keyed_root = keyed(None, TOKENS)
    assert keyed_root == int.from_bytes(hmac.digest(KEY, _sha256_message(None, TOKENS), "sha256")[:16], "little")
    long_key = bytes(100)  # longer than SHA-256's block: HMAC hashes it first
    assert BlockHasher("sha256", long_key)(keyed_root, TOKENS) == int.from_bytes(
        hmac.digest(long_key, _sha256_message(keyed_root, TOKENS), "sha256")[:16], "little"
    )


def test_every_hash_and_key_gives_its_own_chain() -> None:
    hashers = [XXH3, BlockHasher("sha256"), BlockHasher("sha256", KEY), BlockHasher("sha256", KEY[::-1])]
    chains = []
    for hasher in hashers:
        chain: list = []
        extend_block_hashes(chain, list(range(12)), 4, b"salt", hasher)
        again: list = []
        extend_block_hashes(again, list(range(12)), 4, b"salt", hasher)
        unsalted: list = []
        extend_block_hashes(unsalted, list(range(12)), 4, b"", hasher)
        assert chain == again and len(chain) == 3 and not set(chain) & set(unsalted)
        chains.append(tuple(chain))
    assert len(set(chains)) == len(hashers)
    assert [hasher.name for hasher in hashers] == ["xxh3", "sha256", "hmac-sha256", "hmac-sha256"]
    assert "key" not in repr(hashers[2]) and KEY.hex() not in repr(hashers[2])


def _request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=1), max_tokens=1, eos_token_ids=frozenset())


def test_an_engine_hashing_with_hmac_sha256_hits_its_own_prefix_cache() -> None:
    hasher = BlockHasher("sha256", KEY)
    manager = KVCacheManager(8, 4, enable_prefix_caching=True, block_hasher=hasher)
    tokens = list(range(100, 113))  # 3 full blocks and one token
    first = _request("a", tokens)
    manager.allocate_slots(first, len(tokens))
    manager.free(first)
    expected: list = []
    extend_block_hashes(expected, tokens, 4, b"", hasher)
    assert set(manager.block_pool.cached_blocks) == set(expected)
    hits, num_hit_tokens = manager.get_computed_blocks(_request("b", tokens))
    assert num_hit_tokens == 12 and [block.block_hash for block in hits] == expected
    # The same prompt hashed with another key finds nothing.
    other = KVCacheManager(8, 4, enable_prefix_caching=True, block_hasher=BlockHasher("sha256", KEY[::-1]))
    other.allocate_slots(_request("c", tokens), len(tokens))
    assert not set(other.block_pool.cached_blocks) & set(expected)


def test_the_engine_config_names_its_hash_and_refuses_others() -> None:
    assert EngineConfig().block_hasher == XXH3
    assert EngineConfig(prefix_cache_hash="sha256").block_hasher == BlockHasher("sha256")
    assert EngineConfig(prefix_cache_hash="sha256", prefix_cache_hash_key=KEY).block_hasher.name == "hmac-sha256"
    assert EngineConfig(prefix_cache_hash="xxh3", prefix_cache_hash_key=KEY).block_hasher == XXH3  # xxh3 takes none
    assert KEY.hex() not in repr(EngineConfig(prefix_cache_hash="sha256", prefix_cache_hash_key=KEY))
    with pytest.raises(ValueError, match="prefix_cache_hash must be one of xxh3, sha256; got 'md5'"):
        EngineConfig(prefix_cache_hash="md5")  # type: ignore[arg-type]
