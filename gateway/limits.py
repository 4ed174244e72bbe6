"""Size limits on what one request may ask of the gateway, so that no client can
hold its event loop, its memory or its tokenizer for long: the request body, the
prompts of one completion request, the stop strings, a prompt's characters
before tokenizing, and the time a chat template may take to render and a grammar
to compile; and the JSON values a large body may hold, checked off the event loop
(``gateway/body_check.py``).

Each is a gateway flag (``gateway.server``); the defaults are generous for a
128k-token context and still keep a single request cheap to refuse.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse

from gateway.errors import APIError, bad_request
from gateway.flags import (
    DEFAULT_CHAT_TEMPLATE_TIMEOUT_S,
    DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_JSON_VALUES,
    DEFAULT_MAX_PROMPT_CHARS,
    DEFAULT_MAX_PROMPTS,
    DEFAULT_MAX_STOP,
    DEFAULT_MAX_STOP_CHARS,
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_json_values: int = DEFAULT_MAX_JSON_VALUES  # numbers, strings, ... in one body (gateway/body_check.py)
    max_prompts: int = DEFAULT_MAX_PROMPTS
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS
    max_stop: int = DEFAULT_MAX_STOP
    max_stop_chars: int = DEFAULT_MAX_STOP_CHARS
    chat_template_timeout_s: float = DEFAULT_CHAT_TEMPLATE_TIMEOUT_S
    grammar_compile_timeout_s: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in (
            "max_body_bytes",
            "max_json_values",
            "max_prompts",
            "max_prompt_chars",
            "max_stop",
            "max_stop_chars",
            "chat_template_timeout_s",
            "grammar_compile_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def check_num_prompts(self, num_prompts: int) -> None:
        if num_prompts > self.max_prompts:
            raise bad_request(
                f"this request has {num_prompts} prompts; the limit is {self.max_prompts} (--max-prompts-per-request); "
                "split them over several requests",
                param="prompt",
                code="too_many_prompts",
            )

    def check_prompt_chars(self, text: str, param: str) -> None:
        """Before tokenizing: a prompt's characters bound the tokenizer's work."""
        if len(text) > self.max_prompt_chars:
            raise bad_request(
                f"the prompt has {len(text)} characters; the limit is {self.max_prompt_chars} (--max-prompt-chars); "
                "shorten it",
                param=param,
                code="prompt_too_long",
            )

    def check_stop(self, stop: list[str], stop_token_ids: list[int]) -> None:
        for name, values in (("stop", stop), ("stop_token_ids", stop_token_ids)):
            if len(values) > self.max_stop:
                raise bad_request(
                    f"{name} has {len(values)} entries; the limit is {self.max_stop} (--max-stop-sequences)", param=name
                )
        longest = max(stop, key=len, default="")
        if len(longest) > self.max_stop_chars:
            raise bad_request(
                f"a stop string has {len(longest)} characters; the limit is {self.max_stop_chars} (--max-stop-chars)",
                param="stop",
            )


class BodySizeLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets 413 before anything parses it.

    The declared ``Content-Length`` is checked first; a body without one (chunked) is
    counted as it arrives. The body is buffered here (FastAPI reads it whole anyway)
    and handed on in one message; later ``receive`` calls (disconnect watching) go
    to the server as before.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending the body
                await self.app(scope, replay(message, receive), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, replay(body, receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"the request body is over the limit of {self.max_bytes} bytes (--max-request-body-bytes); send less",
            code="request_too_large",
        )
        response = JSONResponse(
            error.to_response().model_dump(), status_code=error.status, headers={"Connection": "close"}
        )
        await response(scope, receive, send)


def replay(first: Message, receive: Receive) -> Receive:
    """A ``receive`` that answers ``first`` once, then defers to the server's (a middleware that
    has read the body hands it on with this)."""
    pending: list[Message] = [first]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed
