"""Many calls over one stream (serving/call_mux.py on the instance, gateway/call_mux.py on the
gateway), over a real gRPC server and channel of the internal plane, with its cluster secret:
a scripted ``Generate`` servicer stands in for an engine, so each of the stream's rules is one
scenario. The real servicers over the stream (Decode, Generate, their block accounting, their
failover) run in the process tests, where the gateway streams this way by default.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import grpc
import pytest

from cluster.auth import ClusterSecret
from cluster.internal_grpc import InternalPlane
from gateway.call_mux import CallMux, MuxCall
from gateway.dispatch import Dispatcher
from gateway.dispatch_request import DispatchRequest
from gateway.instances import InstancePool, InstanceState
from serving.call_mux import CallMultiplexer, MultiplexedMethod
from splitserve.v1 import disaggregation_pb2, generation_pb2, multiplex_pb2, multiplex_pb2_grpc

SECRET = ClusterSecret.from_text("test-call-mux-secret-0123456789abcdef")
GENERATE = "/splitserve.v1.Generation/Generate"


class ScriptedGenerate:
    """``Generate`` by prompt: ``[n]`` streams n tokens once ``step`` is set (all calls waiting
    on it run in the same loop iteration, as one engine step's outputs reach theirs); ``[-1]``
    aborts with INVALID_ARGUMENT; ``[-2]`` raises; ``[-3]`` streams one token and never ends;
    ``[-4]`` streams one token, then, once ``step`` is set, three responses of a token each and
    the finish, which leave together.
    ``closed``: the request ids whose servicer code has ended, as a real servicer's cleanup
    (aborting the request, freeing its blocks) would run."""

    def __init__(self) -> None:
        self.step = asyncio.Event()
        self.closed: list[str] = []
        self.closed_changed = asyncio.Event()
        self.started: list[str] = []
        self.started_changed = asyncio.Event()
        self.metadata: dict[str, dict[str, str]] = {}

    async def Generate(self, request: generation_pb2.GenerateRequest, context: Any) -> AsyncIterator[Any]:  # noqa: N802 - gRPC signature
        self.started.append(request.request_id)
        self.started_changed.set()
        self.metadata[request.request_id] = dict(context.invocation_metadata())
        try:
            (count,) = request.token_ids.ids
            if count == -1:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a prompt this instance refuses")
            if count == -2:
                raise RuntimeError("a servicer's bug")
            if count == -3:
                yield generation_pb2.GenerateResponse(request_id=request.request_id, token_ids=[0])
                await asyncio.Event().wait()
            if count == -4:  # a first token, then three more and the finish in one step
                yield generation_pb2.GenerateResponse(request_id=request.request_id, token_ids=[0])
                await self.step.wait()
                for i in (1, 2, 3):
                    yield generation_pb2.GenerateResponse(request_id=request.request_id, token_ids=[i])
                yield generation_pb2.GenerateResponse(request_id=request.request_id, finish_reason="length")
                return
            await self.step.wait()
            for i in range(count):
                yield generation_pb2.GenerateResponse(request_id=request.request_id, token_ids=[i])
        finally:
            self.closed.append(request.request_id)
            self.closed_changed.set()

    async def wait_started(self, count: int) -> None:
        while len(self.started) < count:
            self.started_changed.clear()
            await self.started_changed.wait()

    async def wait_closed(self, request_id: str) -> None:
        while request_id not in self.closed:
            self.closed_changed.clear()
            await self.closed_changed.wait()


class Instance:
    """A real server with the multiplexer over :class:`ScriptedGenerate`, and a gateway's
    :class:`CallMux` to it; both on the test's loop."""

    def __init__(self, plane: InternalPlane) -> None:
        self.plane = plane
        self.servicer = ScriptedGenerate()
        self.multiplexer = CallMultiplexer(
            {"generate": MultiplexedMethod(GENERATE, self.servicer.Generate)}, plane.call_counts
        )
        self.server = plane.server()
        multiplex_pb2_grpc.add_MultiplexServicer_to_server(self.multiplexer, self.server)
        self.port = plane.add_port(self.server, "127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"
        self.channel = plane.channel(self.address)
        self.mux = CallMux(self.channel, self.address)
        self.messages: list[int] = []  # events per MuxEvents message the gateway received

    def call(self, request_id: str, count: int, timeout_s: float | None = None) -> MuxCall:
        request = generation_pb2.GenerateRequest(request_id=request_id, token_ids=generation_pb2.TokenIds(ids=[count]))
        return self.mux.call("generate", request, timeout_s, (("traceparent", f"trace-of-{request_id}"),))

    async def stop(self) -> None:
        await self.mux.close()
        await self.channel.close()
        await self.server.stop(grace=None)


def with_instance(test: Callable[[Instance], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """The test, run in a loop of its own with a started :class:`Instance` (pytest sees no
    argument: the wrapper does not carry the test's signature)."""

    def run() -> None:
        async def main() -> None:
            instance = Instance(InternalPlane(secret=SECRET))
            await instance.server.start()
            try:
                await test(instance)
            finally:
                await instance.stop()

        asyncio.run(main())

    run.__name__ = run.__qualname__ = test.__name__
    run.__doc__ = test.__doc__
    return run


async def tokens(call: MuxCall) -> list[int]:
    return [token async for response in call for token in response.token_ids]


@with_instance
async def test_the_calls_one_step_advanced_leave_in_one_message(instance: Instance) -> None:
    calls = [instance.call(f"r{i}", 3) for i in range(32)]
    await instance.servicer.wait_started(32)
    received = instance.mux.num_messages_received
    instance.servicer.step.set()
    results = await asyncio.gather(*(tokens(call) for call in calls))
    assert results == [[0, 1, 2]] * 32
    # Three responses and an end per call, 128 events, in a handful of messages: one per step
    # of each call's generator, not one per call.
    assert instance.mux.num_messages_received - received <= 4
    assert instance.plane.call_counts.snapshot()[GENERATE] == 32  # each call counted as one
    assert instance.servicer.metadata["r7"]["traceparent"] == "trace-of-r7"


@with_instance
async def test_a_call_ends_with_its_servicers_status_and_the_others_go_on(instance: Instance) -> None:
    refused, crashed, fine = instance.call("refused", -1), instance.call("crashed", -2), instance.call("fine", 2)
    with pytest.raises(grpc.aio.AioRpcError) as refusal:
        await tokens(refused)
    assert refusal.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refusal.value.details() == "a prompt this instance refuses"
    with pytest.raises(grpc.aio.AioRpcError) as crash:
        await tokens(crashed)
    assert crash.value.code() == grpc.StatusCode.INTERNAL
    assert "a servicer's bug" in (crash.value.details() or "")
    instance.servicer.step.set()
    assert await tokens(fine) == [0, 1]
    assert fine.done()


@with_instance
async def test_a_cancelled_call_runs_the_servicers_cleanup_and_no_other_call_is_touched(instance: Instance) -> None:
    hanging, other = instance.call("hanging", -3), instance.call("other", -3)
    assert list((await anext(hanging)).token_ids) == [0]
    await anext(other)
    assert hanging.cancel()
    await instance.servicer.wait_closed("hanging")
    assert "other" not in instance.servicer.closed and not other.done()
    with pytest.raises(grpc.aio.AioRpcError) as cancelled:
        await anext(hanging)
    assert cancelled.value.code() == grpc.StatusCode.CANCELLED
    other.cancel()
    await instance.servicer.wait_closed("other")


@with_instance
async def test_a_call_past_its_deadline_ends_deadline_exceeded_and_the_instance_lets_it_go(instance: Instance) -> None:
    late = instance.call("late", 5, timeout_s=0.05)  # the servicer waits for a step that never comes
    with pytest.raises(grpc.aio.AioRpcError) as expired:
        await tokens(late)
    assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await instance.servicer.wait_closed("late")


@with_instance
async def test_a_stopping_instance_finishes_its_calls_refuses_new_ones_and_ends_the_stream(instance: Instance) -> None:
    running = instance.call("running", 2)
    await instance.servicer.wait_started(1)
    instance.multiplexer.close()
    refused = instance.call("too-late", 2)
    with pytest.raises(grpc.aio.AioRpcError) as stopping:
        await tokens(refused)
    assert stopping.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "too-late" not in instance.servicer.started
    instance.servicer.step.set()
    assert await tokens(running) == [0, 1]
    # The stream ended once its last call had: a graceful stop has nothing left to wait for.
    await asyncio.wait_for(instance.server.stop(grace=300), timeout=60)


def test_a_stopping_instances_last_call_ends_with_its_status_when_its_outbox_was_full(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call's last response fills the outbox: its end waits for room, and the writer, which
    makes the room, must not see the stream as done (no call left, the instance stopping)
    before that end is queued, or the caller gets a stream that ends mid-call."""
    monkeypatch.setattr("serving.call_mux.OUTBOX_CAPACITY", 1)

    @with_instance
    async def scenario(instance: Instance) -> None:
        running = instance.call("running", 3)
        await instance.servicer.wait_started(1)
        instance.multiplexer.close()
        instance.servicer.step.set()
        assert await tokens(running) == [0, 1, 2]
        await asyncio.wait_for(instance.server.stop(grace=300), timeout=60)

    scenario()


@with_instance
async def test_a_broken_stream_ends_every_call_on_it_and_the_next_call_opens_another(instance: Instance) -> None:
    first, second = instance.call("first", -3), instance.call("second", -3)
    await anext(first)
    await anext(second)
    await instance.server.stop(grace=None)  # the instance dies: its connections drop
    for call in (first, second):
        with pytest.raises(grpc.aio.AioRpcError) as lost:
            await anext(call)
        assert lost.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    # Up again on the same port: the next call opens a new stream and is served.
    server = instance.plane.server()
    multiplex_pb2_grpc.add_MultiplexServicer_to_server(instance.multiplexer, server)
    instance.plane.add_port(server, instance.address)
    await server.start()
    instance.server = server
    instance.servicer.step.set()
    assert await tokens(instance.call("after", 1)) == [0]


@with_instance
async def test_a_stream_without_the_cluster_secret_is_refused(instance: Instance) -> None:
    stranger = grpc.aio.insecure_channel(instance.address)
    try:
        mux = CallMux(stranger, instance.address)
        call = mux.call("generate", generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1])))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await tokens(call)
        # The server's credential check refused the stream before any handler ran. The caller
        # reads that refusal, UNAUTHENTICATED, unless gRPC's core lost the race between the
        # stream's first message going out and the server ending it: once in CI it reported
        # INTERNAL ("Internal error from Core") while the server had logged the refusal.
        assert refused.value.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INTERNAL)
        assert instance.plane.credential_check_counts() == (1, 0)
        assert instance.servicer.started == []
    finally:
        await stranger.close()


@with_instance
async def test_a_caller_reusing_an_open_call_id_loses_its_stream(instance: Instance) -> None:
    stream = multiplex_pb2_grpc.MultiplexStub(instance.channel).Calls()
    request = generation_pb2.GenerateRequest(request_id="dup", token_ids=generation_pb2.TokenIds(ids=[-3]))
    await stream.write(multiplex_pb2.MuxCalls(calls=[multiplex_pb2.MuxCall(call_id=1, generate=request)]))
    await stream.read()  # the call's first token: it is open
    await stream.write(multiplex_pb2.MuxCalls(calls=[multiplex_pb2.MuxCall(call_id=1, generate=request)]))
    with pytest.raises(grpc.aio.AioRpcError) as broken:
        while True:
            await stream.read()
    assert broken.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already open" in (broken.value.details() or "")
    await instance.servicer.wait_closed("dup")  # the stream's calls were cancelled with it


@with_instance
async def test_responses_that_queued_while_the_gateway_was_behind_go_out_as_one_event(instance: Instance) -> None:
    """Through the dispatcher, as a request streams: the step's three responses arrive in one
    message while the stream's reader waits, and become one event (one chunk, one write)."""
    pool = InstancePool(stale_after_s=3600.0)
    pool.instances[instance.address] = InstanceState(instance.address, "colocated", instance.channel)
    report = disaggregation_pb2.LoadReport(instance_id="colocated-0", role="colocated")
    pool.record_report(instance.address, report, serving=True)
    dispatcher = Dispatcher(pool)
    request = DispatchRequest("queued", [-4], generation_pb2.SamplingParams())
    events = dispatcher.generate(request)
    first = await anext(events)
    assert first.token_ids == [0]
    instance.servicer.step.set()
    rest = [event async for event in events]
    assert [(event.token_ids, event.finish_reason) for event in rest] == [([1, 2, 3], "length")]
    await pool.instances[instance.address].call_mux.close()
