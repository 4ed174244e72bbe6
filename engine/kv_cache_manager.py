"""Which blocks each request holds: prefix-cache lookup, slot allocation and freeing."""

from __future__ import annotations

from engine.block_pool import BlockPool, KVCacheBlock
from engine.kv_cache_utils import XXH3, BlockHash, BlockHasher, cdiv, extend_block_hashes
from engine.kv_events import KVEventLog
from engine.request import Request


class KVCacheManager:
    """Maps requests to their KV blocks on top of a :class:`BlockPool`.

    Ownership: a request holds one reference on each block in ``req_to_blocks``
    from allocation until :meth:`free`, which every finish, abort and preemption
    path calls exactly once.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        events: KVEventLog | None = None,
        block_hasher: BlockHasher = XXH3,
    ) -> None:
        self.block_size = block_size
        self.block_hasher = block_hasher  # the prefix cache's hash (engine/kv_cache_utils.py)
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching, events)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # The same blocks as plain ids, kept in step so the model runner reads them for free.
        self.req_to_block_ids: dict[str, list[int]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_pool.num_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of the request's leading full blocks already in the prefix cache.

        Called once when a waiting request is first considered. Returns the hit
        blocks (not yet referenced: pass them to :meth:`allocate_slots`) and the
        number of tokens they cover. At least one token is always left to compute,
        because the last position's logits are needed to sample.
        """
        if not self.enable_prefix_caching:
            return [], 0
        request.update_block_hashes(self.block_size, self.block_hasher)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for index, block_hash in enumerate(request.block_hashes[:max_hit_blocks]):
            start = index * self.block_size
            block = self.block_pool.get_cached_block(block_hash, request.all_token_ids[start : start + self.block_size])
            if block is None:
                break
            hits.append(block)
        self.block_pool.num_queried_tokens += request.num_tokens
        self.block_pool.num_hit_tokens += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def num_cached_prefix_tokens(self, request: Request) -> int:
        """Tokens of the request's leading full blocks whose hashes the prefix cache holds now: an
        estimate for load reports (no token check, no reference taken, no statistics)."""
        if not self.enable_prefix_caching:
            return 0
        return self._num_cached_prefix_blocks(request) * self.block_size

    def num_cached_prompt_tokens(self, prompt_token_ids: list[int], cache_salt: bytes = b"") -> int:
        """:meth:`num_cached_prefix_tokens` of a prompt not added yet, from any thread: the
        estimate that a request queued for the engine thread (which owns the cache) shows in
        load reports until it is added. It only hashes the prompt and tests the cache's dict
        for each hash, each test atomic under the GIL: at worst it misses a block the engine
        thread is caching or counts one it is evicting at that moment."""
        if not self.enable_prefix_caching:
            return 0
        block_hashes: list[BlockHash] = []
        extend_block_hashes(block_hashes, prompt_token_ids, self.block_size, cache_salt, self.block_hasher)
        return self._num_leading_cached(block_hashes, len(prompt_token_ids)) * self.block_size

    def first_uncached_block_hash(self, request: Request) -> BlockHash | None:
        """The hash of the first of the request's leading full blocks that the prefix cache
        does not hold, where a hit would stop now; None when it holds every one a hit may take."""
        if not self.enable_prefix_caching:
            return None
        num_hits = self._num_cached_prefix_blocks(request)
        return request.block_hashes[num_hits] if num_hits < (request.num_tokens - 1) // self.block_size else None

    def blocks_still_to_cache(self, request: Request) -> list[BlockHash]:
        """Hashes of the request's full blocks not registered in the prefix cache yet: for a
        prefill under way, the blocks of its prompt that later steps compute."""
        if not self.enable_prefix_caching:
            return []
        request.update_block_hashes(self.block_size, self.block_hasher)
        return request.block_hashes[self._num_cached_blocks.get(request.request_id, 0) :]

    def _num_cached_prefix_blocks(self, request: Request) -> int:
        request.update_block_hashes(self.block_size, self.block_hasher)
        return self._num_leading_cached(request.block_hashes, request.num_tokens)

    def _num_leading_cached(self, block_hashes: list[BlockHash], num_tokens: int) -> int:
        """Leading blocks of a ``num_tokens`` prompt whose hashes the cache holds (at most all
        but the block of its last token, which is always computed)."""
        num_hits = 0
        for block_hash in block_hashes[: (num_tokens - 1) // self.block_size]:
            if block_hash not in self.block_pool.cached_blocks:
                break
            num_hits += 1
        return num_hits

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[KVCacheBlock] | None = None,
        cache_new_blocks: bool = True,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of KV after the computed ones.

        Called by the scheduler for every request it schedules. ``computed_blocks``
        are prefix-cache hits from :meth:`get_computed_blocks` (first admission
        only). Returns the newly allocated blocks, or None — changing nothing —
        when the pool cannot supply them. With ``cache_new_blocks`` the blocks
        that become full are registered in the prefix cache; the decode role
        passes False while their KV is still in flight from the prefill side.
        """
        computed_blocks = computed_blocks or []
        held = self.req_to_blocks.get(request.request_id, [])
        num_total_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_blocks_needed = cdiv(num_total_tokens, self.block_size) - len(held) - len(computed_blocks)
        # Hits sitting in the free queue stop being allocatable once touched.
        num_evictable_hits = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        if num_blocks_needed > self.block_pool.num_free_blocks - num_evictable_hits:
            return None
        self.block_pool.touch(computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_blocks_needed, 0))
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        blocks.extend(computed_blocks)
        blocks.extend(new_blocks)
        block_ids = self.req_to_block_ids.setdefault(request.request_id, [])
        block_ids.extend(block.block_id for block in computed_blocks)
        block_ids.extend(block.block_id for block in new_blocks)
        if computed_blocks:
            self._num_cached_blocks[request.request_id] = len(computed_blocks)
        if cache_new_blocks:
            self.cache_blocks(request, num_total_tokens)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that ``num_tokens`` tokens fill completely."""
        if not self.enable_prefix_caching:
            return
        request.update_block_hashes(self.block_size, self.block_hasher)
        blocks = self.req_to_blocks[request.request_id]
        num_full = min(num_tokens // self.block_size, len(request.block_hashes), len(blocks))
        start = self._num_cached_blocks.get(request.request_id, 0)
        for index in range(start, num_full):
            first = index * self.block_size
            self.block_pool.cache_block(
                blocks[index], request.block_hashes[index], request.all_token_ids[first : first + self.block_size]
            )
        self._num_cached_blocks[request.request_id] = max(start, num_full)

    def free(self, request: Request) -> None:
        """Release every block the request holds, tail first (see the pool's eviction order)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.req_to_block_ids.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def free_blocks_beyond(self, request: Request, num_tokens: int) -> None:
        """Keep only the blocks that the first ``num_tokens`` tokens occupy; free the rest, tail
        first. Speculative decoding calls it after rejecting drafts whose slots it allocated: a
        block that held only rejected positions goes back to the pool at once, so the request
        holds exactly what a non-speculative run would. Those blocks are never in the prefix
        cache (only blocks full of known tokens are), so nothing cached is lost."""
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        num_kept = cdiv(num_tokens, self.block_size)
        if len(blocks) <= num_kept:
            return
        surplus = blocks[num_kept:]
        del blocks[num_kept:]
        del self.req_to_block_ids[request.request_id][num_kept:]
        self.block_pool.free_blocks(reversed(surplus))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids in order (a live list: copy it to keep it past the next step)."""
        return self.req_to_block_ids.get(request_id, [])
