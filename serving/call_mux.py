"""Many streaming calls over one gRPC stream: the instance's side of ``Multiplex.Calls``
(proto/splitserve/v1/multiplex.proto; the gateway's side is gateway/call_mux.py).

Why: with one unary-stream call per request, a gateway streaming N requests from an instance
receives N gRPC messages per engine step, each a wake of gRPC's poller and of the gateway's
event loop of its own. Over one stream per gateway process and instance, the responses of
every call one step advanced leave in one message.

A call here is the role's own servicer method (``Decode``, ``Generate``), run as gRPC runs it:
the same code, the same statuses, the same cleanup when the caller leaves. Per stream, in call
order:

1. A reader takes the caller's ``MuxCalls``. Each call starts a task running the servicer
   method with a :class:`MuxCallContext` for its context: ``abort`` ends the call with that
   status, ``invocation_metadata`` is the call's own metadata (its trace context). A cancel
   cancels the task and closes the servicer's generator: its cleanup runs (the request is
   aborted, its blocks freed) as for a cancelled RPC.
2. The tasks put their responses in the stream's outbox, which is bounded: when the caller
   stops reading, the calls wait at the outbox and their engine streams coalesce tokens, as
   HTTP/2 flow control makes them do for one call.
3. A writer sends what the outbox holds as one ``MuxEvents``. The calls woken by one engine
   step all run before it (the step's outputs reach them in one loop callback), so their
   responses leave together.
4. When the instance stops (:meth:`CallMultiplexer.close`) new calls end ``UNAVAILABLE`` and
   each stream ends once its calls have, so the server's graceful stop waits for them and for
   no idle stream.

A broken stream cancels every call it carried. The stream's credential is checked once, when
it opens (cluster/auth.py: a stream-request call), as for any authenticated connection; the
calls it carries are counted under their own method (``splitserve_engine_grpc_calls_total``)
as if each were a call of its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

from cluster.call_counts import CallCounts
from splitserve.v1 import multiplex_pb2, multiplex_pb2_grpc

logger = logging.getLogger(__name__)

# Responses held for a caller that is not reading before the calls wait: a few steps of a
# full batch, so that a momentary stall of the gateway holds no step back.
OUTBOX_CAPACITY = 4096
MAX_CALLS_PER_STREAM = 4096  # open calls one stream may hold; a gateway opens one per instance

ServicerMethod = Callable[[Any, Any], AsyncGenerator[Any, None]]


@dataclass(frozen=True, slots=True)
class MultiplexedMethod:
    """A servicer's streaming method and the full name its calls are counted under."""

    name: str  # "/splitserve.v1.Decode/Decode"
    serve: ServicerMethod


class MuxCallAbort(Exception):
    """A multiplexed call ended by its servicer with a status (``context.abort``)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class MuxCallContext:
    """What a servicer method uses of its ``grpc.aio.ServicerContext``, for a call that runs
    inside a multiplexed stream."""

    def __init__(self, metadata: Sequence[tuple[str, str]], peer: str) -> None:
        self._metadata = tuple(metadata)
        self._peer = peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        raise MuxCallAbort(code, details)


class _Outbox:
    """Events waiting for the stream's writer; bounded (step 2 of the module's docstring)."""

    def __init__(self, capacity: int) -> None:
        self._events: list[multiplex_pb2.MuxEvent] = []
        self._capacity = capacity
        self._ready = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()

    async def put(self, event: multiplex_pb2.MuxEvent) -> None:
        while not self._room.is_set():
            await self._room.wait()
        self._events.append(event)
        self._ready.set()
        if len(self._events) >= self._capacity:
            self._room.clear()

    def wake(self) -> None:
        """Wake the writer with nothing to send: the stream's state changed."""
        self._ready.set()

    def is_empty(self) -> bool:
        return not self._events

    async def take(self) -> list[multiplex_pb2.MuxEvent]:
        await self._ready.wait()
        self._ready.clear()
        events, self._events = self._events, []
        self._room.set()
        return events


def _end_event(call_id: int, code: grpc.StatusCode, details: str) -> multiplex_pb2.MuxEvent:
    return multiplex_pb2.MuxEvent(call_id=call_id, end=multiplex_pb2.MuxEnd(code=code.value[0], details=details))


class _Stream:
    """One caller's stream: its calls, its outbox, its reader (the module's docstring)."""

    def __init__(self, mux: CallMultiplexer, context: grpc.aio.ServicerContext) -> None:
        self._mux = mux
        self._context = context
        self._peer = context.peer()
        self._outbox = _Outbox(OUTBOX_CAPACITY)
        self._calls: dict[int, asyncio.Task[None]] = {}
        self._reading = True  # the caller may still send calls
        self._protocol_error: str | None = None

    def wake(self) -> None:
        self._outbox.wake()

    async def run(self, request_iterator: AsyncIterator[multiplex_pb2.MuxCalls]) -> None:
        reader = asyncio.create_task(self._read(request_iterator))
        try:
            while True:
                events = await self._outbox.take()
                if events:
                    await self._context.write(multiplex_pb2.MuxEvents(events=events))
                if self._protocol_error is not None:
                    await self._context.abort(grpc.StatusCode.INVALID_ARGUMENT, self._protocol_error)
                if not self._calls and self._outbox.is_empty() and (not self._reading or self._mux.closing):
                    # The caller sends no more calls, or the instance stops, and the last call's
                    # end went out (it may have queued while this wrote the events before it).
                    return
        finally:
            reader.cancel()
            calls = list(self._calls.values())
            for task in calls:
                task.cancel()
            await asyncio.gather(reader, *calls, return_exceptions=True)

    async def _read(self, request_iterator: AsyncIterator[multiplex_pb2.MuxCalls]) -> None:
        try:
            async for message in request_iterator:
                for call in message.calls:
                    await self._take(call)
        finally:
            self._reading = False
            self.wake()

    async def _take(self, call: multiplex_pb2.MuxCall) -> None:
        call_id = call.call_id
        body = call.WhichOneof("body")
        if body == "cancel":
            task = self._calls.pop(call_id, None)
            if task is not None:
                task.cancel()  # nothing more is sent for it: the caller has forgotten it
            return
        if call_id in self._calls:
            self._protocol_error = f"call id {call_id} is already open on this stream (a caller's bug)"
            self.wake()
            return
        method = self._mux.methods.get(body or "")
        if method is None:
            await self._outbox.put(
                _end_event(
                    call_id, grpc.StatusCode.UNIMPLEMENTED, f"this instance does not serve {body or 'empty'} calls"
                )
            )
            return
        self._mux.count(method.name)
        if self._mux.closing:
            await self._outbox.put(_end_event(call_id, grpc.StatusCode.UNAVAILABLE, "this instance is stopping"))
            return
        if len(self._calls) >= MAX_CALLS_PER_STREAM:
            await self._outbox.put(
                _end_event(
                    call_id,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{MAX_CALLS_PER_STREAM} calls are open on this stream; open another stream",
                )
            )
            return
        context = MuxCallContext([(item.key, item.value) for item in call.metadata], self._peer)
        self._calls[call_id] = asyncio.create_task(self._serve(call_id, body, method, getattr(call, body), context))

    async def _serve(
        self, call_id: int, body: str, method: MultiplexedMethod, request: Any, context: MuxCallContext
    ) -> None:
        code, details = grpc.StatusCode.OK, ""
        responses = method.serve(request, context)
        try:
            try:
                async for response in responses:
                    event = multiplex_pb2.MuxEvent(call_id=call_id)
                    getattr(event, body).CopyFrom(response)
                    await self._outbox.put(event)
            except MuxCallAbort as abort:
                code, details = abort.code, abort.details
            except Exception as error:  # the servicer's bug: this call fails, the stream and its other calls go on
                logger.exception("a multiplexed %s call failed", method.name)
                code, details = grpc.StatusCode.INTERNAL, f"the instance failed serving the call: {error!r}"
            finally:
                await responses.aclose()  # cancelled at the outbox: the servicer's cleanup runs now
            # Queued while the call still counts as open: the end may wait for room in the
            # outbox, and the writer that makes it must not take the stream for done meanwhile.
            await self._outbox.put(_end_event(call_id, code, details))
        finally:
            if self._calls.get(call_id) is asyncio.current_task():
                del self._calls[call_id]
            self.wake()


class CallMultiplexer(multiplex_pb2_grpc.MultiplexServicer):
    """``Multiplex.Calls`` for an instance whose streaming methods are ``methods``, keyed by
    the ``MuxCall`` body that carries their request (``"decode"``, ``"generate"``)."""

    def __init__(self, methods: Mapping[str, MultiplexedMethod], call_counts: CallCounts | None = None) -> None:
        self.methods = dict(methods)
        self._call_counts = call_counts
        self._streams: set[_Stream] = set()
        self.closing = False

    def count(self, method_name: str) -> None:
        if self._call_counts is not None:
            self._call_counts.count(method_name)

    def close(self) -> None:
        """The instance stops: refuse new calls, and end each stream once its calls have."""
        self.closing = True
        for stream in self._streams:
            stream.wake()

    async def Calls(self, request_iterator, context):  # noqa: N802 - gRPC signature
        if self.closing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this instance is stopping")
        stream = _Stream(self, context)
        self._streams.add(stream)
        try:
            await stream.run(request_iterator)
        finally:
            self._streams.discard(stream)
