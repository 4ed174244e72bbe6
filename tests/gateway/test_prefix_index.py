"""The gateway's prefix index: the same chain as the engine (salt included), events applied,
longest-prefix match, predictions that expire, a bound per instance."""

from __future__ import annotations

import logging
import time

import pytest

from cluster.auth import ClusterSecret
from cluster.derived_keys import prefix_cache_key
from engine.block_pool import BlockPool
from engine.kv_cache_utils import BlockHasher, extend_block_hashes
from engine.kv_events import KVEventLog
from gateway.prefix_index import PrefixIndex, PromptBlocks
from splitserve.v1 import disaggregation_pb2


def _raw(hashes: list[int]) -> list[bytes]:
    return [h.to_bytes(16, "little") for h in hashes]


def _events(
    stored: list[int],
    removed: list[int] = (),
    snapshot: bool = False,
    epoch: int = 7,
    last_seq: int = 1,
    block_hash: str = "",
):
    return disaggregation_pb2.KVEvents(
        epoch=epoch,
        last_seq=last_seq,
        snapshot=snapshot,
        stored=_raw(stored),
        removed=_raw(list(removed)),
        block_size=4,
        block_hash=block_hash,
    )


def test_the_chain_is_the_engines_with_the_salt() -> None:
    tokens = list(range(10))
    engine_chain: list = []
    extend_block_hashes(engine_chain, tokens, 4, b"salt")
    assert PromptBlocks(tokens, "salt").chain(4) == engine_chain and len(engine_chain) == 2
    assert PromptBlocks(tokens).chain(4) != engine_chain


def _engine_events(hasher: BlockHasher, tokens: list[int], salt: bytes) -> disaggregation_pb2.KVEvents:
    """What an instance whose prefix cache hashes with ``hasher`` reports after caching ``tokens``'
    full blocks (the engine's own chain, through its block pool's event log)."""
    log = KVEventLog(max_events=100)
    pool = BlockPool(num_blocks=8, enable_prefix_caching=True, events=log)
    chain: list = []
    extend_block_hashes(chain, tokens, 4, salt, hasher)
    for index, block_hash in enumerate(chain):
        (block,) = pool.get_new_blocks(1)
        pool.cache_block(block, block_hash, tokens[4 * index : 4 * index + 4])
    batch = log.read(0, 0)
    return _events(batch.stored, snapshot=True, epoch=batch.epoch, last_seq=batch.last_seq, block_hash=hasher.name)


def test_the_index_hashes_each_prompt_as_its_instance_does(caplog: pytest.LogCaptureFixture) -> None:
    """An instance on --prefix-cache-hash sha256 with a cluster secret hashes with HMAC-SHA256 under
    the key both derive from it; a gateway with the secret matches its blocks, one without sees none."""
    key = prefix_cache_key(ClusterSecret.from_text("a cluster secret of some length"))
    other_key = prefix_cache_key(ClusterSecret.from_text("another cluster secret, as long"))
    tokens = list(range(13))
    prompt = PromptBlocks(tokens, "salt")
    for hasher, index in (
        (BlockHasher(), PrefixIndex()),
        (BlockHasher("sha256"), PrefixIndex()),
        (BlockHasher("sha256", key), PrefixIndex(hash_key=key)),
    ):
        index.apply("p:1", _engine_events(hasher, tokens, b"salt"), max_blocks=100)
        assert index.num_hit_blocks("p:1", prompt) == 3, hasher.name
        assert index.num_hit_blocks("p:1", PromptBlocks(tokens)) == 0  # the salt still counts
    keyed_events = _engine_events(BlockHasher("sha256", key), tokens, b"salt")
    assert keyed_events.block_hash == "hmac-sha256"
    wrong_key = PrefixIndex(hash_key=other_key)
    wrong_key.apply("p:1", keyed_events, max_blocks=100)
    assert wrong_key.num_hit_blocks("p:1", prompt) == 0
    no_key = PrefixIndex()
    with caplog.at_level(logging.WARNING, logger="gateway.prefix_index"):
        no_key.apply("p:1", keyed_events, max_blocks=100)
        no_key.apply("p:1", keyed_events, max_blocks=100)
    assert no_key.num_hit_blocks("p:1", prompt) == 0
    no_key.predict("p:1", prompt, max_blocks=100)  # nothing it could predict either
    assert no_key.num_cached_blocks("p:1") == 3 and no_key.num_hit_blocks("p:1", prompt) == 0
    assert caplog.text.count("hashes its prefix cache with hmac-sha256, which this gateway cannot compute") == 1


def test_longest_prefix_match_follows_stores_and_evictions() -> None:
    index = PrefixIndex()
    prompt = PromptBlocks(list(range(17)))
    chain = prompt.chain(4)
    index.apply("p:1", _events(chain[:3], snapshot=True), max_blocks=100)
    assert index.num_hit_blocks("p:1", prompt) == 3 and index.num_hit_blocks("p:2", prompt) == 0
    index.apply("p:1", _events([], removed=[chain[1]], last_seq=2), max_blocks=100)
    assert index.num_hit_blocks("p:1", prompt) == 1  # a hole ends the prefix
    assert index.cursor("p:1") == (7, 2)
    index.apply("p:1", _events([chain[0]], snapshot=True, epoch=8, last_seq=1), max_blocks=100)  # restarted
    assert index.num_hit_blocks("p:1", prompt) == 1 and index.num_cached_blocks("p:1") == 1
    index.forget("p:1")
    assert index.cursor("p:1") == (0, 0) and index.num_hit_blocks("p:1", prompt) == 0


def test_predictions_count_until_they_expire() -> None:
    index = PrefixIndex(prediction_ttl_s=0.05)
    prompt = PromptBlocks(list(range(16)))
    index.apply("p:1", _events([], snapshot=True), max_blocks=100)
    index.predict("p:1", prompt, max_blocks=100)
    assert index.num_hit_blocks("p:1", prompt) == 4
    time.sleep(0.1)
    assert index.num_hit_blocks("p:1", prompt) == 0


def test_an_instance_holds_at_most_its_block_count() -> None:
    index = PrefixIndex()
    index.apply("p:1", _events(list(range(1, 50)), snapshot=True), max_blocks=8)
    assert index.num_cached_blocks("p:1") == 8
    index.predict("p:1", PromptBlocks(list(range(400))), max_blocks=8)
    assert len(index._instances["p:1"].predicted) == 8
