"""Instances served in the test's event loop with a real engine (a tiny model) and a real gRPC
server: one whose engine thread has died turns NOT_SERVING, its load report says why, and a
gateway's pool stops routing to it; a served instance's start-up heap is frozen."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.engine_core import EngineCore
from gateway.discovery import StaticDiscovery
from gateway.instances import InstancePool
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc, generation_pb2, generation_pb2_grpc
from tests.checkpoints import make_checkpoint
from tests.serving.inprocess import colocated_instance, serving


def test_an_instance_whose_engine_died_answers_not_serving_and_gets_no_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args, instance = colocated_instance(make_checkpoint(tmp_path))

    def broken_step(self: EngineCore) -> None:  # as a kernel that raises would
        raise RuntimeError("injected failure in the step")

    async def scenario() -> None:
        async with serving(instance, args) as address:
            monkeypatch.setattr(EngineCore, "step", broken_step)  # after the warm-up prefill, which would die of it
            pool = InstancePool(stale_after_s=30.0)
            discovery = StaticDiscovery(pool, {"colocated": [address]}, interval_s=0.2)
            channel = grpc.aio.insecure_channel(address)
            try:
                await discovery.poll_once()
                assert pool.is_ready(), "healthy until the engine dies"
                request = generation_pb2.GenerateRequest(
                    request_id="r",
                    token_ids=generation_pb2.TokenIds(ids=[5, 6, 7]),
                    sampling=generation_pb2.SamplingParams(max_tokens=4),
                )
                with pytest.raises(grpc.aio.AioRpcError):
                    async for _ in generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30):
                        pass
                health = health_pb2_grpc.HealthStub(channel)
                for _ in range(50):
                    status = (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status
                    if status != health_pb2.HealthCheckResponse.SERVING:
                        break
                    await asyncio.sleep(0.1)
                assert status == health_pb2.HealthCheckResponse.NOT_SERVING
                report = await disaggregation_pb2_grpc.LoadStub(channel).GetLoadReport(
                    disaggregation_pb2.LoadReportRequest(), timeout=5
                )
                assert report.engine_error == "RuntimeError: injected failure in the step"
                await discovery.poll_once()
                assert not pool.healthy("colocated") and not pool.is_ready()
                # A report saying so is enough, whatever the health check answered.
                pool.record_report(address, report, serving=True)
                assert not pool.healthy("colocated")
            finally:
                await channel.close()
                await pool.close()

    asyncio.run(scenario())


def test_a_served_instance_exempts_its_start_up_heap_from_collections(tmp_path: Path) -> None:
    """Full collections would walk the model's, tokenizer's and gRPC's long-lived objects on every
    pass (a token gap of 120-250 ms on a loaded decode instance): serving freezes them once the
    server is up, and what comes after is collected as before."""
    args, instance = colocated_instance(make_checkpoint(tmp_path))
    gc.unfreeze()

    async def scenario() -> int:
        async with serving(instance, args, freeze_heap=True):
            return gc.get_freeze_count()

    try:
        assert gc.get_freeze_count() == 0
        frozen = asyncio.run(scenario())
        assert frozen > 10_000  # this interpreter's modules alone are more
        assert not any(o is instance for o in gc.get_objects())  # built at start-up: out of the collector's reach
    finally:
        gc.unfreeze()  # the test process outlives the instance (tests/serving/inprocess.py)


def test_a_stopping_instance_ends_the_streams_gateways_hold_open_before_it_drains(tmp_path: Path) -> None:
    """A gateway holds a health Watch and a KV-event subscription open on every instance for as
    long as it likes. The drain waits for every open call, up to its grace (30 s), which a
    container's stop timeout (10 s) cuts short with SIGKILL: the instance ends both itself, so
    that they end OK; one still open at the end of the grace would end CANCELLED."""
    args, instance = colocated_instance(make_checkpoint(tmp_path))

    async def scenario() -> None:
        async with contextlib.AsyncExitStack() as outlives_the_instance:
            async with serving(instance, args) as address:
                channel = await outlives_the_instance.enter_async_context(grpc.aio.insecure_channel(address))
                load = disaggregation_pb2_grpc.LoadStub(channel)
                watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
                snapshot = await load.GetKVEvents(disaggregation_pb2.KVEventsRequest(), timeout=30)
                cursor = disaggregation_pb2.KVEventsRequest(
                    epoch=snapshot.epoch, after_seq=snapshot.last_seq, heartbeat_ms=50
                )
                subscription = load.WatchKVEvents(cursor)
                async with asyncio.timeout(60):
                    assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
                    assert not (await subscription.read()).resync  # subscribed: a heartbeat, or changes
            # Stopped and drained (the block's end): the streams were never cancelled from this side.
            async with asyncio.timeout(60):
                assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
                assert await watch.code() == grpc.StatusCode.OK
                assert await subscription.code() == grpc.StatusCode.OK

    asyncio.run(scenario())
