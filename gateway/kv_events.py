"""Keeping the prefix index (``gateway/prefix_index.py``) current: a subscription per known
prefill, decode and colocated instance (``Load.WatchKVEvents``, over the internal plane like
every call), which the instance pushes its prefix-cache changes down, one batch per engine
step that changed its cache (``serving/kv_event_stream.py``). Nothing travels while nothing
changes: the traffic follows the caches' changes, not gateways x instances x a poll rate.

One follower task per instance, in call order:

1. Subscribe from the index's cursor. The instance first sends what changed after it, then
   each step's batch; the follower applies each as it comes.
2. A resync marker (the cursor needs a snapshot: first contact, a restart, a gap; or this
   gateway read slower than the instance's queue for it allows): read the events with the
   paged poll (``Load.GetKVEvents``): changes after the cursor, or a snapshot that comes in
   pages when it is large (``serving/kv_event_pages.py``), followed to the last and applied
   whole; then subscribe again (1).
3. The stream ends OK (its lifetime on the instance): subscribe again from the cursor (1).
4. It fails (the instance is gone or slow): the follower ends. Every ``interval_s`` the
   supervisor starts one for each serving instance that has none, so a subscription comes
   back when its instance does, and stops the follower of one that stopped serving.
4b. Nothing at all arrives on it for ``liveness.silence_s``: the follower ends the stream and
   resyncs as after a marker (2). The instance writes a heartbeat (an empty message) every
   ``liveness.heartbeat_s`` without a batch (asked in the request), so only a peer that
   stopped sending is that silent: a host gone without a FIN or RST (a dead NIC, a
   partition), or a stuck process. An application heartbeat, not gRPC keepalive pings: it
   crosses every proxy between the two (HTTP/2 pings end at the first), proves the instance's
   stream is served and not only its transport, and needs no ping policy on the instances'
   servers (one that refuses a client's pings closes the connection, and every call on it,
   with GOAWAY too_many_pings). The poll of a host still silent fails at its deadline
   (``stale_after_s``); the follower ends and the supervisor tries again, until the host
   answers or discovery drops it.
5. An instance that refuses the subscription (one older than this gateway, or at its cap of
   subscribers): the follower polls it every ``interval_s`` instead, and tries again.

A call the instance refuses for any reason but being unreachable or slow (which health and
load polling handle) is logged as an error, once per instance and kind until a call
succeeds: without its events, kv routing sees nothing cached there.

Runs beside instance discovery, whichever kind (static list or Redis): it follows the
pool's instances, and the pool forgets an instance's blocks when the instance leaves it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Literal

import grpc

from gateway.instances import InstancePool, InstanceState
from gateway.kv_event_liveness import KVEventLiveness
from gateway.kv_event_traffic import KVEventTraffic
from gateway.prefix_index import DEFAULT_MAX_BLOCKS, PrefixIndex
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc

logger = logging.getLogger(__name__)

PAGE_HASHES = 65_536  # asked per call: about 1.2 MB of hashes, under gRPC's 4 MiB default
# What health and load polling already report; anything else the index would hide.
_UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})
# An instance older than this gateway, or one serving as many subscriptions as it takes.
_NO_SUBSCRIPTION = frozenset({grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.RESOURCE_EXHAUSTED})


class KVEventsSync:
    def __init__(
        self,
        pool: InstancePool,
        index: PrefixIndex,
        interval_s: float,
        liveness: KVEventLiveness | None = None,
        traffic: KVEventTraffic | None = None,
    ) -> None:
        self.pool = pool
        self.index = index
        self.interval_s = interval_s
        self.liveness = liveness or KVEventLiveness()
        self.traffic = traffic or KVEventTraffic()  # exported on /metrics (gateway/metrics.py)
        self._refusals: dict[str, grpc.StatusCode] = {}  # address -> the refusal logged last
        self._unsubscribable: set[str] = set()  # addresses whose refusal to subscribe was said
        self._silent: set[str] = set()  # addresses whose silent stream was logged, until one speaks

    async def run(self) -> None:
        # A follower per instance, never awaited by the others': an instance that stopped
        # answering must not hold up the index of every other one.
        followers: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                for address, state in list(self.pool.instances.items()):
                    if state.serving and address not in followers:
                        task = followers[address] = asyncio.create_task(self._follow(address))
                        task.add_done_callback(functools.partial(_forget, followers, address))
                for address, task in list(followers.items()):
                    followed = self.pool.instances.get(address)
                    if followed is None or not followed.serving:
                        task.cancel()  # the pool forgot it, or it is down or draining: no routing there
                await asyncio.sleep(self.interval_s)
        finally:
            for task in list(followers.values()):
                task.cancel()

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(address) for address in list(self.pool.instances)))

    async def _follow(self, address: str) -> None:
        """Subscribe, and resynchronise by the paged poll when told to (see the module docstring)."""
        while True:
            outcome = await self._watch(address)
            if outcome == "failed":
                return
            if outcome == "refused":
                await self._poll(address)
                await asyncio.sleep(self.interval_s)
            elif outcome == "resync" and not await self._poll(address):
                return

    async def _watch(self, address: str) -> Literal["resync", "ended", "refused", "failed"]:
        state = self.pool.instances.get(address)
        if state is None or not state.serving:
            return "failed"
        epoch, after_seq = self.index.cursor(address)
        liveness = self.liveness
        request = disaggregation_pb2.KVEventsRequest(
            epoch=epoch, after_seq=after_seq, max_hashes=PAGE_HASHES, heartbeat_ms=liveness.heartbeat_ms
        )
        call = disaggregation_pb2_grpc.LoadStub(state.channel).WatchKVEvents(request)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(liveness.silence_s) as silence:
                async for events in call:
                    silence.reschedule(loop.time() + liveness.silence_s)
                    if address not in self.pool.instances:  # removed while subscribed
                        return "failed"
                    self._heard(address)
                    if not (events.stored or events.removed or events.resync):
                        self.traffic.num_heartbeats += 1
                        continue
                    self.traffic.received("stream", events)
                    if events.resync:
                        return "resync"
                    self._read_again(address)
                    self.index.apply(address, events, _max_blocks(state))
                    if self.index.cursor(address) == (0, 0):  # the index went out of step: a snapshot
                        return "resync"
        except TimeoutError:
            self.traffic.num_silent_streams += 1
            if address not in self._silent:
                self._silent.add(address)
                logger.warning(
                    "instance %s sent nothing on its KV-event stream for %.1f s, not even a heartbeat: ending it and "
                    "resyncing from the cursor (the host may be gone or cut off)",
                    address,
                    liveness.silence_s,
                )
            return "resync"
        except grpc.aio.AioRpcError as error:
            if error.code() in _NO_SUBSCRIPTION:
                if address not in self._unsubscribable:
                    self._unsubscribable.add(address)
                    logger.info(
                        "instance %s pushes no KV events to this gateway (%s: %s); polling it every %.1f s",
                        address,
                        error.code().name,
                        error.details(),
                        self.interval_s,
                    )
                return "refused"
            self._refused(address, error)
            return "failed"
        finally:
            call.cancel()
        self._unsubscribable.discard(address)
        return "ended"

    async def _poll(self, address: str) -> bool:
        """One read of the instance's events, a paged snapshot followed to its end; True once applied."""
        state = self.pool.instances.get(address)
        if state is None or not state.serving:
            return False
        max_blocks = _max_blocks(state)
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
                return False
            self.traffic.received("poll", events)
            if address not in self.pool.instances:  # removed while the call ran
                return False
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
            return False
        self._read_again(address)
        self.index.apply(address, events, max_blocks)
        return True

    def _heard(self, address: str) -> None:
        if address in self._silent:
            self._silent.discard(address)
            logger.info("instance %s speaks on its KV-event stream again", address)

    def _read_again(self, address: str) -> None:
        if self._refusals.pop(address, None) is not None:
            logger.info("KV events of instance %s are read again", address)

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


def _max_blocks(state: InstanceState) -> int:
    """The instance's block count, which bounds what the index keeps of it."""
    if state.report is not None and state.report.num_total_blocks:
        return state.report.num_total_blocks
    return DEFAULT_MAX_BLOCKS


async def run_kv_events(sync: KVEventsSync) -> None:
    """The sync loop as a task body that logs, rather than hides, an unexpected end."""
    try:
        await sync.run()
    except asyncio.CancelledError:
        raise
    except Exception:
        logger.exception("KV event following stopped: cache-aware routing now works from stale prefix data")
        raise


def _forget(inflight: dict[str, asyncio.Task[None]], address: str, _: asyncio.Task[None]) -> None:
    inflight.pop(address, None)
