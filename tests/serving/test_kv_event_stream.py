"""Prefix-cache events pushed to gateways (serving/kv_event_stream.py, gateway/kv_events.py):
one batch per engine step, bounded per subscriber, a resync marker for one that lags, the
paged poll as the resync path, a subscription that comes back with its instance, heartbeats
on a quiet stream and a silent one ended and resynced (a host gone without closing its
connection, behind a proxy that stalls both ways), and the messages counted where they land
(gateway/kv_event_traffic.py, on the gateway's /metrics).

The streams alone, then a real gRPC server (the instance's own ``LoadServicer`` over an event
log filled here; ``KVEventLog.end_step`` is what the engine's step thread calls after each
step) followed by the gateway's ``KVEventsSync``, the calls counted where they land
(cluster/call_counts.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.call_counts import CallCounts
from engine.kv_cache_utils import BlockHash
from engine.kv_events import KVEventLog
from gateway.instances import InstancePool
from gateway.kv_event_liveness import KVEventLiveness
from gateway.kv_event_traffic import KVEventTraffic
from gateway.kv_events import KVEventsSync
from gateway.metrics import GatewayMetrics
from serving.instance import LoadServicer
from serving.kv_event_stream import MIN_HEARTBEAT_S, KVEventStreamLimits, KVEventStreams
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc
from tests.serving.test_kv_event_pages import fake_instance, indexed, polled_pool
from tests.stalling_proxy import StallingProxy

WATCH = "/splitserve.v1.Load/WatchKVEvents"
POLL = "/splitserve.v1.Load/GetKVEvents"


def new_hashes(rng: random.Random, num: int) -> list[BlockHash]:
    return [BlockHash(rng.getrandbits(128)) for _ in range(num)]


def step(log: KVEventLog, stored: list[BlockHash], removed: list[BlockHash] = ()) -> None:  # type: ignore[assignment]
    """What one engine step does to the log: its blocks registered and evicted, then end_step."""
    for block_hash in stored:
        log.stored(block_hash)
    for block_hash in removed:
        log.removed(block_hash)
    log.end_step()


def cached(log: KVEventLog) -> set[BlockHash]:
    return set(log.snapshot().stored)


def as_message(batch) -> disaggregation_pb2.KVEvents:  # type: ignore[no-untyped-def]
    return disaggregation_pb2.KVEvents(
        epoch=batch.epoch, last_seq=batch.last_seq, stored=[h.to_bytes(16, "little") for h in batch.stored]
    )


async def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    """Poll a condition the code under test must bring about; bounded so that a bug fails rather than hangs."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.02)


# ------------------------------------------------------------------------------ the streams


def test_each_step_is_one_batch_and_a_subscriber_that_never_reads_holds_one_marker() -> None:
    rng = random.Random(0)
    log = KVEventLog(max_events=4096)
    step(log, new_hashes(rng, 3))  # before anyone subscribed

    async def scenario() -> None:
        streams = KVEventStreams(log, as_message, KVEventStreamLimits(page_hashes=8, max_queued_hashes=16))
        reader = streams.subscribe(log.epoch, log.last_seq)
        idle = streams.subscribe(log.epoch, log.last_seq)
        assert reader is not None and idle is not None and len(reader) == len(idle) == 0
        steps = [new_hashes(rng, 5) for _ in range(3)]
        for blocks in steps:
            step(log, blocks)
            await asyncio.sleep(0)  # the loop runs the publish the step posted
            batch = await reader.get()
            assert [BlockHash(int.from_bytes(h, "little")) for h in batch.stored] == blocks
        assert streams.num_published == len(steps)
        # 15 hashes queued for the idle one: the fourth step's 5 would pass its 16.
        assert (len(idle), idle.num_queued_hashes, idle.lagged) == (3, 15, False)
        step(log, new_hashes(rng, 5))
        await asyncio.sleep(0)
        assert (len(idle), idle.num_queued_hashes, idle.lagged) == (1, 0, True)
        await reader.get()
        for _ in range(20):
            step(log, new_hashes(rng, 5))
            await asyncio.sleep(0)
            assert len((await reader.get()).stored) == 5  # the reader keeps up, and gets every step
        assert (len(idle), idle.num_queued_hashes) == (1, 0)  # whatever happens meanwhile
        marker = await idle.get()
        assert marker.resync and not marker.stored
        assert not reader.lagged and streams.num_published == len(steps) + 21

    asyncio.run(scenario())


def test_a_cursor_the_log_cannot_follow_gets_a_resync_marker_and_subscribers_are_capped() -> None:
    log = KVEventLog(max_events=4)
    step(log, new_hashes(random.Random(1), 6))  # events 1 and 2 are gone from the log

    async def scenario() -> None:
        streams = KVEventStreams(log, as_message, KVEventStreamLimits(page_hashes=8, max_subscribers=2))
        for epoch, after_seq in ((log.epoch, 1), (log.epoch + 1, 6)):  # a gap; another epoch (a restart)
            subscriber = streams.subscribe(epoch, after_seq)
            assert subscriber is not None and (await subscriber.get()).resync
        assert streams.subscribe(log.epoch, 6) is None  # the cap
        streams.unsubscribe(next(iter(streams.subscribers)))
        follower = streams.subscribe(log.epoch, 3)  # events 4-6 still held: they come first
        assert follower is not None
        first = await follower.get()
        assert (first.resync, first.last_seq, len(first.stored)) == (False, 6, 3)

    asyncio.run(scenario())


def test_a_silence_shorter_than_two_heartbeats_is_refused_naming_the_flags() -> None:
    with pytest.raises(ValueError, match="--kv-event-silence .* at least twice --kv-event-heartbeat"):
        KVEventLiveness(heartbeat_s=5.0, silence_s=9.0)
    assert KVEventLiveness(heartbeat_s=0.25, silence_s=0.5).heartbeat_ms == 250


def test_an_idle_subscriber_gets_heartbeats_at_the_interval_it_asked_for_and_batches_as_they_come() -> None:
    log = KVEventLog(max_events=4096)

    async def scenario() -> None:
        streams = KVEventStreams(log, as_message, KVEventStreamLimits(heartbeat_s=0.5))
        own = streams.subscribe(log.epoch, log.last_seq)
        too_often = streams.subscribe(log.epoch, log.last_seq, heartbeat_ms=1)
        asked = streams.subscribe(log.epoch, log.last_seq, heartbeat_ms=60)
        assert own is not None and too_often is not None and asked is not None
        assert (own.heartbeat_s, too_often.heartbeat_s, asked.heartbeat_s) == (0.5, MIN_HEARTBEAT_S, 0.06)
        async with asyncio.timeout(30):  # bounded, so that a missing heartbeat fails rather than hangs
            for _ in range(2):  # nothing queued: an empty message each interval
                assert (await asked.get()) == disaggregation_pb2.KVEvents()
        assert asked.num_heartbeats == 2
        step(log, new_hashes(random.Random(6), 2))
        await asyncio.sleep(0)  # the loop runs the publish the step posted
        assert len((await asked.get()).stored) == 2 and asked.num_heartbeats == 2

    asyncio.run(scenario())


# ---------------------------------------------------------------- through gRPC, to the index


@contextlib.asynccontextmanager
async def serving(
    log: KVEventLog, limits: KVEventStreamLimits | None = None, port: int = 0
) -> AsyncIterator[tuple[grpc.aio.Server, LoadServicer, CallCounts, str]]:
    """An instance's ``LoadServicer`` over ``log`` on a real server, stopped when the block ends."""
    counts = CallCounts()
    server = grpc.aio.server(interceptors=[counts])
    servicer = LoadServicer(fake_instance(log), limits)  # type: ignore[arg-type]
    disaggregation_pb2_grpc.add_LoadServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        yield server, servicer, counts, f"127.0.0.1:{port}"
    finally:
        await server.stop(grace=None)


@contextlib.asynccontextmanager
async def followed(address: str, **options: Any) -> AsyncIterator[InstancePool]:
    """The gateway's ``KVEventsSync`` (``options``: its liveness, its traffic counters) following
    the instance at ``address`` into a pool's index, until the block ends."""
    pool = polled_pool(address, num_total_blocks=1024)
    task = asyncio.create_task(KVEventsSync(pool, pool.index, interval_s=0.05, **options).run())
    try:
        yield pool
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await pool.close()


def calls(counts: CallCounts) -> tuple[int, int]:
    """(subscriptions, polls) the instance received."""
    snapshot = counts.snapshot()
    return snapshot.get(WATCH, 0), snapshot.get(POLL, 0)


def exported(metrics: GatewayMetrics) -> dict[tuple[str, str], float]:
    """The gateway's KV-event traffic as its /metrics renders it: (sample, via) -> value."""
    return {
        (s.name, s.labels.get("via", "")): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        if family.name.startswith("splitserve_kv_event_")
        for s in family.samples
        if s.name.endswith("_total")
    }


def test_the_index_follows_pushed_events_without_a_poll_and_a_lagging_gateway_resyncs() -> None:
    rng = random.Random(2)
    log = KVEventLog(max_events=4096)
    step(log, new_hashes(rng, 10))

    async def scenario() -> None:
        limits = KVEventStreamLimits(page_hashes=8, max_queued_hashes=8)
        traffic = KVEventTraffic()
        async with serving(log, limits) as (_, servicer, counts, address), followed(address, traffic=traffic) as pool:
            metrics = GatewayMetrics(pool, traffic)
            # First contact: the stream says resync (a snapshot is needed), the poll reads it, and the
            # gateway subscribes again from the snapshot's cursor.
            await wait_until(lambda: calls(counts) == (2, 1), "a resync, a poll and a second subscription")
            await wait_until(lambda: indexed(pool, address) == cached(log), "the snapshot indexed")
            streams = servicer.kv_event_streams
            assert streams is not None
            await wait_until(lambda: len(streams.subscribers) == 1, "the second subscription registered")
            # First contact: one message each way, the marker pushed and the snapshot polled.
            assert (traffic.num_messages["stream"], traffic.num_messages["poll"]) == (1, 1)
            pushed_bytes = traffic.num_bytes["stream"]
            for _ in range(5):
                gone = list(cached(log))[:2]
                after_seq = log.last_seq
                step(log, new_hashes(rng, 3), gone)  # 5 changes a step: within a page
                pushed_bytes += servicer._batch_message(log.read(log.epoch, after_seq)).ByteSize()
                await wait_until(lambda: indexed(pool, address) == cached(log), "the step's changes indexed")
            assert streams.num_published == 5
            assert calls(counts) == (2, 1)  # pushed: not one call more
            # Counted where they land: a message per pushed batch, its bytes as the instance built it.
            assert (traffic.num_messages["stream"], traffic.num_messages["poll"]) == (6, 1)
            assert traffic.num_bytes["stream"] == pushed_bytes
            assert exported(metrics) == {
                ("splitserve_kv_event_messages_total", "stream"): 6,
                ("splitserve_kv_event_messages_total", "poll"): 1,
                ("splitserve_kv_event_message_bytes_total", "stream"): pushed_bytes,
                ("splitserve_kv_event_message_bytes_total", "poll"): traffic.num_bytes["poll"],
                ("splitserve_kv_event_heartbeats_total", ""): traffic.num_heartbeats,
                ("splitserve_kv_event_silent_streams_total", ""): 0,
            }
            assert pool.index.cursor(address) == (log.epoch, log.last_seq)

            # The gateway lags: three steps' batches reach its queue before its stream writes one
            # (the loop runs three publishes in a row); 9 hashes pass the queue's 8.
            for _ in range(3):
                step(log, new_hashes(rng, 3))
                streams.publish()
            await wait_until(lambda: calls(counts) == (3, 2), "a resync: one poll and a new subscription")
            await wait_until(lambda: indexed(pool, address) == cached(log), "the index correct after the resync")
            step(log, new_hashes(rng, 2))  # and the new subscription follows
            await wait_until(lambda: indexed(pool, address) == cached(log), "pushed again")
            assert calls(counts) == (3, 2)

    asyncio.run(scenario())


def test_a_dead_instances_subscription_ends_and_comes_back_with_it() -> None:
    rng = random.Random(3)
    log = KVEventLog(max_events=4096)
    step(log, new_hashes(rng, 4))

    async def scenario() -> None:
        async with serving(log) as (server, servicer, _, address), followed(address) as pool:
            await wait_until(lambda: indexed(pool, address) == cached(log), "the first instance indexed")
            streams = servicer.kv_event_streams
            assert streams is not None
            await wait_until(lambda: len(streams.subscribers) == 1, "subscribed")
            await server.stop(grace=None)
            await wait_until(lambda: not streams.subscribers, "its stream ended with the server")
            # The instance comes back on its address, restarted: a new epoch, another cache.
            new_log = KVEventLog(max_events=4096)
            step(new_log, new_hashes(rng, 6))
            async with serving(new_log, port=int(address.rsplit(":", 1)[1])) as (_, new_servicer, new_counts, _):
                await wait_until(lambda: indexed(pool, address) == cached(new_log), "the restarted instance indexed")
                assert pool.index.cursor(address)[0] == new_log.epoch
                new_streams = new_servicer.kv_event_streams
                assert new_streams is not None
                await wait_until(lambda: len(new_streams.subscribers) == 1, "subscribed to the restarted instance")
                step(new_log, new_hashes(rng, 2))
                await wait_until(lambda: indexed(pool, address) == cached(new_log), "its steps pushed")
                assert calls(new_counts)[1] == 1  # one poll: the snapshot of its new epoch

    asyncio.run(scenario())


def test_an_instance_past_its_subscription_cap_is_polled(caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(4)
    log = KVEventLog(max_events=4096)

    async def scenario() -> None:
        caplog.set_level(logging.INFO, logger="gateway.kv_events")
        limits = KVEventStreamLimits(max_subscribers=0)
        async with serving(log, limits) as (_, _, counts, address), followed(address) as pool:
            step(log, new_hashes(rng, 3))
            await wait_until(lambda: indexed(pool, address) == cached(log), "polled")
            step(log, new_hashes(rng, 3))
            await wait_until(lambda: indexed(pool, address) == cached(log), "polled again")
            assert calls(counts)[1] >= 2
            assert sum("pushes no KV events" in r.getMessage() for r in caplog.records) == 1

    asyncio.run(scenario())


def test_a_stream_at_its_lifetime_ends_and_the_gateway_subscribes_again_without_a_poll() -> None:
    rng = random.Random(5)
    log = KVEventLog(max_events=4096)

    async def scenario() -> None:
        limits = KVEventStreamLimits(lifetime_s=0.05)
        async with serving(log, limits) as (_, servicer, counts, address), followed(address) as pool:
            await wait_until(lambda: calls(counts)[0] >= 5, "streams ended at their lifetime, and subscribed again")
            assert calls(counts)[1] == 1  # the first contact's only: each new stream starts from the cursor
            step(log, new_hashes(rng, 4))
            await wait_until(lambda: indexed(pool, address) == cached(log), "followed across the streams")
            streams = servicer.kv_event_streams
            assert streams is not None and len(streams.subscribers) <= 1

    asyncio.run(scenario())


def test_a_stream_gone_silent_is_ended_and_resynced_once_its_host_speaks_again() -> None:
    """The instance behind a proxy that stalls both ways: its host gone without a FIN or RST.
    The gateway hears heartbeats while the cache is quiet, ends the stream once nothing comes,
    and its resync (held meanwhile: a poll's deadline is --stale-after) reads what changed."""
    rng = random.Random(7)
    log = KVEventLog(max_events=4096)
    step(log, new_hashes(rng, 4))
    # The instance's own interval as well as the asked one: the same whichever it heeds.
    liveness = KVEventLiveness(heartbeat_s=0.2, silence_s=1.0)

    async def scenario() -> None:
        limits = KVEventStreamLimits(heartbeat_s=liveness.heartbeat_s)
        traffic = KVEventTraffic()
        async with serving(log, limits) as (_, servicer, counts, target):
            proxy = StallingProxy("127.0.0.1", int(target.rsplit(":", 1)[1]))
            address = f"127.0.0.1:{proxy.port}"
            try:
                # The pool's deadlines outlast the stall.
                async with followed(address, liveness=liveness, traffic=traffic) as pool:
                    await wait_until(lambda: indexed(pool, address) == cached(log), "the first snapshot indexed")
                    streams = servicer.kv_event_streams
                    assert streams is not None
                    await wait_until(lambda: len(streams.subscribers) == 1, "subscribed")
                    await wait_until(
                        lambda: traffic.num_heartbeats >= 2, "heartbeats on the quiet stream", timeout_s=30
                    )
                    num_silent = traffic.num_silent_streams  # zero unless this test's loop itself stalled a second
                    num_polls = calls(counts)[1]

                    proxy.stall(both_ways=True)
                    for _ in range(2):
                        step(log, new_hashes(rng, 3), list(cached(log))[:1])  # pushed into the void
                    await wait_until(
                        lambda: traffic.num_silent_streams > num_silent, "the silent stream noticed", timeout_s=30
                    )
                    assert calls(counts)[1] == num_polls, "the resync's poll is held with the rest"

                    proxy.resume()
                    await wait_until(lambda: calls(counts)[1] > num_polls, "the resync's poll answered")
                    await wait_until(lambda: indexed(pool, address) == cached(log), "the index correct again")
                    await wait_until(lambda: len(streams.subscribers) == 1, "subscribed again, the silent stream gone")
                    step(log, new_hashes(rng, 2))
                    await wait_until(lambda: indexed(pool, address) == cached(log), "pushed again")
            finally:
                proxy.close()

    asyncio.run(scenario())


def test_a_stopping_instance_ends_every_subscription_at_once_and_takes_no_new_one() -> None:
    """The server's drain waits for every open call: the instance ends its subscriptions itself."""
    rng = random.Random(6)
    log = KVEventLog(max_events=4096)
    step(log, new_hashes(rng, 4))

    async def scenario() -> None:
        async with (
            serving(log, KVEventStreamLimits(heartbeat_s=3600.0)) as (_, servicer, _, address),
            grpc.aio.insecure_channel(address) as channel,
        ):
            stub = disaggregation_pb2_grpc.LoadStub(channel)
            cursor = disaggregation_pb2.KVEventsRequest(epoch=log.epoch, after_seq=log.last_seq)
            subscription = stub.WatchKVEvents(cursor)
            await wait_until(
                lambda: servicer.kv_event_streams is not None and len(servicer.kv_event_streams.subscribers) == 1,
                "subscribed",
            )
            streams = servicer.kv_event_streams
            step(log, new_hashes(rng, 2))
            async with asyncio.timeout(60):
                assert len((await subscription.read()).stored) == 2
                step(log, new_hashes(rng, 2))  # a batch the stream never sends: it ends first
                servicer.end_streams()
                assert await subscription.read() is grpc.aio.EOF  # no heartbeat for an hour, yet it ends
            assert await subscription.code() == grpc.StatusCode.OK
            assert not streams.subscribers
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.WatchKVEvents(cursor).read()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(scenario())
