"""Redis discovery against a real ``redis-server`` and instances that are real gRPC servers
on loopback (health and load only):

- the gateway believes only records signed with its cluster secret: a record written
  straight into Redis (unsigned, signed under another secret, moved to another key,
  stale, future-dated, non-finite, absurd) never reaches the pool, and each is counted
  by reason in ``splitserve_registry_records_refused_total``;
- without a secret, records are believed unsigned, and the log says so once;
- a registry outage longer than ``--stale-after`` leaves the instances routable on their own
  gRPC health and load reports, with ``/metrics`` and ``/status`` saying so; when Redis comes
  back (empty, as after a restart), the instances register again and the gateway follows it;
- a registry that hangs (SIGSTOP) never turns ``/ready`` false: the instances are polled on
  their own schedule while the scans time out.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import redis.asyncio as redis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cluster.auth import ClusterSecret
from cluster.internal_grpc import InternalPlane
from cluster.registration import RegistryHeartbeat, registry_key
from cluster.registry_record import encode_record
from gateway.app import create_app
from gateway.discovery import DiscoveryLoop, RedisDiscovery
from gateway.generation import GenerationService
from gateway.instances import InstancePool
from gateway.metrics import GatewayMetrics
from gateway.status import RecentLatencies, status_snapshot
from gateway.tokenizer import ModelTokenizer
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc
from tests.checkpoints import make_checkpoint
from tests.stores import start_redis, stop

SECRET = ClusterSecret.from_text("the-cluster-secret-of-these-tests")
FINGERPRINT = disaggregation_pb2.Fingerprint(model="m", dtype="float32", block_size=16, num_layers=2)


def report(role: str, instance_id: str) -> disaggregation_pb2.LoadReport:
    return disaggregation_pb2.LoadReport(
        instance_id=instance_id,
        role=role,
        num_total_blocks=8,
        num_free_blocks=8,
        max_model_len=2048,
        fingerprint=FINGERPRINT,
    )


@pytest.fixture
def redis_url() -> Iterator[str]:
    process, url = start_redis()
    try:
        yield url
    finally:
        stop(process)


async def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    """Poll a condition the code under test must bring about; bounded so that a bug fails rather than hangs."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.02)


def refused_count(metrics: GatewayMetrics, reason: str) -> float:
    return metrics.registry.get_sample_value("splitserve_registry_records_refused_total", {"reason": reason}) or 0.0


# ----------------------------------------------------------------- signed records


def test_the_gateway_believes_only_records_signed_with_its_secret(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    now = time.time()
    genuine_report = report("decode", "decode-0")
    other_key = ClusterSecret.from_text("someone-elses-cluster-secret").registry_key

    def record(address: str, unix_s: float = now, **report_changes: object) -> disaggregation_pb2.Registration:
        forged = report("prefill", "rogue")
        for name, value in report_changes.items():
            setattr(forged, name, value)
        return disaggregation_pb2.Registration(grpc_address=address, report=forged, unix_s=unix_s, serving=True)

    genuine_copy = encode_record(
        disaggregation_pb2.Registration(grpc_address="127.0.0.1:50071", report=genuine_report, unix_s=now),
        registry_key("decode-0"),
        SECRET.registry_key,
    )
    # What someone who can write Redis, but lacks the secret, can put there; and what a member's
    # bug (or a replay of an old record) would.
    forged = {
        "unsigned": [encode_record(record("10.6.6.6:50061"), registry_key("rogue"), None)],
        "bad_signature": [
            encode_record(record("10.6.6.7:50061"), registry_key("rogue-2"), other_key),
            genuine_copy,  # moved to another key below
        ],
        "stale": [encode_record(record("10.6.6.8:50061", now - 3600), registry_key("old"), SECRET.registry_key)],
        "future": [encode_record(record("10.6.6.9:50061", now + 3600), registry_key("ahead"), SECRET.registry_key)],
        "invalid": [
            encode_record(record("10.6.6.10:50061", math.inf), registry_key("frozen"), SECRET.registry_key),
            encode_record(record("10.6.6.11:50061", max_model_len=1), registry_key("tiny"), SECRET.registry_key),
        ],
    }
    keys = {
        "unsigned": ["rogue"],
        "bad_signature": ["rogue-2", "decode-1"],
        "stale": ["old"],
        "future": ["ahead"],
        "invalid": ["frozen", "tiny"],
    }

    async def scenario() -> None:
        writer = redis.from_url(redis_url)
        heartbeat = RegistryHeartbeat(
            redis_url, "decode-0", "127.0.0.1:50071", lambda: genuine_report, 1.0, key=SECRET.registry_key
        )
        pool = InstancePool(stale_after_s=30.0, plane=InternalPlane(secret=SECRET))
        discovery = RedisDiscovery(pool, redis_url, interval_s=0.05)
        metrics = GatewayMetrics(pool)
        try:
            await heartbeat.register()
            for reason, values in forged.items():
                for name, value in zip(keys[reason], values, strict=True):
                    await writer.set(registry_key(name), value)
            await discovery.first_poll()
            await discovery.poll_once()  # a second scan: counted again, logged once
            assert list(pool.instances) == ["127.0.0.1:50071"]
            assert [s.instance_id for s in pool.healthy("decode")] == ["decode-0"]
            for reason, names in keys.items():
                assert refused_count(metrics, reason) == 2 * len(names), reason
            assert status_snapshot(pool, RecentLatencies(), "m", True).registry.records_refused == 7
            for names in keys.values():
                for name in names:
                    assert caplog.text.count(f"ignoring the registry record under {registry_key(name)}:") == 1
        finally:
            await heartbeat.stop()
            await writer.aclose()
            await discovery.close()
            await pool.close()

    with caplog.at_level(logging.WARNING):
        asyncio.run(scenario())


def test_without_a_secret_records_are_believed_unsigned_and_the_log_says_so(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        heartbeat = RegistryHeartbeat(
            redis_url, "decode-0", "127.0.0.1:50071", lambda: report("decode", "decode-0"), 1.0, key=None
        )
        pool = InstancePool(stale_after_s=30.0)
        discovery = RedisDiscovery(pool, redis_url, interval_s=0.05)
        try:
            await heartbeat.register()
            await discovery.first_poll()
            await discovery.poll_once()
            assert list(pool.instances) == ["127.0.0.1:50071"]
        finally:
            await heartbeat.stop()
            await discovery.close()
            await pool.close()

    with caplog.at_level(logging.WARNING):
        asyncio.run(scenario())
    assert caplog.text.count("registering splitserve:instance:decode-0 unsigned (no cluster secret)") == 1
    assert caplog.text.count("no cluster secret: registry records are believed unsigned") == 1


# ----------------------------------------------------------------- registry outage


class FakeInstance(disaggregation_pb2_grpc.LoadServicer):
    """An instance's health and load over real gRPC, with the cluster secret; it notes when each
    load report was asked for."""

    def __init__(self, role: str, instance_id: str) -> None:
        self.report = report(role, instance_id)
        self.polled_at: list[float] = []  # monotonic

    async def GetLoadReport(self, request, context):  # noqa: N802
        self.polled_at.append(time.monotonic())
        return self.report


@asynccontextmanager
async def serving(fake: FakeInstance) -> AsyncIterator[str]:
    plane = InternalPlane(secret=SECRET)
    server = plane.server()
    disaggregation_pb2_grpc.add_LoadServicer_to_server(fake, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = plane.add_port(server, "127.0.0.1:0")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(grace=None)


def test_a_registry_outage_keeps_the_known_instances_on_their_own_reports() -> None:
    """Redis stops for longer than --stale-after: the gateway stays ready on the instances' gRPC
    health and load reports, and says so in /metrics and /status; Redis starts again, empty, the
    instances register again, and the gateway follows the registry once more."""
    stale_after_s = 0.5
    process, url = start_redis()
    port = int(url.rsplit(":", 1)[1])

    async def scenario() -> None:
        nonlocal process
        fakes = [FakeInstance("prefill", "prefill-0"), FakeInstance("decode", "decode-0")]
        async with serving(fakes[0]) as prefill_address, serving(fakes[1]) as decode_address:
            heartbeats = [
                RegistryHeartbeat(
                    url, fake.report.instance_id, address, lambda f=fake: f.report, 0.1, SECRET.registry_key
                )
                for fake, address in zip(fakes, (prefill_address, decode_address), strict=True)
            ]
            pool = InstancePool(stale_after_s=stale_after_s, plane=InternalPlane(secret=SECRET))
            discovery = RedisDiscovery(pool, url, interval_s=0.05)
            metrics = GatewayMetrics(pool)
            loop: DiscoveryLoop | None = None
            try:
                for heartbeat in heartbeats:
                    await heartbeat.register()
                    heartbeat.start()
                await discovery.first_poll()
                loop = DiscoveryLoop(discovery)
                assert pool.is_ready()
                assert fakes[0].polled_at == [], "while Redis answers, reports come from it"

                stop(process)
                await wait_until(lambda: not discovery.state.reachable, "the gateway noticing the outage")
                outage_began = time.monotonic()
                # Long past --stale-after, the instances are still routable on reports they sent since.
                await wait_until(
                    lambda: all(f.polled_at and f.polled_at[-1] > outage_began + 2 * stale_after_s for f in fakes),
                    "the instances being polled over gRPC past --stale-after into the outage",
                )
                assert pool.is_ready()
                assert {s.instance_id for s in pool.healthy("prefill") + pool.healthy("decode")} == {
                    "prefill-0",
                    "decode-0",
                }
                assert metrics.registry.get_sample_value("splitserve_registry_reachable") == 0.0
                assert metrics.registry.get_sample_value("splitserve_registry_unreachable_seconds") > 0
                status = status_snapshot(pool, metrics.recent, "m", pool.is_ready())
                assert status.registry is not None and not status.registry.reachable and status.ready
                # An instance that dies during the outage is no longer routed to.
                fakes[1].report.engine_error = "RuntimeError: the engine died"
                await wait_until(lambda: not pool.is_ready(), "the dead engine reported over gRPC")
                fakes[1].report.engine_error = ""
                await wait_until(pool.is_ready, "the engine back")

                process, _ = start_redis(port=port)  # empty: the instances register again
                await wait_until(lambda: discovery.state.reachable, "the gateway finding the registry again")
                assert metrics.registry.get_sample_value("splitserve_registry_reachable") == 1.0
                await wait_until(
                    lambda: (
                        all(
                            s.num_reports and s.reported_at > time.monotonic() - stale_after_s
                            for s in pool.instances.values()
                        )
                        and pool.is_ready()
                    ),
                    "the instances registered again",
                )
                assert set(pool.instances) == {prefill_address, decode_address}
                # An instance that leaves the registry leaves the pool once the grace after the outage is over.
                await heartbeats.pop(1).stop()
                await wait_until(lambda: decode_address not in pool.instances, "the deregistered instance removed")
                assert not pool.is_ready()
            finally:
                if loop is not None:
                    await loop.stop()
                for heartbeat in heartbeats:
                    await heartbeat.stop()
                await discovery.close()
                await pool.close()

    try:
        asyncio.run(scenario())
    finally:
        stop(process)


def test_a_frozen_registry_never_turns_ready_false(tmp_path: Path) -> None:
    """Redis stopped by SIGSTOP, not killed: its connections stay open and no answer comes, so
    every scan waits out its timeout. /ready stays true throughout, while each instance is
    polled over gRPC several times on its own schedule (the scan used to hold those polls back
    until it timed out at --stale-after, by when the reports had gone stale: /ready false for
    an interval in every cycle). Then Redis resumes and the gateway follows it again."""
    stale_after_s, interval_s, heartbeat_s = 2.0, 0.25, 0.25
    num_polls = 4  # gRPC polls of each instance while frozen: some discovery periods and a half
    process, url = start_redis()
    tokenizer = ModelTokenizer(make_checkpoint(tmp_path))

    async def scenario() -> None:
        fakes = [FakeInstance("prefill", "prefill-0"), FakeInstance("decode", "decode-0")]
        async with serving(fakes[0]) as prefill_address, serving(fakes[1]) as decode_address:
            heartbeats = [
                RegistryHeartbeat(
                    url, fake.report.instance_id, address, lambda f=fake: f.report, heartbeat_s, SECRET.registry_key
                )
                for fake, address in zip(fakes, (prefill_address, decode_address), strict=True)
            ]
            pool = InstancePool(stale_after_s=stale_after_s, plane=InternalPlane(secret=SECRET))
            discovery = RedisDiscovery(pool, url, interval_s=interval_s)
            loop: DiscoveryLoop | None = None
            service = GenerationService(pool, tokenizer, GatewayMetrics(pool), 4, 60.0, None, False)
            try:
                for heartbeat in heartbeats:
                    await heartbeat.register()
                    heartbeat.start()
                await discovery.first_poll()
                loop = DiscoveryLoop(discovery)
                app = create_app(service, "m", None, discovery_alive=lambda: loop is not None and loop.alive)
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:

                    async def assert_ready() -> None:
                        ready = await client.get("/ready")
                        assert ready.status_code == 200, (ready.text, [len(f.polled_at) for f in fakes])

                    await assert_ready()
                    assert all(not f.polled_at for f in fakes), "while Redis answers, reports come from it"
                    process.send_signal(signal.SIGSTOP)
                    # Until every instance has been polled num_polls times over gRPC and the scans
                    # have been seen to time out: /ready asked all the while.
                    async with asyncio.timeout(60):
                        while discovery.state.reachable or min(len(f.polled_at) for f in fakes) < num_polls:
                            await assert_ready()
                            await asyncio.sleep(0.02)  # the prober's pace
                    await assert_ready()
                    process.send_signal(signal.SIGCONT)
                    await wait_until(lambda: discovery.state.reachable, "the gateway finding the registry again")
                    await assert_ready()
            finally:
                process.send_signal(signal.SIGCONT)  # the heartbeats deregister before Redis stops
                if loop is not None:
                    await loop.stop()
                for heartbeat in heartbeats:
                    await heartbeat.stop()
                await discovery.close()
                await pool.close()

    try:
        asyncio.run(scenario())
    finally:
        process.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        stop(process)
        tokenizer.close()
