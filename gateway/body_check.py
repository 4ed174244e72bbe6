"""Large JSON bodies checked off the event loop, before FastAPI parses them on it.

Parsing and validating JSON holds the GIL from start to end: pydantic-core and ``json`` are
native code that never lets another thread in. A worker thread therefore frees nothing: the
event loop waits for the GIL as long as it would have waited for the parse itself
(docs/benchmarks.md, "Request bodies and the event loop"). What costs is the number of JSON
values, far more than bytes (a long string is copied once; each small number or object is a
Python object and a validation of its own), and a body that fails validation costs most: pydantic
records an error for each element that fails.

So a body larger than :data:`INLINE_MAX_BYTES` that may hold more values than
:data:`INLINE_MAX_VALUES` (:func:`needs_worker`), in call order:

1. :class:`LargeBodyCheck` (ASGI, inside ``AdmissionGate``, so only after the key and a pending
   slot, and ``BodySizeLimit``, which has read the body whole) hands it to :meth:`BodyCheck.run`.
2. :meth:`BodyCheck.run` queues it on a work pool fair between clients (``gateway/work_pool.py``:
   429 past a client's share); the pool's thread hands it to a worker *process* and waits
   (waiting releases the GIL).
3. :func:`check_body`, in the worker process: parse, count the JSON values and objects
   (``--max-request-json-values``, and a sixteenth of it for objects), then validate with the
   route's own model. Returns None, or the first error (a few hundred bytes back).
4. A refused body is answered 400 here, in OpenAI's shape; an accepted one goes on to FastAPI,
   which parses it again on the event loop, now bounded by what step 3 checked. A worker that
   died under a check (killed for memory, say) costs that body a 503, and the next gets new
   workers (:meth:`BodyCheck._restart`).

Other bodies go straight on: few values, however hostile, whatever the length of their strings.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import threading
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from gateway.errors import APIError, bad_request, validation_error
from gateway.gate import client_of_scope
from gateway.limits import ASGIApp, Receive, Scope, Send, replay
from gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from gateway.work_pool import WorkPool

logger = logging.getLogger(__name__)

# Bodies up to this size are parsed on the event loop as they come: a hostile one (a union's
# error for each of some thousands of values) holds it for some milliseconds at most.
INLINE_MAX_BYTES = 8 << 10
# Or bodies of any size that cannot hold more values than the largest inline one may (a value
# and its separator take two bytes at least): a long text prompt is one string, as cheap to
# parse on the loop as a short one, and spares the round trip to a worker process.
INLINE_MAX_VALUES = INLINE_MAX_BYTES // 2
NUM_WORKERS = 2  # processes, and the pool threads waiting on them: one client holds one at most
MAX_WAITING = 64
MAX_WAITING_PER_CLIENT = 8  # a body is at most --max-request-body-bytes: a client queues a few
CHECK_TIMEOUT_S = 30.0  # a maximal hostile body takes a few seconds in a worker process
OBJECTS_PER_VALUE_LIMIT = 16  # objects cost pydantic a model each: a sixteenth of the values' limit

# The model each JSON route validates its body with (/tokenize takes two shapes: "messages" decides).
ROUTE_MODELS: Mapping[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/tokenize": TokenizeCompletionRequest,
    "/detokenize": DetokenizeRequest,
}


@dataclass(frozen=True, slots=True)
class BodyRefusal:
    """Why a worker process refused a body: the 400's message and field (picklable, small)."""

    message: str
    param: str | None = None
    code: str | None = None


def check_body(model: type[BaseModel], body: bytes, max_values: int) -> BodyRefusal | None:
    """Worker process: parse ``body``, bound its values and objects, validate it with ``model``.
    Returns None for a body FastAPI may parse, else why not."""
    try:
        document = json.loads(body)
    except (ValueError, RecursionError) as error:
        return BodyRefusal(f"the request body is not valid JSON: {error}")
    max_objects = max(1, max_values // OBJECTS_PER_VALUE_LIMIT)
    num_values, num_objects = count_json(document, max_values, max_objects)
    if num_values > max_values or num_objects > max_objects:
        return BodyRefusal(
            f"the request body holds more than {max_values} JSON values or {max_objects} objects; the limits are "
            f"--max-request-json-values ({max_values}) and a sixteenth of it for objects: send fewer messages, "
            "prompts or token ids per request",
            code="request_too_complex",
        )
    if model is TokenizeCompletionRequest and isinstance(document, dict) and "messages" in document:
        model = TokenizeChatRequest
    try:
        model.model_validate(document)
    except ValidationError as error:
        refused = validation_error(error.errors(include_url=False, include_input=False, include_context=False)[:1])
        return BodyRefusal(refused.message, refused.param, refused.code)
    return None


def count_json(document: Any, max_values: int, max_objects: int) -> tuple[int, int]:
    """(values, objects) in a parsed JSON document, counting stops once past either limit."""
    num_values = num_objects = 0
    stack = [document]
    while stack:
        value = stack.pop()
        num_values += 1
        if isinstance(value, dict):
            num_objects += 1
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        if num_values > max_values or num_objects > max_objects:
            break
    return num_values, num_objects


class BodyCheck:
    """The worker processes (started on the first large body) and the fair pool that feeds them."""

    def __init__(self, max_values: int) -> None:
        if max_values < 1:
            raise ValueError(f"--max-request-json-values must be >= 1, got {max_values}")
        self.max_values = max_values
        self.pool = WorkPool("body_check", NUM_WORKERS, MAX_WAITING, MAX_WAITING_PER_CLIENT)
        # Made on the first large body: even before its workers start, a process pool's queues
        # start multiprocessing's resource tracker, a process of its own beside every gateway.
        self._processes: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()  # the pool's threads may make it, or find it broken, at once

    async def run(self, model: type[BaseModel], body: bytes, client: str) -> BodyRefusal | None:
        """:func:`check_body` in a worker process. Raises APIError 429 when the client's share
        of the queue is full, 400 when the check runs past :data:`CHECK_TIMEOUT_S`."""

        def in_process(_stop: object) -> BodyRefusal | None:
            processes = self._current()
            try:
                return processes.submit(check_body, model, body, self.max_values).result()
            except BrokenProcessPool:
                self._restart(processes)
                raise

        try:
            return await self.pool.run(client, in_process, CHECK_TIMEOUT_S)  # type: ignore[arg-type]
        except TimeoutError:
            raise bad_request(
                f"checking the request body took longer than {CHECK_TIMEOUT_S:.0f} s; send a simpler one",
                code="request_too_complex",
            ) from None
        except BrokenProcessPool:
            # A worker died (killed for memory, say): this body is not answered for, the next gets new workers.
            logger.error("a request body check's worker process died; starting new ones")
            raise APIError(
                HTTPStatus.SERVICE_UNAVAILABLE,
                "the gateway could not check the request body; retry later",
                code="body_check_failed",
                retry_after_s=1.0,
            ) from None

    def _current(self) -> ProcessPoolExecutor:
        """Worker thread: the process pool, made on the first call."""
        with self._lock:
            if self._processes is None:
                self._processes = _worker_processes()
            return self._processes

    def _restart(self, broken: ProcessPoolExecutor) -> None:
        """Worker thread: drop a broken process pool (the next call makes a new one), once
        however many threads found it broken."""
        with self._lock:
            if self._processes is broken:
                broken.shutdown(wait=False, cancel_futures=True)
                self._processes = None

    def close(self) -> None:
        self.pool.close()
        with self._lock:
            if self._processes is not None:
                self._processes.shutdown(wait=False, cancel_futures=True)


def _worker_processes() -> ProcessPoolExecutor:
    # spawn: a fork of the gateway would copy its threads' locks in whatever state they were.
    return ProcessPoolExecutor(NUM_WORKERS, mp_context=multiprocessing.get_context("spawn"))


class LargeBodyCheck:
    """ASGI middleware: step 1 of the module docstring, for the paths of :data:`ROUTE_MODELS`."""

    def __init__(self, app: ASGIApp, check: BodyCheck) -> None:
        self.app = app
        self.check = check

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        model = ROUTE_MODELS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if model is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        message = await receive()  # the whole body: BodySizeLimit has buffered it
        body = message.get("body", b"") if message["type"] == "http.request" else b""
        if needs_worker(body):
            try:
                refusal = await self.check.run(model, body, client_of_scope(scope))
            except APIError as error:
                await _answer(error, scope, receive, send)
                return
            if refusal is not None:
                refused = APIError(HTTPStatus.BAD_REQUEST, refusal.message, refusal.param, refusal.code)
                await _answer(refused, scope, receive, send)
                return
        await self.app(scope, replay(message, receive), send)


def max_json_values(body: bytes) -> int:
    """At most how many JSON values (keys included) ``body`` holds, counted in C over its bytes:
    every value but the first follows a ``[``, ``,`` or ``:``, and every key a ``{`` or ``,``.
    Those bytes inside strings count too, so this only ever overestimates."""
    return 1 + 2 * body.count(b",") + body.count(b":") + body.count(b"[") + body.count(b"{")


def needs_worker(body: bytes) -> bool:
    """Whether parsing ``body`` could hold the event loop longer than an inline body may."""
    return len(body) > INLINE_MAX_BYTES and max_json_values(body) > INLINE_MAX_VALUES


async def _answer(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    headers = {"Retry-After": str(max(1, round(error.retry_after_s)))} if error.retry_after_s is not None else None
    response = JSONResponse(error.to_response().model_dump(), status_code=error.status, headers=headers)
    await response(scope, receive, send)
