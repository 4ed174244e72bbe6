"""The gateway's REST app and gRPC front in the test's own event loop, routing to real
instance processes: thousands of requests take seconds, and the test reads the
service's state (its pending count) directly.

Also a tiny checkpoint with a chat template of known variables, for the
``chat_template_kwargs`` tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
from fastapi import FastAPI
from transformers import PreTrainedTokenizerFast

from gateway.app import create_app
from gateway.discovery import StaticDiscovery
from gateway.generation import GenerationService
from gateway.grpc_front import start_grpc_front
from gateway.instances import InstancePool
from gateway.limits import RequestLimits
from gateway.metrics import GatewayMetrics
from gateway.tokenizer import ModelTokenizer
from tests.checkpoints import make_checkpoint
from tests.services.client import assert_all_free
from tests.services.processes import Service

MODEL_NAME = "tiny"

_SLOW_LOOPS = (
    "{%- if slow_loops %}{% for i in range(slow_loops) %}"
    "{% for j in range(1000) %}{% set x = i * j %}{% endfor %}"
    "{% endfor %}{% endif -%}"
)
# Reads enable_thinking (a kwarg clients may set), raises on a misplaced system message
# (a template error the client caused), and burns time on request (for the time limit).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' and not loop.first -%}{{ raise_exception('the system message must come "
    "first') }}{%- endif -%}"
    "{{ message['role'] + ': ' + message['content'] + '\n' }}"
    "{%- endfor -%}"
    "{%- if enable_thinking %}{{ 'think: ' }}{% endif -%}"
    + _SLOW_LOOPS
    + "{%- if add_generation_prompt %}{{ 'assistant:' }}{% endif -%}"
)


def make_chat_checkpoint(directory: Path, slow_loops: bool = True) -> Path:
    """``slow_loops=False``: without the loop a client can size (fuzzers would find it)."""
    make_checkpoint(directory)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(directory))
    tokenizer.chat_template = CHAT_TEMPLATE if slow_loops else CHAT_TEMPLATE.replace(_SLOW_LOOPS, "")
    tokenizer.save_pretrained(directory)
    return directory


@dataclass
class InProcessGateway:
    client: httpx.AsyncClient
    service: GenerationService
    grpc_channel: grpc.aio.Channel
    app: FastAPI | None = None  # what ``client`` talks to, for other clients (the openai one)


@asynccontextmanager
async def inprocess_gateway(
    model: Path,
    prefill: str,
    decode: str,
    limits: RequestLimits | None = None,
    max_pending_requests: int = 4,
    enable_priority: bool = False,
    api_key: str | None = None,
) -> AsyncIterator[InProcessGateway]:
    pool = InstancePool(stale_after_s=30.0)
    discovery = StaticDiscovery(pool, {"prefill": [prefill], "decode": [decode]}, interval_s=0.2)
    await discovery.poll_once()
    polling = asyncio.create_task(discovery.run())
    tokenizer = ModelTokenizer(model, limits)
    service = GenerationService(
        pool, tokenizer, GatewayMetrics(pool), max_pending_requests, 60.0, None, enable_priority
    )
    grpc_front = await start_grpc_front(service, MODEL_NAME, api_key, "127.0.0.1", 0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_front.port}")
    # A server logs what the app raises after its 500 went out; here the response is what counts.
    app = create_app(service, MODEL_NAME, api_key)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=60) as client:
            yield InProcessGateway(client, service, channel, app)
    finally:
        await channel.close()
        await grpc_front.stop(grace=None)
        polling.cancel()
        await asyncio.gather(polling, return_exceptions=True)
        await service.dispatcher.drain()
        await pool.close()
        service.close()
        tokenizer.close()


def run_inprocess(
    instances: tuple[Service, Service],
    model: Path,
    scenario: Callable[[InProcessGateway], Awaitable[None]],
    limits: RequestLimits | None = None,
    **options: Any,
) -> None:
    """Run ``scenario`` against an in-process gateway in front of a prefill and a decode
    instance (``options``: :func:`inprocess_gateway`'s); then every KV block is free again."""

    async def main() -> None:
        async with inprocess_gateway(model, instances[0].address, instances[1].address, limits, **options) as gateway:
            await scenario(gateway)

    asyncio.run(main())
    assert_all_free(*instances)
