"""The gateway's view of every instance's prefix cache: which full-block hashes each one
holds, so routing can send a request where the longest prefix of its prompt already is.

Fed by the instances' KV events (``gateway/kv_events.py`` follows ``WatchKVEvents``; the
engine side is ``engine/kv_events.py``): incremental changes after a cursor, or a snapshot
after a restart or a gap. A request's chain is computed here with the engine's own hashing
(``engine.kv_cache_utils``: chained over each full block's token ids, the cache salt mixed into
the first), at each instance's block size and with the hash its events name: xxh3, sha256, or
HMAC-SHA256 under the key both derive from the cluster secret (``cluster/derived_keys.py``). A
gateway that cannot compute an instance's hash (keyed, and this gateway has no secret) says so
once and routes there as if nothing were cached.

Between a dispatch and the events that confirm it (the request's prefill steps later), the
blocks the request will leave behind are *predicted* on the instance it went to, for
``PREDICTION_TTL_S`` or until events confirm them: without that, a burst of requests sharing a new prefix would spread
over every instance before the first one's blocks were reported.

Each instance's cached blocks are kept in the order it would evict them (least recently used
first, a request's last block before its first, as the engine frees them), with when each
was last used: stored, or hit by a request sent there. That prices an eviction: the blocks
a new prompt would push out, each worth what its age says of its reuse
(``gateway/reuse_ages.py``).

Bounded memory: per instance at most its reported block count of hashes (cached and
predicted each); an instance that leaves the pool is forgotten.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv_cache_utils import XXH3, BlockHash, BlockHasher, extend_block_hashes
from gateway.reuse_ages import ReuseAges
from splitserve.v1 import disaggregation_pb2

logger = logging.getLogger(__name__)

# Long enough for a prompt to wait in a queue and be prefilled before its blocks exist (on a
# loaded CPU host, several seconds each); a prediction that never comes true costs at most
# this long of a wrong preference.
PREDICTION_TTL_S = 30.0
DEFAULT_MAX_BLOCKS = 1 << 17  # before an instance's first load report says how many it has
_UNKEYED_HASHERS = {hasher.name: hasher for hasher in (XXH3, BlockHasher("sha256"))}


@dataclass(slots=True)
class PromptBlocks:
    """A request's prompt as the prefix caches see it: its block-hash chain per block size."""

    token_ids: list[int]
    cache_salt: str = ""
    # Prompt tokens the index expected cached where kv routing last sent the prompt's prefill,
    # to compare with what that instance served from its cache (``splitserve_routed_prefix_tokens``).
    expected_hit_tokens: int = 0
    # Of the prompt tokens some admissible instance held, those the chosen one did not: what
    # kv routing gave up for the load it balanced (``outcome=passed_over``).
    passed_over_tokens: int = 0
    _chains: dict[tuple[int, BlockHasher], list[BlockHash]] = field(default_factory=dict)

    def chain(self, block_size: int, hasher: BlockHasher = XXH3) -> list[BlockHash]:
        chain = self._chains.get((block_size, hasher))
        if chain is None:
            chain = self._chains[block_size, hasher] = []
            extend_block_hashes(chain, self.token_ids, block_size, self.cache_salt.encode(), hasher)
        return chain


@dataclass(slots=True)
class _InstanceBlocks:
    epoch: int = 0
    last_seq: int = 0
    block_size: int = 0  # 0 until the first events arrive
    hasher: BlockHasher | None = XXH3  # the instance's block hash; None: one this gateway cannot compute
    # hash -> when last used (the index's clock), in eviction order: least recently used first
    cached: OrderedDict[BlockHash, float] = field(default_factory=OrderedDict)
    predicted: dict[BlockHash, float] = field(default_factory=dict)  # hash -> monotonic expiry
    overflowed: bool = False  # said once: the instance reported more hashes than it has blocks

    def touch(self, block_hash: BlockHash, now: float) -> None:
        """The block is cached and was used ``now``: last in eviction order."""
        self.cached[block_hash] = now
        self.cached.move_to_end(block_hash)


class PrefixIndex:
    def __init__(
        self,
        prediction_ttl_s: float = PREDICTION_TTL_S,
        hash_key: bytes | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``hash_key``: the prefix-cache hash key derived from this gateway's cluster secret
        (``cluster.derived_keys.prefix_cache_key``), for instances that hash with HMAC-SHA256.
        ``clock``: seconds, monotonic (a test replays a recorded sequence on its own clock)."""
        self.prediction_ttl_s = prediction_ttl_s
        self._hash_key = hash_key
        self._clock = clock
        self._instances: dict[str, _InstanceBlocks] = {}  # by address
        self.reuse_ages = ReuseAges()

    def cursor(self, address: str) -> tuple[int, int]:
        """(epoch, last sequence number) to ask the instance's events after."""
        blocks = self._instances.get(address)
        return (blocks.epoch, blocks.last_seq) if blocks is not None else (0, 0)

    def apply(self, address: str, events: disaggregation_pb2.KVEvents, max_blocks: int) -> None:
        """Apply one batch of an instance's events; ``max_blocks`` (its block count) bounds what
        is kept for it, whatever it sends."""
        blocks = self._instances.setdefault(address, _InstanceBlocks())
        if events.snapshot:
            if blocks.epoch and blocks.epoch != events.epoch:
                logger.info("instance %s restarted (new KV event epoch): its prefix cache starts over", address)
            blocks.cached.clear()
            blocks.predicted.clear()
        blocks.epoch, blocks.last_seq, blocks.block_size = events.epoch, events.last_seq, events.block_size
        hasher = self._hasher(events.block_hash or XXH3.name)
        if hasher is None and blocks.hasher is not None:
            logger.warning(
                "instance %s hashes its prefix cache with %s, which this gateway cannot compute (give it the "
                "instances' cluster secret): kv routing sees nothing cached there",
                address,
                events.block_hash,
            )
        blocks.hasher = hasher
        for raw in events.removed:
            block_hash = _block_hash(raw)
            blocks.cached.pop(block_hash, None)
            blocks.predicted.pop(block_hash, None)
        now = self._clock()
        # Stored in prompt order; the engine evicts a request's last block first, so its first is the newest.
        for raw in reversed(events.stored):
            block_hash = _block_hash(raw)
            if block_hash not in blocks.cached and len(blocks.cached) >= max_blocks:
                if not events.snapshot:
                    # This view holds hashes the instance no longer does: ignoring its new ones from
                    # now on would blind routing to it (it did, in a benchmark run). Start over from
                    # a snapshot at the next poll.
                    logger.warning(
                        "the prefix index of instance %s went out of step with it (more than its %d blocks); "
                        "reading a snapshot of its cache",
                        address,
                        max_blocks,
                    )
                    blocks.epoch = blocks.last_seq = 0
                    return
                if not blocks.overflowed:
                    blocks.overflowed = True
                    logger.warning(
                        "instance %s reports more cached blocks than its %d; ignoring the excess", address, max_blocks
                    )
                break
            blocks.touch(block_hash, now)
            blocks.predicted.pop(block_hash, None)

    def forget(self, address: str) -> None:
        self._instances.pop(address, None)

    def block_size(self, address: str) -> int:
        blocks = self._instances.get(address)
        return blocks.block_size if blocks is not None else 0

    def num_hit_blocks(self, address: str, prompt: PromptBlocks) -> int:
        """Leading blocks of the prompt the instance holds (or is predicted to hold)."""
        blocks = self._instances.get(address)
        if blocks is None or not blocks.block_size or blocks.hasher is None:
            return 0
        now = self._clock()
        num_hits = 0
        for block_hash in prompt.chain(blocks.block_size, blocks.hasher):
            if block_hash not in blocks.cached and blocks.predicted.get(block_hash, 0.0) < now:
                break
            num_hits += 1
        return num_hits

    def predict(self, address: str, prompt: PromptBlocks, max_blocks: int) -> None:
        """The request was just sent to this instance: the cached blocks it hits are used now
        (how long they went unused is a reuse age), and its prompt's other full blocks are
        expected there."""
        blocks = self._instances.get(address)
        if blocks is None or not blocks.block_size or blocks.hasher is None:
            return
        now = self._clock()
        chain = prompt.chain(blocks.block_size, blocks.hasher)
        hits = list(itertools.takewhile(blocks.cached.__contains__, chain))
        if hits:
            self.reuse_ages.observe(now - blocks.cached[hits[0]])
        for block_hash in reversed(hits):
            blocks.touch(block_hash, now)
        if len(blocks.predicted) >= max_blocks:
            blocks.predicted = {h: expiry for h, expiry in blocks.predicted.items() if expiry >= now}
        expiry = now + self.prediction_ttl_s
        for block_hash in chain:
            if len(blocks.predicted) >= max_blocks:
                break
            if block_hash not in blocks.cached:
                blocks.predicted[block_hash] = expiry

    def _hasher(self, name: str) -> BlockHasher | None:
        """The hash an instance's events name, as this gateway computes it; None if it cannot."""
        if name == "hmac-sha256":
            return BlockHasher("sha256", self._hash_key) if self._hash_key is not None else None
        return _UNKEYED_HASHERS.get(name)

    def eviction_cost_blocks(
        self, address: str, prompt: PromptBlocks, num_new_blocks: int, num_total_blocks: int
    ) -> float:
        """What the instance's cache would lose, in blocks to recompute, if ``num_new_blocks``
        of the prompt were put there: the blocks it would evict to make room (its least
        recently used ones beyond its free blocks, the prompt's own excluded), each worth what
        its age says of its reuse. 0 when the instance's block count is not known yet."""
        blocks = self._instances.get(address)
        if blocks is None or num_total_blocks <= 0:
            return 0.0
        num_free = num_total_blocks - len(blocks.cached) - len(blocks.predicted)
        num_evicted = num_new_blocks - max(0, num_free)
        if num_evicted <= 0:
            return 0.0
        num_gone = max(0, -num_free)  # the oldest ones, evicted for blocks predicted there already
        own = set(prompt.chain(blocks.block_size, blocks.hasher)) if blocks.block_size and blocks.hasher else set()
        now = self._clock()
        cost = 0.0
        for block_hash, last_used in blocks.cached.items():
            if num_evicted == 0:
                break
            if block_hash in own:
                continue
            if num_gone:
                num_gone -= 1
                continue
            cost += self.reuse_ages.value(now - last_used)
            num_evicted -= 1
        return cost + num_evicted  # past every block the index knows of: counted in full

    def num_cached_blocks(self, address: str) -> int:
        """Blocks the instance's prefix cache holds, or is predicted to hold soon."""
        blocks = self._instances.get(address)
        return len(blocks.cached) + len(blocks.predicted) if blocks is not None else 0


def _block_hash(raw: bytes) -> BlockHash:
    return BlockHash(int.from_bytes(raw, "little"))
