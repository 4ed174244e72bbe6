"""Keeping the prefix index (``gateway/prefix_index.py``) current: every ``interval_s``,
ask each known prefill, decode and colocated instance for its prefix-cache events after the
index's cursor (``Load.GetKVEvents``, over the internal plane like every call), and apply
them. One batch per instance per poll; a gap or a restart comes back as a snapshot, which
comes in pages when it is large (``serving/kv_event_pages.py``): each poll follows the pages
to the last, then applies the snapshot whole.

A call the instance refuses for any reason but being unreachable or slow (which health and
load polling handle) is logged as an error, once per instance and kind until a poll
succeeds: without its events, kv routing sees nothing cached there.

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

PAGE_HASHES = 65_536  # asked per call: about 1.2 MB of hashes, under gRPC's 4 MiB default
# What health and load polling already report; anything else the index would hide.
_UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})


class KVEventsSync:
    def __init__(self, pool: InstancePool, index: PrefixIndex, interval_s: float) -> None:
        self.pool = pool
        self.index = index
        self.interval_s = interval_s
        self._refusals: dict[str, grpc.StatusCode] = {}  # address -> the refusal logged last

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
        max_blocks = (
            state.report.num_total_blocks
            if state.report is not None and state.report.num_total_blocks
            else DEFAULT_MAX_BLOCKS
        )
        epoch, after_seq = self.index.cursor(address)
        request = disaggregation_pb2.KVEventsRequest(epoch=epoch, after_seq=after_seq, max_hashes=PAGE_HASHES)
        stub = disaggregation_pb2_grpc.LoadStub(state.channel)
        pages: list[disaggregation_pb2.KVEvents] = []  # of the snapshot being paged
        # Enough calls for a whole snapshot twice over (it may start over once, if dropped meanwhile).
        for _ in range(2 * (max_blocks // PAGE_HASHES + 1) + 1):
            try:
                events = await stub.GetKVEvents(request, timeout=self.pool.stale_after_s)
            except grpc.aio.AioRpcError as error:
                self._refused(address, error)
                return
            if address not in self.pool.instances:  # removed while the call ran
                return
            if not events.more and not pages:
                break
            if events.snapshot_offset == 0:  # a (new) snapshot starts
                pages = []
            pages.append(events)
            if not events.more:
                events = _whole(pages)
                break
            request = disaggregation_pb2.KVEventsRequest(
                epoch=events.epoch,
                after_seq=events.last_seq,
                max_hashes=PAGE_HASHES,
                snapshot_offset=events.snapshot_offset + len(events.stored),
            )
        else:
            logger.error("instance %s kept starting its KV event snapshot over; trying again at the next poll", address)
            return
        if self._refusals.pop(address, None) is not None:
            logger.info("KV events of instance %s are read again", address)
        self.index.apply(address, events, max_blocks)

    def _refused(self, address: str, error: grpc.aio.AioRpcError) -> None:
        code = error.code()
        if code in _UNREACHABLE or self._refusals.get(address) == code:
            return
        self._refusals[address] = code
        hint = (
            " (an instance older than this gateway sends its whole snapshot in one message)"
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED
            else ""
        )
        logger.error(
            "instance %s refused its KV events: %s: %s%s; kv routing sees nothing cached there until they come",
            address,
            code.name,
            error.details(),
            hint,
        )


def _whole(pages: list[disaggregation_pb2.KVEvents]) -> disaggregation_pb2.KVEvents:
    """A paged snapshot as one batch, for the index (it is never sent: no size limit)."""
    whole = disaggregation_pb2.KVEvents()
    whole.CopyFrom(pages[-1])
    whole.ClearField("stored")
    for page in pages:
        whole.stored.extend(page.stored)
    whole.snapshot_offset, whole.more = 0, False
    return whole


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
