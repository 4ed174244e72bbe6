"""The prefix-cache event log a gateway follows: incremental batches after a cursor, a
snapshot after a restart or a gap, exact hashes from the block pool's stores and evictions."""

from __future__ import annotations

import pytest

from engine.block_pool import BlockPool
from engine.kv_cache_utils import BlockHash, hash_block_tokens
from engine.kv_events import KVEventLog


def _cache(pool: BlockPool, tokens: list[int], parent: BlockHash | None = None) -> BlockHash:
    (block,) = pool.get_new_blocks(1)
    block_hash = hash_block_tokens(parent, tokens)
    pool.cache_block(block, block_hash, tokens)
    pool.free_blocks([block])
    return block_hash


def test_a_reader_gets_a_snapshot_first_then_only_what_changed() -> None:
    log = KVEventLog(max_events=100)
    pool = BlockPool(num_blocks=2, enable_prefix_caching=True, events=log)
    a = _cache(pool, [1, 2])
    first = log.read(0, 0)
    assert first.snapshot and first.stored == [a] and first.epoch == log.epoch and first.last_seq == 1
    assert log.read(first.epoch, first.last_seq).stored == []  # nothing new
    b = _cache(pool, [3, 4], a)
    pool.get_new_blocks(1)  # evicts a, the least recently freed
    batch = log.read(first.epoch, first.last_seq)
    assert not batch.snapshot and batch.stored == [b] and batch.removed == [a] and batch.last_seq == 3


def test_a_hash_stored_and_evicted_within_one_batch_is_reported_once_in_its_final_state() -> None:
    log = KVEventLog(max_events=100)
    pool = BlockPool(num_blocks=1, enable_prefix_caching=True, events=log)
    cursor = log.read(0, 0)
    a = _cache(pool, [1, 2])
    b = _cache(pool, [5, 6])  # evicts a
    batch = log.read(cursor.epoch, cursor.last_seq)
    assert batch.stored == [b] and batch.removed == [a]


@pytest.mark.parametrize("reason", ["other epoch", "gap"])
def test_a_reader_that_missed_events_gets_a_snapshot(reason: str) -> None:
    log = KVEventLog(max_events=2)
    pool = BlockPool(num_blocks=4, enable_prefix_caching=True, events=log)
    cursor = log.read(0, 0)
    hashes = [_cache(pool, [i, i]) for i in range(3)]
    if reason == "other epoch":
        batch = log.read(cursor.epoch + 1, cursor.last_seq + 3)
        assert batch.snapshot and sorted(batch.stored) == sorted(hashes)
    else:  # three events since the cursor, the log keeps two
        batch = log.read(cursor.epoch, cursor.last_seq)
        assert batch.snapshot and sorted(batch.stored) == sorted(hashes)


def test_a_batch_keeps_the_order_its_hashes_changed_in() -> None:
    """A request's blocks are stored in prompt order, and the gateway's view of the eviction
    order relies on it (gateway/prefix_index.py): a batch lists them so, each at its latest event."""
    log = KVEventLog(max_events=100)
    pool = BlockPool(num_blocks=64, enable_prefix_caching=True, events=log)
    cursor = log.read(0, 0)
    chain: list[BlockHash] = []
    for i in range(40):
        chain.append(_cache(pool, [i, i + 1], chain[-1] if chain else None))
    log.removed(chain[0])
    log.stored(chain[0])  # its latest event comes last
    batch = log.read(cursor.epoch, cursor.last_seq)
    assert batch.stored == [*chain[1:], chain[0]] and batch.removed == []
