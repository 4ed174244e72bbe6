"""What one streamed message costs the receiving event loop, by transport: the floor under the
gateway's CPU per token when each token arrives in a message of its own (few streams per
instance, so nothing batches them).

    python -m microbench.stream_receive --streams 16 --messages 250 --interval-ms 20 --rounds 2

A server process streams ``--messages`` ``MuxEvents`` of one token each on every one of
``--streams`` streams, one every ``--interval-ms``, the streams offset from each other (as
instances' steps are): every message is a wake of the receiver of its own. The receiver, on
uvloop as the gateway runs, reads them through

- ``grpcio``: a ``grpc.aio`` client of a ``grpc.aio`` server, the gateway's path
  (``Multiplex.Calls``, gateway/call_mux.py); grpcio's poller thread takes each message and
  hands it to the loop;
- ``grpclib``: a pure-asyncio gRPC client (HTTP/2 framed in Python by ``h2``) of the same
  grpcio server: gRPC without the poller thread's hop;
- ``framed``: a length-prefixed protobuf per message over a plain asyncio connection, no
  HTTP/2 and no gRPC: the floor of any transport on an event loop (a wake, a read, a parse).

and reports the receiving process's CPU time (all its threads, from ``getrusage``) per message.
Only the receive is measured: what the gateway then does with a token (detokenize, frame, write
to its client) is bench.gateway_ceiling's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass

import grpc
import uvloop

from launcher.processes import free_port
from splitserve.v1 import generation_pb2, multiplex_pb2, multiplex_pb2_grpc

CALLS_METHOD = "/splitserve.v1.Multiplex/Calls"
FRAME_HEADER = struct.Struct("<I")  # the framed transport's length prefix
TRANSPORTS = ("grpcio", "grpclib", "framed")


@dataclass(frozen=True, slots=True)
class Pacing:
    messages: int
    interval_s: float
    streams: int

    def offset_s(self, stream: int) -> float:
        """Streams spread over one interval, as unaligned instances' steps are."""
        return stream * self.interval_s / self.streams

    async def each_message(self, stream: int) -> AsyncIterator[bytes]:
        await asyncio.sleep(self.offset_s(stream))
        started = time.monotonic()
        for index in range(self.messages):
            yield one_token_event(index)
            delay = started + (index + 1) * self.interval_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)


def one_token_event(token_id: int) -> bytes:
    response = generation_pb2.GenerateResponse(token_ids=[token_id])
    event = multiplex_pb2.MuxEvent(call_id=1, generate=response)
    return multiplex_pb2.MuxEvents(events=[event]).SerializeToString()


class PacedMultiplex(multiplex_pb2_grpc.MultiplexServicer):
    """Streams paced events on each ``Calls`` stream; the first call's id is the stream's number."""

    def __init__(self, pacing: Pacing) -> None:
        self._pacing = pacing

    async def Calls(self, request_iterator, context):  # noqa: N802 - gRPC signature
        requests = aiter(request_iterator)
        first = await anext(requests)
        async for event in self._pacing.each_message(first.calls[0].call_id):
            await context.write(multiplex_pb2.MuxEvents.FromString(event))
        # The receiver ends the call, as the gateway ends its mux stream: a server that ended it
        # first, its client's half still open, would reset the stream (HTTP/2 RST_STREAM), and
        # grpclib cancels a read that the reset overtakes though the last message had arrived.
        async for _ in requests:
            pass


async def serve(grpc_port: int, framed_port: int, pacing: Pacing) -> None:
    server = grpc.aio.server()
    multiplex_pb2_grpc.add_MultiplexServicer_to_server(PacedMultiplex(pacing), server)
    server.add_insecure_port(f"127.0.0.1:{grpc_port}")
    await server.start()

    async def framed_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stream = int((await reader.readline()).strip())
        async for event in pacing.each_message(stream):
            writer.write(FRAME_HEADER.pack(len(event)) + event)
        writer.close()

    framed = await asyncio.start_server(framed_stream, "127.0.0.1", framed_port)
    print("ready", flush=True)
    async with framed:
        await framed.serve_forever()


def open_call(stream: int) -> multiplex_pb2.MuxCalls:
    return multiplex_pb2.MuxCalls(calls=[multiplex_pb2.MuxCall(call_id=stream)])


async def receive_grpcio(port: int, stream: int, pacing: Pacing, channel: grpc.aio.Channel) -> int:
    async def calls() -> AsyncIterator[multiplex_pb2.MuxCalls]:
        yield open_call(stream)
        await asyncio.Event().wait()  # the stream stays open for the server's events

    call = multiplex_pb2_grpc.MultiplexStub(channel).Calls(calls())
    received = 0
    async for _ in call:
        received += 1
        if received == pacing.messages:
            break
    call.cancel()
    return received


async def receive_grpclib(port: int, stream: int, pacing: Pacing, channel: object) -> int:
    from grpclib.const import Cardinality

    async with channel.request(  # type: ignore[attr-defined]
        CALLS_METHOD, Cardinality.STREAM_STREAM, multiplex_pb2.MuxCalls, multiplex_pb2.MuxEvents
    ) as call:
        await call.send_message(open_call(stream))
        for _ in range(pacing.messages):
            await call.recv_message()
        await call.cancel()
    return pacing.messages


class _FramedReceiver(asyncio.Protocol):
    def __init__(self, done: asyncio.Future[int]) -> None:
        self._buffer = bytearray()
        self._received = 0
        self._done = done

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while len(self._buffer) >= FRAME_HEADER.size:
            (length,) = FRAME_HEADER.unpack_from(self._buffer)
            end = FRAME_HEADER.size + length
            if len(self._buffer) < end:
                return
            multiplex_pb2.MuxEvents.FromString(bytes(self._buffer[FRAME_HEADER.size : end]))
            del self._buffer[:end]
            self._received += 1

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._done.done():
            self._done.set_result(self._received)


async def receive_framed(port: int, stream: int, pacing: Pacing, channel: object) -> int:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[int] = loop.create_future()
    transport, _ = await loop.create_connection(lambda: _FramedReceiver(done), "127.0.0.1", port)
    transport.write(f"{stream}\n".encode())
    return await done


Receiver = Callable[[int, int, Pacing, object], Awaitable[int]]


def process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread's: grpcio's poller included
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True, slots=True)
class Measurement:
    transport: str
    round: int
    messages: int
    cpu_us_per_message: float
    wall_s: float


async def measure(transport: str, port: int, pacing: Pacing, round_: int) -> Measurement:
    receiver: Receiver
    if transport == "grpcio":
        channel: object = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        receiver = receive_grpcio  # type: ignore[assignment]
    elif transport == "grpclib":
        from grpclib.client import Channel

        channel, receiver = Channel("127.0.0.1", port), receive_grpclib
    else:
        channel, receiver = None, receive_framed
    cpu_before, started = process_cpu_s(), time.monotonic()
    counts = await asyncio.gather(*(receiver(port, stream, pacing, channel) for stream in range(pacing.streams)))
    cpu_s, wall_s = process_cpu_s() - cpu_before, time.monotonic() - started
    if channel is not None:
        closed = channel.close()  # type: ignore[attr-defined]
        if asyncio.iscoroutine(closed):
            await closed
    received = sum(counts)
    if received != pacing.messages * pacing.streams:
        raise RuntimeError(f"{transport}: received {received} of {pacing.messages * pacing.streams} messages")
    return Measurement(transport, round_, received, cpu_s / received * 1e6, wall_s)


def run(pacing: Pacing, transports: list[str], rounds: int) -> list[Measurement]:
    grpc_port, framed_port = free_port(), free_port()
    argv = [sys.executable, "-m", "microbench.stream_receive", "--serve", f"{grpc_port},{framed_port}"]
    argv += ["--messages", str(pacing.messages), "--interval-ms", str(pacing.interval_s * 1000)]
    argv += ["--streams", str(pacing.streams)]
    server = subprocess.Popen(argv, stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None
        if server.stdout.readline().strip() != b"ready":
            raise RuntimeError("the paced server did not start")
        results = []
        for round_ in range(rounds):  # interleaved, so that a change in the host's load falls on all
            for transport in transports:
                port = framed_port if transport == "framed" else grpc_port
                results.append(uvloop.run(measure(transport, port, pacing, round_)))
        return results
    finally:
        server.kill()
        server.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--messages", type=int, default=250, help="messages on each stream")
    parser.add_argument("--interval-ms", type=float, default=20.0, help="between one stream's messages")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    parser.add_argument("--json", action="store_true", help="one JSON object per measurement")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # GRPC_PORT,FRAMED_PORT: the server process
    args = parser.parse_args(argv)
    pacing = Pacing(args.messages, args.interval_ms / 1000, args.streams)
    if args.serve:
        grpc_port, framed_port = (int(port) for port in args.serve.split(","))
        uvloop.run(serve(grpc_port, framed_port, pacing))
        return 0
    transports = args.transports.split(",")
    unknown = set(transports) - set(TRANSPORTS)
    if unknown:
        parser.error(f"--transports: unknown {sorted(unknown)}; choose from {', '.join(TRANSPORTS)}")
    for measurement in run(pacing, transports, args.rounds):
        if args.json:
            print(json.dumps(asdict(measurement)))
        else:
            print(
                f"{measurement.transport:8} round {measurement.round}: {measurement.messages} messages, "
                f"{measurement.cpu_us_per_message:.1f} µs of CPU each, {measurement.wall_s:.1f} s"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
