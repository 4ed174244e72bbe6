"""A FAKE OpenAI-compatible server for the benchmark client's tests: real HTTP on
127.0.0.1, streaming SSE with known delays, so the client's timing is checked on a
real socket rather than on mocks. It runs an aiohttp app on its own event loop in a
background thread.

Per request: wait ``ttft_s``, then stream ``max_tokens`` one-word chunks
``itl_s`` apart, a finish chunk, a usage chunk (prompt tokens = words in the
prompt, which with the tests' tokenizer is the token count) and ``data: [DONE]``.
Chat answers start with a role-only delta sent at once, which a correct client must
not take for the first token. Requests can be made to fail by arrival index, or their
connection closed unanswered. ``GET /metrics`` answers what ``metrics`` renders for the
number of generation requests received so far (404 without it).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.stores import free_port


@dataclass(slots=True)
class FakeServerConfig:
    ttft_s: float = 0.05
    itl_s: float = 0.02
    model: str = "fake-model"
    root: str | None = None  # the model's folder, as /v1/models shows it (vLLM and splitserve do)
    api_key: str | None = None
    send_usage: bool = True
    http_error_at: set[int] = field(default_factory=set)  # arrival indices answered with HTTP 500
    stream_error_at: set[int] = field(default_factory=set)  # arrival indices that break after one chunk
    # Arrival indices whose connection is closed unanswered, as a server closing a kept-alive one.
    disconnect_at: set[int] = field(default_factory=set)
    # Prometheus text for GET /metrics, given how many generation requests arrived so far.
    metrics: Callable[[int], Awaitable[str]] | None = None


class FakeOpenAIServer:
    def __init__(self, config: FakeServerConfig | None = None) -> None:
        self.config = config or FakeServerConfig()
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.bodies: list[dict[str, Any]] = []  # every generation request body, in arrival order
        self.headers: list[dict[str, str]] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="fake-openai-server", daemon=True)
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None

    def __enter__(self) -> FakeOpenAIServer:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the fake OpenAI server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    def _unauthorized(self, request: web.Request) -> web.Response | None:
        if self.config.api_key and request.headers.get("Authorization") != f"Bearer {self.config.api_key}":
            error = {"error": {"message": "bad api key", "type": "authentication_error", "param": None, "code": 401}}
            return web.json_response(error, status=401)
        return None

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.config.metrics is None:
            raise web.HTTPNotFound()
        return web.Response(text=await self.config.metrics(len(self.bodies)), content_type="text/plain")

    async def _models(self, request: web.Request) -> web.Response:
        if denied := self._unauthorized(request):
            return denied
        card = {"id": self.config.model, "object": "model"} | ({"root": self.config.root} if self.config.root else {})
        return web.json_response({"object": "list", "data": [card]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        if denied := self._unauthorized(request):
            return denied
        body = await request.json()
        index = len(self.bodies)
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        if index in self.config.disconnect_at:
            assert request.transport is not None
            request.transport.close()
            return web.Response()  # never sent: the connection is gone
        if index in self.config.http_error_at:
            return web.json_response({"error": {"message": "fake overload", "type": "server_error"}}, status=500)
        chat = request.path.endswith("/chat/completions")
        prompt_words = sum(len(m["content"].split()) for m in body["messages"]) if chat else len(body["prompt"].split())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(chunk: dict[str, Any] | str) -> None:
            data = chunk if isinstance(chunk, str) else json.dumps(chunk)
            await response.write(f"data: {data}\n\n".encode())

        def choice(text: str, finish_reason: str | None = None) -> dict[str, Any]:
            if chat:
                return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish_reason}
            return {"index": 0, "text": text, "finish_reason": finish_reason}

        if chat:
            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        await asyncio.sleep(self.config.ttft_s)
        num_tokens = body["max_tokens"]
        for i in range(num_tokens):
            if i:
                await asyncio.sleep(self.config.itl_s)
            await send({"choices": [choice(f" w{i}")]})
            if index in self.config.stream_error_at:
                await send({"error": {"message": "fake engine failure", "type": "server_error"}})
                await response.write_eof()
                return response
        await send({"choices": [choice("", "length")]})
        if self.config.send_usage:
            usage = {
                "prompt_tokens": prompt_words,
                "completion_tokens": num_tokens,
                "total_tokens": prompt_words + num_tokens,
            }
            await send({"choices": [], "usage": usage})
        await send("[DONE]")
        await response.write_eof()
        return response
