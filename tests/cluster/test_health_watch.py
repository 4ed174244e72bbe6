"""Health ``Watch`` streams are open to anyone, so they are bounded (cluster/health_watch.py,
issue 42, item 7): a real gRPC server on loopback serves at most ``max_watchers`` streams at
once and refuses one more, ends each after its lifetime, and every open stream still sees a
change of status after another stream has ended (grpcio-health-checking's own servicer then
forgot the others' waiters)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.health_watch import MAX_SERVICE_NAME_CHARS, BoundedHealthServicer

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
HANG_GUARD_S = 60.0  # the test's bound on a wait that should end: it fails a server that never answers


@asynccontextmanager
async def health_server(servicer: BoundedHealthServicer) -> AsyncIterator[health_pb2_grpc.HealthStub]:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.set("", SERVING)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield health_pb2_grpc.HealthStub(channel)
    finally:
        await server.stop(grace=None)


async def until(condition: object) -> None:
    async with asyncio.timeout(HANG_GUARD_S):
        while not condition():  # type: ignore[operator]
            await asyncio.sleep(0.01)


def test_watch_streams_are_capped_and_each_sees_every_change() -> None:
    async def scenario() -> None:
        servicer = BoundedHealthServicer(max_watchers=3, lifetime_s=3600.0)
        async with health_server(servicer) as stub:
            streams = [stub.Watch(health_pb2.HealthCheckRequest()) for _ in range(3)]
            async with asyncio.timeout(HANG_GUARD_S):
                assert [(await stream.read()).status for stream in streams] == [SERVING] * 3
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Watch(health_pb2.HealthCheckRequest()).read()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            long_name = health_pb2.HealthCheckRequest(service="x" * (MAX_SERVICE_NAME_CHARS + 1))
            with pytest.raises(grpc.aio.AioRpcError) as invalid:
                await stub.Watch(long_name).read()
            assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (await stub.Check(health_pb2.HealthCheckRequest())).status == SERVING  # Check is not capped

            streams[0].cancel()
            await until(lambda: servicer.num_watchers == 2)
            await servicer.set("", NOT_SERVING)
            async with asyncio.timeout(HANG_GUARD_S):
                assert [(await stream.read()).status for stream in streams[1:]] == [NOT_SERVING] * 2
            for stream in streams[1:]:
                stream.cancel()
            await until(lambda: servicer.num_watchers == 0)

    asyncio.run(scenario())


def test_a_watch_stream_ends_after_its_lifetime_and_frees_its_place() -> None:
    async def scenario() -> None:
        servicer = BoundedHealthServicer(max_watchers=1, lifetime_s=0.5)
        async with health_server(servicer) as stub:
            for _ in range(2):  # the second is served once the first has ended
                stream = stub.Watch(health_pb2.HealthCheckRequest())
                async with asyncio.timeout(HANG_GUARD_S):
                    statuses = [response.status async for response in stream]
                assert statuses == [SERVING] and await stream.code() == grpc.StatusCode.OK
            assert servicer.num_watchers == 0

    asyncio.run(scenario())


async def rest(stream: grpc.aio.UnaryStreamCall) -> list[int]:
    """The statuses a stream sends until it ends."""
    statuses = []
    while (response := await stream.read()) is not grpc.aio.EOF:
        statuses.append(response.status)
    return statuses


def test_a_graceful_shutdown_tells_every_watcher_not_serving_and_ends_its_stream() -> None:
    """The server's drain waits for every open call: a watcher's stream must end by itself."""

    async def scenario() -> None:
        servicer = BoundedHealthServicer(max_watchers=4, lifetime_s=3600.0)
        async with health_server(servicer) as stub:
            watched = stub.Watch(health_pb2.HealthCheckRequest())
            unknown = stub.Watch(health_pb2.HealthCheckRequest(service="not-served"))
            async with asyncio.timeout(HANG_GUARD_S):
                assert (await watched.read()).status == SERVING
                assert (await unknown.read()).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            await servicer.enter_graceful_shutdown()
            late = stub.Watch(health_pb2.HealthCheckRequest())  # one that starts while the server drains
            async with asyncio.timeout(HANG_GUARD_S):
                assert [await rest(stream) for stream in (watched, unknown, late)] == [[NOT_SERVING], [], [NOT_SERVING]]
            assert [await stream.code() for stream in (watched, unknown, late)] == [grpc.StatusCode.OK] * 3
            await until(lambda: servicer.num_watchers == 0)

    asyncio.run(scenario())
