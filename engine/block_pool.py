"""The pool of KV cache blocks: reference counts, a free queue in eviction order,
and the prefix cache that maps block hashes to blocks still holding their KV.

Eviction order: a block whose ref count drops to zero joins the *tail* of the
free queue but keeps its hash and KV, so a later request with the same prefix
can take it back. New allocations pop from the *head*, evicting the least
recently freed block first. Requests free their blocks tail-first, so the
deepest (least shareable) blocks of a prefix are evicted before its root.

With a :class:`~engine.kv_events.KVEventLog`, every hash registered in or dropped from the
prefix cache is recorded there, for gateways that route by cached prefix.

Only the engine's step thread changes the pool (``owner``, engine/step_thread.py); other
threads may read counts and look hashes up.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from engine.kv_cache_utils import BlockHash
from engine.kv_events import KVEventLog
from engine.step_thread import StepThreadOwner


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Set once the block is full and registered in the prefix cache.
    block_hash: BlockHash | None = None
    # The block's tokens, to confirm a hash hit (a 128-bit collision is unlikely, not impossible).
    token_ids: tuple[int, ...] | None = None
    # Free-queue links; both None when the block is not in the queue.
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """A doubly linked list of free blocks with O(1) append, pop-front and removal from anywhere."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(block_id=-1)  # sentinels keep the link code branch-free
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        if last is None:
            raise RuntimeError("free queue tail sentinel lost its link (bug)")
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free
        if first is self._tail or first is None:
            raise RuntimeError("free block queue is empty; callers must check num_free_blocks first (bug)")
        self.remove(first)
        return first

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue (bug)")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool, events: KVEventLog | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.events = events
        self.owner = StepThreadOwner()  # the scheduler above the pool checks the same owner
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        # Prefix-cache statistics, in tokens.
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds: truly empty ones plus cached ones that may be evicted."""
        return self.free_queue.num_free_blocks

    def get_cached_block(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVCacheBlock | None:
        """The block holding exactly these tokens under this hash, or None."""
        block = self.cached_blocks.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the eviction queue."""
        self.owner.check()
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks off the free queue (evicting their cached KV), each with ref count 1,
        in ascending id order.

        Which blocks are taken is the eviction order's choice alone; handing them out sorted
        only decides which position of the request each one holds. Blocks freed together
        (one request's, which are freed tail first) come back as a run of consecutive ids,
        and sorted they stay a run in prompt order, so a request's KV lies in a few
        contiguous spans of the block-major cache, which a KV connector moves as a few
        large messages instead of one per block."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"asked for {num_blocks} blocks with {self.num_free_blocks} free (bug)")
        self.owner.check()
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        new_blocks.sort(key=lambda block: block.block_id)
        return new_blocks

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash, token_ids: Sequence[int]) -> None:
        """Register a full block so later requests with the same prefix can reuse it."""
        self.owner.check()
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        # An identical block may already be cached (two requests prefilled the same
        # prefix concurrently); keep the first, this one is simply never shared.
        if block_hash in self.cached_blocks:
            return
        block.block_hash, block.token_ids = block_hash, tuple(token_ids)
        self.cached_blocks[block_hash] = block
        if self.events is not None:
            self.events.stored(block_hash)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free queue
        in the given order (first given is evicted first)."""
        self.owner.check()
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more times than taken (bug)")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
            block.block_hash = block.token_ids = None
