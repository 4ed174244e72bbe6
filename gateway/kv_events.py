"""Keeping the prefix index (``gateway/prefix_index.py``) current: every ``interval_s``,
ask each known prefill, decode and colocated instance for its prefix-cache events after the
index's cursor (``Load.GetKVEvents``, over the internal plane like every call), and apply
them. One batch per instance per poll; a gap or a restart comes back as a snapshot.

Runs beside instance discovery, whichever kind (static list or Redis): it follows the
pool's instances, and the pool forgets an instance's blocks when the instance leaves it.
"""

from __future__ import annotations

import asyncio
import functools
import logging

import grpc

from gateway.instances import InstancePool
from gateway.prefix_index import DEFAULT_MAX_BLOCKS, PrefixIndex
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc

logger = logging.getLogger(__name__)


class KVEventsSync:
    def __init__(self, pool: InstancePool, index: PrefixIndex, interval_s: float) -> None:
        self.pool = pool
        self.index = index
        self.interval_s = interval_s

    async def run(self) -> None:
        # A poll per instance at most in flight, never awaited by the others': an instance that
        # stopped answering must not hold up the index of every other one.
        inflight: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                for address in list(self.pool.instances):
                    if address not in inflight:
                        task = inflight[address] = asyncio.create_task(self._poll(address))
                        task.add_done_callback(functools.partial(_forget, inflight, address))
                await asyncio.sleep(self.interval_s)
        finally:
            for task in list(inflight.values()):
                task.cancel()

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(address) for address in list(self.pool.instances)))

    async def _poll(self, address: str) -> None:
        state = self.pool.instances.get(address)
        if state is None or not state.serving:
            return
        epoch, after_seq = self.index.cursor(address)
        try:
            events = await disaggregation_pb2_grpc.LoadStub(state.channel).GetKVEvents(
                disaggregation_pb2.KVEventsRequest(epoch=epoch, after_seq=after_seq), timeout=self.pool.stale_after_s
            )
        except grpc.aio.AioRpcError:
            return  # health and load polling decide whether it is usable
        if address not in self.pool.instances:  # removed while the call ran
            return
        max_blocks = (
            state.report.num_total_blocks
            if state.report is not None and state.report.num_total_blocks
            else DEFAULT_MAX_BLOCKS
        )
        self.index.apply(address, events, max_blocks)


async def run_kv_events(sync: KVEventsSync) -> None:
    """The sync loop as a task body that logs, rather than hides, an unexpected end."""
    try:
        await sync.run()
    except asyncio.CancelledError:
        raise
    except Exception:
        logger.exception("KV event polling stopped: cache-aware routing now works from stale prefix data")
        raise


def _forget(inflight: dict[str, asyncio.Task[None]], address: str, _: asyncio.Task[None]) -> None:
    inflight.pop(address, None)
