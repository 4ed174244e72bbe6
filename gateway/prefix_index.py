"""The gateway's view of every instance's prefix cache: which full-block hashes each one
holds, so routing can send a request where the longest prefix of its prompt already is.

Fed by the instances' KV events (``gateway/kv_events.py`` polls ``GetKVEvents``; the
engine side is ``engine/kv_events.py``): incremental changes after a cursor, or a snapshot
after a restart or a gap. A request's chain is computed here with the engine's own hashing
(``engine.kv_cache_utils``: chained over each full block's token ids, the cache salt mixed into
the first), at each instance's block size and with the hash its events name: xxh3, sha256, or
HMAC-SHA256 under the key both derive from the cluster secret (``cluster/derived_keys.py``). A
gateway that cannot compute an instance's hash (keyed, and this gateway has no secret) says so
once and routes there as if nothing were cached.

Between a dispatch and the events that confirm it (a poll interval or more later), the
blocks the request will leave behind are *predicted* on the instance it went to, for
``PREDICTION_TTL_S`` or until events confirm them: without that, a burst of requests sharing a new prefix would spread
over every instance before the first one's blocks were reported.

Bounded memory: per instance at most its reported block count of hashes (cached and
predicted each); an instance that leaves the pool is forgotten.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from engine.kv_cache_utils import XXH3, BlockHash, BlockHasher, extend_block_hashes
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
    cached: set[BlockHash] = field(default_factory=set)
    predicted: dict[BlockHash, float] = field(default_factory=dict)  # hash -> monotonic expiry
    overflowed: bool = False  # said once: the instance reported more hashes than it has blocks


class PrefixIndex:
    def __init__(self, prediction_ttl_s: float = PREDICTION_TTL_S, hash_key: bytes | None = None) -> None:
        """``hash_key``: the prefix-cache hash key derived from this gateway's cluster secret
        (``cluster.derived_keys.prefix_cache_key``), for instances that hash with HMAC-SHA256."""
        self.prediction_ttl_s = prediction_ttl_s
        self._hash_key = hash_key
        self._instances: dict[str, _InstanceBlocks] = {}  # by address

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
            blocks.cached.discard(block_hash)
            blocks.predicted.pop(block_hash, None)
        for raw in events.stored:
            if len(blocks.cached) >= max_blocks:
                if not blocks.overflowed:
                    blocks.overflowed = True
                    logger.warning(
                        "instance %s reports more cached blocks than its %d; ignoring the excess", address, max_blocks
                    )
                break
            block_hash = _block_hash(raw)
            blocks.cached.add(block_hash)
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
        now = time.monotonic()
        num_hits = 0
        for block_hash in prompt.chain(blocks.block_size, blocks.hasher):
            if block_hash not in blocks.cached and blocks.predicted.get(block_hash, 0.0) < now:
                break
            num_hits += 1
        return num_hits

    def predict(self, address: str, prompt: PromptBlocks, max_blocks: int) -> None:
        """The request was just sent to this instance: expect its prompt's full blocks there."""
        blocks = self._instances.get(address)
        if blocks is None or not blocks.block_size or blocks.hasher is None:
            return
        now = time.monotonic()
        if len(blocks.predicted) >= max_blocks:
            blocks.predicted = {h: expiry for h, expiry in blocks.predicted.items() if expiry >= now}
        expiry = now + self.prediction_ttl_s
        for block_hash in prompt.chain(blocks.block_size, blocks.hasher):
            if len(blocks.predicted) >= max_blocks:
                break
            if block_hash not in blocks.cached:
                blocks.predicted[block_hash] = expiry

    def _hasher(self, name: str) -> BlockHasher | None:
        """The hash an instance's events name, as this gateway computes it; None if it cannot."""
        if name == "hmac-sha256":
            return BlockHasher("sha256", self._hash_key) if self._hash_key is not None else None
        return _UNKEYED_HASHERS.get(name)

    def num_cached_blocks(self, address: str) -> int:
        """Blocks the instance's prefix cache holds, or is predicted to hold soon."""
        blocks = self._instances.get(address)
        return len(blocks.cached) + len(blocks.predicted) if blocks is not None else 0


def _block_hash(raw: bytes) -> BlockHash:
    return BlockHash(int.from_bytes(raw, "little"))
