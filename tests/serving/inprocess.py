"""A colocated instance with a real engine (tiny model) and a real gRPC server, served in the
test's own event loop: the test calls it over loopback and reads or breaks its engine directly."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from serving import colocated
from serving.instance import Instance, serve
from splitserve.v1 import generation_pb2_grpc


def colocated_instance(model: Path, *argv: str) -> tuple[argparse.Namespace, Instance]:
    """The instance ``splitserve colocated --model MODEL ARGV...`` would create (on a free port,
    with a small KV cache), and its arguments."""
    parser = argparse.ArgumentParser()
    colocated.add_arguments(parser)
    args = parser.parse_args(["--model", str(model), "--port", "0", "--kv-cache-memory", str(1 << 22), *argv])
    return args, Instance.create(args, "colocated")


@asynccontextmanager
async def serving(instance: Instance, args: argparse.Namespace, freeze_heap: bool = False) -> AsyncIterator[str]:
    """Serve the instance until the block ends, then drain and stop it; yields its address. The
    heap is not frozen unless asked: the test process outlives the instance."""
    servicer = colocated.ColocatedServicer(instance)
    stop = asyncio.Event()
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        serve(
            instance,
            args,
            lambda server: generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server),
            ready=ready.set_result,
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
