"""An instance with a real engine (tiny model) and a real gRPC server, served in the
test's own event loop: the test calls it over loopback and reads or breaks its engine directly."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import grpc

from colocated_svc.server import ColocatedServicer, add_arguments
from engine.kv_loader import KVLoader
from serving.instance import Instance, serve
from splitserve.v1 import generation_pb2_grpc


def colocated_instance(model: Path, *argv: str) -> tuple[argparse.Namespace, Instance]:
    """The instance ``splitserve colocated --model MODEL ARGV...`` would create (on a free port,
    with a small KV cache), and its arguments."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", str(model), "--port", "0", "--kv-cache-memory", str(1 << 22), *argv])
    return args, Instance.create(args, "colocated")


@asynccontextmanager
async def serving(instance: Instance, args: argparse.Namespace, freeze_heap: bool = False) -> AsyncIterator[str]:
    """Serve the colocated instance until the block ends, then drain and stop it; yields its
    address. The heap is not frozen unless asked: the test process outlives the instance."""
    servicer = ColocatedServicer(instance)
    async with serving_instance(
        instance,
        args,
        lambda server: generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server),
        freeze_heap=freeze_heap,
    ) as address:
        yield address


@asynccontextmanager
async def serving_instance(
    instance: Instance,
    args: argparse.Namespace,
    add_servicer: Callable[[grpc.aio.Server], None],
    kv_loader: KVLoader | None = None,
    on_start: Callable[[], Awaitable[None]] | None = None,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    freeze_heap: bool = False,
) -> AsyncIterator[str]:
    """Serve any instance with its servicer (``serving.instance.serve``'s arguments) until the
    block ends, then drain and stop it; yields its address."""
    stop = asyncio.Event()
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        serve(
            instance,
            args,
            add_servicer,
            ready=ready.set_result,
            kv_loader=kv_loader,
            on_start=on_start,
            on_stop=on_stop,
            stop=stop,
            freeze_heap=freeze_heap,
        )
    )
    await asyncio.wait((ready, task), return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():
        await task  # it stopped before serving: raises why
        raise RuntimeError("the instance stopped before it served")
    try:
        yield ready.result()
    finally:
        stop.set()
        await task
