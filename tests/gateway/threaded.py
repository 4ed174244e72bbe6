"""The gateway's real REST app served by uvicorn on a loopback socket, from a thread of its own
with its own event loop, over fake instances (tests/gateway/test_dispatch_failover.py): real
HTTP, real SSE writes, no instance processes. A client in the test's thread reads at its own
pace, so a client that stops reading does not stop the server, as on two processes.

:class:`PacedInstance` is a colocated instance whose timing model is a set pace between tokens,
so a server-side gap has a known lower bound."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import uvicorn

from gateway.app import create_app
from gateway.generation import GenerationService
from gateway.instances import InstancePool
from gateway.metrics import GatewayMetrics
from gateway.tokenizer import ModelTokenizer
from tests.gateway.test_dispatch_failover import FakeDecode, make_pool

MODEL_NAME = "tiny"
WORD = 263  # " the" in tests/checkpoints.py's tokenizer: every token is text of its own


class PacedInstance(FakeDecode):
    """A colocated instance: each Generate call streams ``num_tokens`` tokens (each ``WORD``, the
    last one finishing with "length"), one at a time, the i-th at least ``gaps_s[i % len]`` after
    the one before (one number: a steady pace)."""

    def __init__(self, num_tokens: int, gaps_s: float | Sequence[float]) -> None:
        super().__init__()
        self.num_tokens = num_tokens
        self.gaps_s = [gaps_s] if isinstance(gaps_s, float | int) else list(gaps_s)

    async def _play(self, request: Any, response_type: type) -> AsyncIterator[Any]:
        self.requests.append(request)
        for i in range(self.num_tokens):
            if i:
                # The instance's timing model, not a wait for an event.
                await asyncio.sleep(self.gaps_s[i % len(self.gaps_s)])
            finish_reason = "length" if i == self.num_tokens - 1 else ""
            yield response_type(request_id=request.request_id, token_ids=[WORD], finish_reason=finish_reason)


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, started: threading.Event) -> None:
        super().__init__(config)
        self._started = started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self._started.set()


@contextmanager
def served_gateway(model: Path, make_instances: Callable[[], InstancePool]) -> Iterator[str]:
    """The gateway's base URL, serving until the block ends; ``make_instances`` builds the pool
    of fakes on the server's loop (their events belong to it)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))  # bound here: no race for a free port
    port = listener.getsockname()[1]
    started, failed = threading.Event(), []
    server: list[_Server] = []

    async def serve() -> None:
        pool = make_instances()
        tokenizer = ModelTokenizer(model)
        service = GenerationService(pool, tokenizer, GatewayMetrics(pool), 16, 60.0, None, False)
        config = uvicorn.Config(create_app(service, MODEL_NAME, None), lifespan="off", log_level="warning")
        server.append(_Server(config, started))
        try:
            await server[0].serve(sockets=[listener])
        finally:
            await service.dispatcher.drain()
            await pool.close()
            service.close()
            tokenizer.close()

    def run() -> None:
        try:
            asyncio.run(serve())
        except BaseException as error:
            failed.append(error)
            started.set()

    thread = threading.Thread(target=run, name="gateway", daemon=True)
    thread.start()
    try:
        if not started.wait(60) or failed:
            raise RuntimeError(f"the gateway did not start: {failed}")
        yield f"http://127.0.0.1:{port}"
    finally:
        if server:
            server[0].should_exit = True
        thread.join(30)
        listener.close()
        if thread.is_alive():
            raise RuntimeError("the gateway's thread did not stop")


def paced_pool(num_tokens: int, gap_s: float) -> Callable[[], InstancePool]:
    return lambda: make_pool(colocated=[PacedInstance(num_tokens, gap_s)])
