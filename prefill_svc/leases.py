"""The prefill side of KV leases: the prompt KV this instance keeps pinned after a prefill.

:meth:`KVLeases.pin` starts the lease first, then publishes the blocks on the connector,
awaiting it off the event loop (a store may take seconds; health, RenewKV and heartbeats
answer meanwhile), and starts the lease again from when the handle goes out. An abort, a
release or an expiry during the publish unpins as usual: the connector's ``unpublish``
waits for the publish to stop reading the blocks before the engine frees them.

A request's blocks are pinned from the end of its prefill until exactly one of: the decode
instance releases them (ReleaseKV), the request is aborted (Abort), or the lease expires. A
decode instance holding the handle renews the lease (RenewKV), so it expires only when that
instance is gone or silent. Each of these answers at once (a prefill step of a long prompt
takes seconds on a CPU); every path ends in :meth:`KVLeases.unpin`, which frees the blocks
exactly once, in the background, in this order:

1. ``connector.unpublish``: refuse new pulls, cut off any still reading the blocks (after a
   grace for a release: D releases once its pull is over, and P may not have seen its last
   sends complete yet), and return once nothing reads them;
2. ``engine.release_kv``: a command the engine thread runs at its next step boundary, which
   puts the blocks back in the pool.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from cluster.background import BackgroundTasks
from engine.async_engine import AsyncEngine
from kv_connector.base import KVConnector, PublishedKV
from serving.instance import ServiceCounters

logger = logging.getLogger(__name__)


class KVLeases:
    """The requests whose prompt KV is pinned here, each with the timer of its lease. Runs on
    the event loop; no method waits for the engine."""

    def __init__(self, connector: KVConnector, engine: AsyncEngine, lease_s: float, counters: ServiceCounters) -> None:
        self.lease_s = lease_s
        self._connector = connector
        self._engine = engine
        self._counters = counters
        self._leases: dict[str, asyncio.TimerHandle] = {}  # pinned request id -> its expiry
        self._freeing = BackgroundTasks()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._leases

    async def pin(
        self, request_id: str, block_ids: list[int], token_ids: list[int], pull_token: bytes, cache_salt: str
    ) -> PublishedKV | None:
        """Right after the prefill, while the engine keeps ``block_ids`` pinned: start the lease,
        publish the blocks (the KV of ``token_ids``) to pulls that present ``pull_token``, and
        return what the handle must carry; None when the request was unpinned meanwhile (its
        blocks are being freed: no handle may go out). A caller cancelled meanwhile unpins."""
        self._leases[request_id] = self._arm(request_id)
        try:
            published = await self._connector.publish(
                request_id, block_ids, token_ids, pull_token=pull_token, cache_salt=cache_salt
            )
        except BaseException:
            self.unpin(request_id, grace_s=0.0)
            raise
        lease = self._leases.get(request_id)
        if lease is None:
            return None
        lease.cancel()  # the lease runs from when the handle goes out, however long the publish took
        self._leases[request_id] = self._arm(request_id)
        return published

    def renew(self, request_ids: Iterable[str]) -> list[str]:
        """RenewKV: restart the lease of each request; returns the ids not pinned here (released,
        aborted, expired, or never seen)."""
        unknown = []
        for request_id in request_ids:
            lease = self._leases.get(request_id)
            if lease is None:
                unknown.append(request_id)
                continue
            lease.cancel()
            self._leases[request_id] = self._arm(request_id)
            self._counters.num_lease_renewals += 1
        return unknown

    def unpin(self, request_id: str, grace_s: float) -> bool:
        """Stop the lease and free the blocks in the background, giving a pull still reading
        them ``grace_s`` to finish. False if nothing was pinned."""
        lease = self._leases.pop(request_id, None)
        if lease is None:
            return False
        lease.cancel()
        self._freeing.spawn(self._free(request_id, grace_s))
        return True

    async def close(self) -> None:
        """At shutdown: free what is still pinned, and wait for frees under way."""
        for request_id in list(self._leases):
            self.unpin(request_id, grace_s=0.0)
        await self._freeing.wait()

    def _arm(self, request_id: str) -> asyncio.TimerHandle:
        return asyncio.get_running_loop().call_later(self.lease_s, self._expire, request_id)

    def _expire(self, request_id: str) -> None:
        if self.unpin(request_id, grace_s=0.0):
            self._counters.num_lease_expiries += 1
            logger.warning(
                "KV lease of %s expired after %.0f s without a release or renewal: blocks freed",
                request_id,
                self.lease_s,
            )

    async def _free(self, request_id: str, grace_s: float) -> None:
        await self._connector.unpublish(request_id, grace_s)  # returns once no pull reads the blocks
        self._engine.release_kv(request_id)
