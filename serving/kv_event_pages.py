"""An instance's prefix-cache events (``engine/kv_events.py``) as ``Load.GetKVEvents``
answers them: in pages, so that no answer exceeds gRPC's message limit (4 MiB by default:
about 230,000 hashes of 16 bytes, a small model's cache on a large GPU).

One call, in order:

1. A caller continuing a paged snapshot (``snapshot_offset`` > 0) whose snapshot is still
   held here gets its next page.
2. Otherwise the log answers the cursor (``KVEventLog.read``). Changes that fit one page go
   back as they are. More changes than a page hold, or a snapshot, become a snapshot (every
   hash cached now, one moment's: ``last_seq``); one larger than a page is held here and sent
   page by page, each call naming the hashes received so far. A caller asking to continue a
   snapshot no longer held (dropped for newer ones, or once its last page went out) gets the
   first page of a new one, and starts over.

Held snapshots are at most ``max_held`` (the oldest dropped first), each at most the
instance's block count of hashes. Event-loop only (the gRPC handler's): no lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine.kv_cache_utils import BlockHash
from engine.kv_events import KVEventLog

# 16 bytes a hash and 2 of framing: about 1.2 MB a page, well under gRPC's default 4 MiB.
DEFAULT_PAGE_HASHES = 65_536
DEFAULT_MAX_HELD = 4  # snapshots being paged at once: one per gateway, and a few gateways


@dataclass(frozen=True, slots=True)
class KVEventPage:
    epoch: int
    last_seq: int
    snapshot: bool
    stored: list[BlockHash]
    removed: list[BlockHash]
    snapshot_offset: int = 0  # where ``stored`` starts in the snapshot
    more: bool = False  # pages of this snapshot follow


class KVEventPages:
    def __init__(
        self, log: KVEventLog, page_hashes: int = DEFAULT_PAGE_HASHES, max_held: int = DEFAULT_MAX_HELD
    ) -> None:
        if page_hashes < 1 or max_held < 1:
            raise ValueError(f"a page needs room for a hash and one snapshot held, got {page_hashes}, {max_held}")
        self.log = log
        self.page_hashes = page_hashes
        self.max_held = max_held
        self._held: OrderedDict[tuple[int, int], list[BlockHash]] = OrderedDict()  # (epoch, last_seq) -> hashes

    def read(self, epoch: int, after_seq: int, snapshot_offset: int = 0, max_hashes: int = 0) -> KVEventPage:
        """The answer to one call (see the module docstring)."""
        page_hashes = min(max_hashes, self.page_hashes) if max_hashes > 0 else self.page_hashes
        if snapshot_offset > 0:
            held = self._held.get((epoch, after_seq))
            if held is not None and snapshot_offset < len(held):
                return self._page(epoch, after_seq, held, snapshot_offset, page_hashes)
            batch = self.log.snapshot()
        else:
            batch = self.log.read(epoch, after_seq)
            if not batch.snapshot and len(batch.stored) + len(batch.removed) <= page_hashes:
                return KVEventPage(batch.epoch, batch.last_seq, False, batch.stored, batch.removed)
            if not batch.snapshot:
                batch = self.log.snapshot()
        if len(batch.stored) <= page_hashes:
            return KVEventPage(batch.epoch, batch.last_seq, True, batch.stored, [])
        self._held[(batch.epoch, batch.last_seq)] = batch.stored
        while len(self._held) > self.max_held:
            self._held.popitem(last=False)
        return self._page(batch.epoch, batch.last_seq, batch.stored, 0, page_hashes)

    def _page(self, epoch: int, last_seq: int, hashes: list[BlockHash], offset: int, page_hashes: int) -> KVEventPage:
        end = offset + page_hashes
        more = end < len(hashes)
        if not more:
            self._held.pop((epoch, last_seq), None)
        return KVEventPage(epoch, last_seq, True, hashes[offset:end], [], offset, more)
