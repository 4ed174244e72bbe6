"""The gateway's side of ``Multiplex.Calls`` (proto/splitserve/v1/multiplex.proto; the
instance's side and why it exists: serving/call_mux.py): every streaming call this gateway
process makes to one instance (``Decode``, ``Generate``) rides one gRPC stream, whose
messages carry the calls of a whole engine step at once.

A :class:`MuxCall` stands where the unary-stream call stood, with the part of
``grpc.aio.UnaryStreamCall`` that ``gateway/failover.py`` uses: its responses by ``async for``,
a non-OK end raised as ``grpc.aio.AioRpcError`` with the status the instance ended it with,
``done()`` and ``cancel()``. So retries, re-prefills and migration treat both the same.

:class:`CallMux`, one per instance, in call order:

1. The first call opens the stream (``Multiplex.Calls`` on the instance's channel, with its
   credentials); calls are queued and sent by gRPC's own request iterator, all those queued
   since its last message in one ``MuxCalls``.
2. One reader task takes each ``MuxEvents`` and hands every event to its call: a response to
   the call's queue, an end as its status. A call's queue holds what its consumer has not read
   yet: at most its own output, which ``max_tokens`` bounds, so a slow client never holds the
   stream (or the other calls on it) back.
3. A call ends locally when its consumer cancels it (the client left, the request ended on a
   stop string) or its deadline passes (``DEADLINE_EXCEEDED``, as gRPC would end it): a cancel
   goes to the instance, which aborts the request and frees its blocks, and sends nothing more.
4. A stream that breaks (the instance died, the channel closed) or that the instance ends (it
   stops: ``UNAVAILABLE``) ends every call still open on it with that status; the next call
   opens a new stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, Literal

import grpc

from splitserve.v1 import disaggregation_pb2_grpc, generation_pb2_grpc, multiplex_pb2, multiplex_pb2_grpc

logger = logging.getLogger(__name__)

CallBody = Literal["decode", "generate"]
_OK = grpc.StatusCode.OK
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class MuxCall:
    """One streaming call inside a :class:`CallMux` (the module's docstring)."""

    def __init__(self, mux: CallMux, call_id: int, body: CallBody) -> None:
        self._mux = mux
        self.call_id = call_id
        self._body = body
        self._responses: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._end: tuple[grpc.StatusCode, str] | None = None
        self._deadline: asyncio.TimerHandle | None = None

    def __aiter__(self) -> MuxCall:
        return self

    async def __anext__(self) -> Any:
        while not self._responses:
            if self._end is not None:
                code, details = self._end
                if code == _OK:
                    raise StopAsyncIteration
                raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._responses.popleft()

    def done(self) -> bool:
        return self._end is not None

    def take_ready(self) -> list[Any]:
        """The responses that arrived and are not read yet, taken at once: those of the steps
        that ran while this call's reader was behind (its client, or the gateway itself)."""
        ready = list(self._responses)
        self._responses.clear()
        return ready

    def cancel(self) -> bool:
        """The caller leaves: the instance aborts the request (step 3)."""
        if self._end is not None:
            return False
        self.finish(grpc.StatusCode.CANCELLED, "cancelled by the gateway")
        self._mux.cancel(self.call_id)
        return True

    def deliver(self, event: multiplex_pb2.MuxEvent) -> None:
        """An event from the instance (the reader's, step 2)."""
        if event.WhichOneof("body") == "end":
            self.finish(_CODES.get(event.end.code, grpc.StatusCode.UNKNOWN), event.end.details)
            return
        self._responses.append(getattr(event, self._body))
        self._wake()

    def expire_at(self, when: float) -> None:
        self._deadline = asyncio.get_running_loop().call_at(when, self._expire)

    def _expire(self) -> None:
        if self._end is None:
            self.finish(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            self._mux.cancel(self.call_id)

    def finish(self, code: grpc.StatusCode, details: str) -> None:
        """End the call (its responses already queued are still read first)."""
        if self._end is not None:
            return
        self._end = (code, details)
        self._mux.forget(self.call_id)
        if self._deadline is not None:
            self._deadline.cancel()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class CallMux:
    """This gateway process's stream of calls to one instance (the module's docstring)."""

    def __init__(self, channel: grpc.aio.Channel, address: str) -> None:
        self._channel = channel
        self._address = address
        self._calls: dict[int, MuxCall] = {}
        self._next_id = 0
        self._outgoing: list[multiplex_pb2.MuxCall] = []
        self._has_outgoing: asyncio.Event | None = None
        self._reader: asyncio.Task[None] | None = None
        self.num_messages_received = 0  # MuxEvents: one per step of the instance that advanced a call

    @property
    def num_open_calls(self) -> int:
        return len(self._calls)

    def call(
        self,
        body: CallBody,
        request: Any,
        timeout_s: float | None = None,
        metadata: tuple[tuple[str, str], ...] | None = None,
    ) -> MuxCall:
        """Start a call carrying ``request`` (a ``DecodeRequest`` or ``GenerateRequest``, as
        ``body`` says); it is sent with the stream's next message."""
        self._next_id += 1
        call = MuxCall(self, self._next_id, body)
        self._calls[call.call_id] = call
        if timeout_s is not None:
            call.expire_at(asyncio.get_running_loop().time() + timeout_s)
        message = multiplex_pb2.MuxCall(call_id=call.call_id, **{body: request})
        for key, value in metadata or ():
            message.metadata.add(key=key, value=value)
        self._send(message)
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())
        return call

    def cancel(self, call_id: int) -> None:
        if self._reader is not None:  # no stream: the instance holds nothing of the call
            self._send(multiplex_pb2.MuxCall(call_id=call_id, cancel=True))

    def forget(self, call_id: int) -> None:
        self._calls.pop(call_id, None)

    async def close(self) -> None:
        """Cancel the stream (and so every call on it); for the gateway's shutdown."""
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)

    def _send(self, message: multiplex_pb2.MuxCall) -> None:
        self._outgoing.append(message)
        if self._has_outgoing is not None:
            self._has_outgoing.set()

    async def _requests(self, has_outgoing: asyncio.Event) -> AsyncIterator[multiplex_pb2.MuxCalls]:
        """gRPC's request iterator: what was queued since the last message, in one (step 1)."""
        while True:
            await has_outgoing.wait()
            has_outgoing.clear()
            calls, self._outgoing = self._outgoing, []
            if calls:
                yield multiplex_pb2.MuxCalls(calls=calls)

    async def _read(self) -> None:
        """Open the stream and route its events until it ends (steps 1, 2 and 4)."""
        has_outgoing = self._has_outgoing = asyncio.Event()
        has_outgoing.set()  # the calls queued before the stream opened
        stream: grpc.aio.StreamStreamCall | None = None
        code, details = grpc.StatusCode.UNAVAILABLE, f"the instance at {self._address} closed the call stream"
        try:
            stream = multiplex_pb2_grpc.MultiplexStub(self._channel).Calls(self._requests(has_outgoing))
            async for message in stream:
                self.num_messages_received += 1
                calls = self._calls
                for event in message.events:
                    call = calls.get(event.call_id)
                    if call is not None:  # else cancelled here before its end arrived
                        call.deliver(event)
        except grpc.aio.AioRpcError as error:
            code, details = error.code(), error.details() or ""
        except asyncio.CancelledError:
            code, details = grpc.StatusCode.CANCELLED, "the gateway closed the call stream"
            raise
        except Exception as error:  # a bug here must end the calls, not leave them waiting
            logger.exception("the call stream to %s failed", self._address)
            code, details = grpc.StatusCode.INTERNAL, f"the gateway's call stream failed: {error!r}"
        finally:
            if stream is not None:
                stream.cancel()
            self._has_outgoing = None
            self._reader = None
            self._outgoing = []  # calls not sent yet end below; cancels of ended calls are moot
            for call in list(self._calls.values()):
                call.finish(code, details)
            if code != grpc.StatusCode.CANCELLED:
                logger.debug("call stream to %s ended: %s %s", self._address, code.name, details)


def open_streaming_call(
    mux: CallMux | None,
    channel: grpc.aio.Channel,
    body: CallBody,
    request: Any,
    timeout_s: float | None,
    metadata: tuple[tuple[str, str], ...] | None,
) -> MuxCall | grpc.aio.UnaryStreamCall:
    """A streaming call to an instance: over its call stream ``mux``, or with ``mux`` None as
    a unary-stream call of its own (``--instance-calls per-call``)."""
    if mux is not None:
        return mux.call(body, request, timeout_s, metadata)
    if body == "decode":
        return disaggregation_pb2_grpc.DecodeStub(channel).Decode(request, timeout=timeout_s, metadata=metadata)
    return generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=timeout_s, metadata=metadata)
