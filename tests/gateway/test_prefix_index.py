"""The gateway's prefix index: the same chain as the engine (salt included), events applied,
longest-prefix match, predictions that expire, a bound per instance."""

from __future__ import annotations

import logging

import pytest

from cluster.auth import ClusterSecret
from cluster.derived_keys import prefix_cache_key
from engine.block_pool import BlockPool
from engine.kv_cache_utils import BlockHasher, extend_block_hashes
from engine.kv_events import KVEventLog
from gateway.prefix_index import PrefixIndex, PromptBlocks
from gateway.reuse_ages import ReuseAges
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
    now = [100.0]
    index = PrefixIndex(prediction_ttl_s=0.05, clock=lambda: now[0])
    prompt = PromptBlocks(list(range(16)))
    index.apply("p:1", _events([], snapshot=True), max_blocks=100)
    index.predict("p:1", prompt, max_blocks=100)
    now[0] += 0.049
    assert index.num_hit_blocks("p:1", prompt) == 4
    now[0] += 0.002
    assert index.num_hit_blocks("p:1", prompt) == 0


def test_an_instance_holds_at_most_its_block_count() -> None:
    index = PrefixIndex()
    index.apply("p:1", _events(list(range(1, 50)), snapshot=True), max_blocks=8)
    assert index.num_cached_blocks("p:1") == 8
    index.predict("p:1", PromptBlocks(list(range(400))), max_blocks=8)
    assert len(index._instances["p:1"].predicted) == 8


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_hit_at_dispatch_is_a_reuse_age_and_makes_its_blocks_the_newest() -> None:
    clock = _Clock()
    index = PrefixIndex(clock=clock)
    old, new = PromptBlocks(list(range(8))), PromptBlocks(list(range(100, 108)))
    index.apply("p:1", _events(old.chain(4), snapshot=True), max_blocks=100)
    clock.now += 5
    index.apply("p:1", _events(new.chain(4), last_seq=2), max_blocks=100)
    clock.now += 30
    index.predict("p:1", old, max_blocks=100)  # hits both blocks of ``old``, unused for 35 s
    assert len(index.reuse_ages) == 1 and index.reuse_ages.horizon_s() == 1.5 * 35
    # Eviction order now: ``new``'s last block, its first, then ``old``'s last, its first.
    assert list(index._instances["p:1"].cached) == [*reversed(new.chain(4)), *reversed(old.chain(4))]


def test_an_eviction_costs_what_the_evicted_blocks_ages_say_of_their_reuse() -> None:
    clock = _Clock()
    index = PrefixIndex(clock=clock)
    for age in (1.0, 2.0, 3.0, 4.0):  # reuses seen so far: 1 to 4 s after the previous use
        index.reuse_ages.observe(age)
    stale, fresh = PromptBlocks(list(range(8))), PromptBlocks(list(range(100, 108)))
    incoming = PromptBlocks(list(range(200, 216)))  # 4 blocks
    index.apply("p:1", _events(stale.chain(4), snapshot=True), max_blocks=100)
    clock.now += 10
    index.apply("p:1", _events(fresh.chain(4), last_seq=2), max_blocks=100)
    clock.now += 3
    # The reuse horizon: 1.5 times the 95th percentile of the reuse ages, 6 s.
    # 6 blocks: 2 free; the other 2 new ones evict ``stale`` (13 s unused: past the horizon, worth 0).
    assert index.eviction_cost_blocks("p:1", incoming, 4, num_total_blocks=6) == 0.0
    # 4 blocks: nothing free; ``stale`` then ``fresh`` (3 s unused: half the horizon, worth 0.5 each).
    assert index.eviction_cost_blocks("p:1", incoming, 4, num_total_blocks=4) == 1.0
    # Room for everything, or a block count not reported yet: nothing is evicted.
    assert index.eviction_cost_blocks("p:1", incoming, 4, num_total_blocks=100) == 0.0
    assert index.eviction_cost_blocks("p:1", incoming, 4, num_total_blocks=0) == 0.0
    # Two blocks predicted there already push out ``stale``; the prompt's 4 then evict ``fresh``
    # and 2 more than the index knows of, which count in full.
    index.predict("p:1", PromptBlocks(list(range(300, 308))), max_blocks=100)
    assert index.eviction_cost_blocks("p:1", incoming, 4, num_total_blocks=4) == 3.0


def test_reuse_ages_keep_only_the_recent_ones() -> None:
    ages = ReuseAges(max_samples=3)
    assert ages.value(1e9) == 1.0  # nothing seen: every block counts in full
    for age in (100.0, 1.0, 2.0, 3.0):
        ages.observe(age)
    # 100 s is forgotten: the horizon is 1.5 times the largest of 1, 2 and 3 s (their 95th percentile).
    assert len(ages) == 3 and ages.horizon_s() == 4.5
    assert (ages.value(0.0), ages.value(2.25), ages.value(4.5), ages.value(60.0)) == (1.0, 0.5, 0.0, 0.0)


def test_an_index_out_of_step_with_its_instance_reads_a_snapshot_rather_than_go_blind() -> None:
    index = PrefixIndex()
    index.apply("p:1", _events([1, 2, 3, 4], snapshot=True), max_blocks=4)
    index.apply("p:1", _events([4], last_seq=2), max_blocks=4)  # stored again: nothing new
    assert index.cursor("p:1") == (7, 2)
    # A fifth hash with no removal: this view holds one the instance no longer does.
    index.apply("p:1", _events([5], last_seq=3), max_blocks=4)
    assert index.cursor("p:1") == (0, 0)  # the next poll asks from scratch: a snapshot
    index.apply("p:1", _events([2, 5], snapshot=True, last_seq=3), max_blocks=4)
    prompt = PromptBlocks(list(range(8)))
    assert index.cursor("p:1") == (7, 3) and index.num_cached_blocks("p:1") == 2
    assert index.num_hit_blocks("p:1", prompt) == 0
