"""A closed loop of streamed completions spread over several gateways: stream ``i`` always on
gateway ``i % len(urls)``, each request a prompt of its own (so that the instances' prefix caches
fill and publish KV events), every request to its ``max_tokens``. It counts what a benchmark of
the cluster's traffic needs, and no more: streams started, requests open by gateway, requests,
tokens (SSE data events) and failures. The client is lean on purpose: it shares the host with
what it measures."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import aiohttp

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadLoop:
    """A closed loop of streamed completions, stream ``i`` always on gateway ``i % gateways``."""

    urls: list[str]
    model: str
    streams: int
    max_tokens: int
    prompt_words: int
    num_started: int = 0  # streams that had their first token
    num_open: list[int] = field(default_factory=list)  # by gateway: requests sent and not yet done
    num_requests: int = 0
    num_tokens: int = 0
    num_failed: int = 0
    requests_per_stream: int | None = None  # None: until stopped
    stopping: bool = False

    async def run(self) -> None:
        self.num_open = [0] * len(self.urls)
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await asyncio.gather(*(self._stream(session, i) for i in range(self.streams)))

    async def _stream(self, session: aiohttp.ClientSession, index: int) -> None:
        gateway = index % len(self.urls)
        first = True
        sent = 0
        while not self.stopping and (self.requests_per_stream is None or sent < self.requests_per_stream):
            # Each request its own prompt: the instances' prefix caches fill and emit KV events.
            prompt = " ".join(f"s{index}r{sent}w{i}" for i in range(self.prompt_words))
            sent += 1
            body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "stream": True}
            body |= {"ignore_eos": True}
            self.num_open[gateway] += 1
            try:
                async with session.post(f"{self.urls[gateway]}/v1/completions", json=body) as response:
                    if response.status != 200:
                        self.num_failed += 1
                        await response.read()
                        continue
                    async for line in response.content:
                        if line.startswith(b"data: {"):
                            self.num_tokens += 1
                            if first:
                                first = False
                                self.num_started += 1
                    self.num_requests += 1
            except (aiohttp.ClientError, TimeoutError) as error:
                self.num_failed += 1
                logger.warning("stream %d: %r", index, error)
            finally:
                self.num_open[gateway] -= 1
