from __future__ import annotations

import pytest

from engine.block_pool import BlockPool
from engine.kv_cache_utils import hash_block_tokens
from tests.engine.factories import eviction_order


def test_new_blocks_come_from_the_head_with_one_reference() -> None:
    pool = BlockPool(num_blocks=4, enable_prefix_caching=True)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 1
    assert eviction_order(pool) == [3]


def test_freed_blocks_join_the_tail_in_the_given_order() -> None:
    pool = BlockPool(num_blocks=4, enable_prefix_caching=True)
    a, b, c = pool.get_new_blocks(3)
    pool.free_blocks([c, b, a])
    # The least recently freed blocks are evicted first (3, then 2), handed out in id order.
    assert [blk.block_id for blk in pool.get_new_blocks(2)] == [2, 3]
    assert eviction_order(pool) == [1, 0]


def test_a_request_freed_tail_first_comes_back_as_one_ascending_run() -> None:
    """What keeps a request's KV in few contiguous spans for a KV connector, after any churn."""
    pool = BlockPool(num_blocks=10, enable_prefix_caching=True)
    first = pool.get_new_blocks(6)
    pool.free_blocks(reversed(first[2:]))  # blocks 5, 4, 3, 2 join the queue after 6..9
    pool.get_new_blocks(4)  # 6..9
    assert [blk.block_id for blk in pool.get_new_blocks(4)] == [2, 3, 4, 5]


def test_shared_block_returns_to_the_queue_only_at_zero_references() -> None:
    pool = BlockPool(num_blocks=2, enable_prefix_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.num_free_blocks == 2


def test_double_free_is_a_bug() -> None:
    pool = BlockPool(num_blocks=2, enable_prefix_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError, match="freed more times"):
        pool.free_blocks([block])


def test_cached_block_hit_requires_equal_tokens_and_survives_until_evicted() -> None:
    pool = BlockPool(num_blocks=2, enable_prefix_caching=True)
    (block,) = pool.get_new_blocks(1)
    block_hash = hash_block_tokens(None, [1, 2, 3, 4])
    pool.cache_block(block, block_hash, [1, 2, 3, 4])
    pool.free_blocks([block])
    assert pool.get_cached_block(block_hash, [1, 2, 3, 4]) is block
    # Same hash, other tokens (a forced collision) is not a hit.
    assert pool.get_cached_block(block_hash, [1, 2, 3, 5]) is None
    # Touching a free cached block pulls it out of the free queue.
    pool.touch([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([block])
    # Allocation pops block 1 first, then must evict block 0 and its hash.
    pool.get_new_blocks(2)
    assert pool.get_cached_block(block_hash, [1, 2, 3, 4]) is None
    assert block.block_hash is None


def test_free_queue_removal_from_the_middle_is_constant_time_and_keeps_order() -> None:
    pool = BlockPool(num_blocks=5, enable_prefix_caching=True)
    middle = pool.blocks[2]
    pool.free_queue.remove(middle)
    with pytest.raises(RuntimeError, match="not in the free queue"):
        pool.free_queue.remove(middle)
    assert eviction_order(pool) == [0, 1, 3, 4]


def test_hash_chain_depends_on_parent_and_salt() -> None:
    first = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(None, [1, 2]) == first
    assert hash_block_tokens(None, [1, 2], b"salt") != first
    assert hash_block_tokens(first, [3, 4]) != hash_block_tokens(hash_block_tokens(None, [9, 9]), [3, 4])


def test_hit_counters() -> None:
    pool = BlockPool(num_blocks=1, enable_prefix_caching=True)
    pool.num_queried_tokens, pool.num_hit_tokens = 40, 10
    assert pool.prefix_cache_hit_rate == 0.25
