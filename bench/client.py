"""One streamed request to an OpenAI-compatible server, timed on the raw SSE chunks.

Timing rules (client side, ``time.perf_counter``):
- the clock starts when the request is handed to the HTTP client (connection set-up
  on a cold connection counts, as a user would see it);
- a *content chunk* is an SSE event whose choices carry non-empty text (completions
  ``text``, chat ``delta.content`` or ``delta.reasoning_content``). Role-only chat
  deltas, empty keep-alives, the finish chunk and the usage chunk are not tokens and
  time nothing;
- TTFT is the arrival of the first content chunk; ITL is every gap between
  consecutive content chunks (chunks read in one network read share a timestamp, as
  the client received them together); E2E latency ends at the last content chunk;
- output tokens come from the usage chunk (``stream_options.include_usage``) when
  the server sends one, prompt tokens too.

The server's own account of the request's TTFT and its phases, where it sends one (splitserve's
``x-splitserve-timing`` header), is kept beside the client's measurements (``server_timing``);
so are the server's gaps between the same content chunks (``server_itl``), from when it wrote
each one, where it says (splitserve's chunk times: bench/token_gaps.py).

A request fails, with its error kept, on a non-200 status, an ``error`` event or
object in the stream, malformed JSON, a transport error or timeout, a stream that
ends before ``data: [DONE]``, or one that carried no content at all.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from bench.datasets import SampleRequest
from bench.sse import SSEDecoder, SSEEvent
from bench.token_gaps import CHUNK_TIMES_HEADER, parse_chunk_times, server_gaps

logger = logging.getLogger(__name__)

Endpoint = Literal["/v1/completions", "/v1/chat/completions"]
ENDPOINTS: tuple[Endpoint, ...] = ("/v1/completions", "/v1/chat/completions")
_MAX_ERROR_CHARS = 2000
SERVER_TIMING_HEADER = "x-splitserve-timing"  # gateway/request_log.py writes it


@dataclass(slots=True)
class RequestRecord:
    """What one request measured. Times are seconds; ``start_time`` is from the start of the run."""

    prompt_len: int
    output_len: int  # max_tokens asked for
    workload: str = ""
    start_time: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float | None = None
    output_tokens: int | None = None  # from the usage chunk; None when the server sent none
    num_content_chunks: int = 0
    generated_text: str = ""
    error: str | None = None
    # Where the server says the request's time went (splitserve's x-splitserve-timing header:
    # its TTFT and the TTFT's phases, seconds); None from a server that sends no such header.
    server_timing: dict[str, float] | None = None
    # The server's gap before each content chunk that ``itl`` times (seconds, same length), from
    # when it wrote them; None from a server that sends no chunk times (bench/token_gaps.py).
    server_itl: list[float] | None = None

    @property
    def success(self) -> bool:
        return self.error is None


def build_payload(
    endpoint: Endpoint, model: str, request: SampleRequest, ignore_eos: bool, extra_body: dict[str, Any] | None = None
) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": model}
    if endpoint == "/v1/chat/completions":
        messages = [{"role": "user", "content": request.prompt}]
        if request.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": request.system_prompt})
        payload["messages"] = messages
    else:
        payload["prompt"] = (request.system_prompt or "") + request.prompt
    payload.update(max_tokens=request.output_len, stream=True, stream_options={"include_usage": True})
    if ignore_eos:
        payload["ignore_eos"] = True
    payload.update(extra_body or {})
    return payload


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def request_headers(api_key: str | None) -> dict[str, str]:
    """A generation request's headers: the key, and the ask for splitserve's chunk times
    (other servers ignore a header they do not know)."""
    return auth_headers(api_key) | {CHUNK_TIMES_HEADER: "1"}


class StreamAccumulator:
    """Turns timed SSE events into a ``RequestRecord``; ``sent_at`` is the perf_counter at send."""

    def __init__(self, record: RequestRecord, sent_at: float) -> None:
        self.record = record
        self._sent_at = sent_at
        self._last_content_at: float | None = None
        self._done = False
        self._text_parts: list[str] = []
        self._num_data_events = 0  # before [DONE]: what the server's chunk times count
        self._content_events: list[int] = []  # positions of the content chunks among them
        self._chunk_times_ms: list[float] | None = None

    def on_event(self, event: SSEEvent, now: float) -> bool:
        """Account one event received at ``now``; False once the stream is over (done or failed)."""
        if self._done or self.record.error is not None:
            return False
        if event.data == "[DONE]":
            self._done = True
            return False
        self._num_data_events += 1
        try:
            chunk = json.loads(event.data)
        except json.JSONDecodeError:
            self._fail(f"malformed SSE data: {event.data[:200]!r}")
            return False
        if event.event == "error" or (isinstance(chunk, dict) and chunk.get("error")):
            error = chunk.get("error", chunk) if isinstance(chunk, dict) else chunk
            message = error.get("message", error) if isinstance(error, dict) else error
            self._fail(f"error in stream: {message}")
            return False
        if not isinstance(chunk, dict):
            self._fail(f"unexpected SSE data: {event.data[:200]!r}")
            return False
        if isinstance(usage := chunk.get("usage"), dict):
            if isinstance(completion_tokens := usage.get("completion_tokens"), int):
                self.record.output_tokens = completion_tokens
            if isinstance(prompt_tokens := usage.get("prompt_tokens"), int):
                self.record.prompt_len = prompt_tokens
        text = "".join(_choice_text(choice) for choice in chunk.get("choices") or [] if isinstance(choice, dict))
        if text:
            self._on_content(text, now)
        return True

    def on_comment(self, text: str) -> None:
        """Keep the server's chunk times if ``text`` is their comment; other comments (pings) are nothing."""
        times = parse_chunk_times(text)
        if times is not None:
            self._chunk_times_ms = times

    def finish(self) -> RequestRecord:
        """Close the record when the stream ended (or broke); idempotent."""
        record = self.record
        record.generated_text = "".join(self._text_parts)
        if record.error is None and not self._done:
            record.error = "the stream ended before data: [DONE]"
        elif record.error is None and record.num_content_chunks == 0:
            record.error = "the stream carried no content (no token text)"
        times = self._chunk_times_ms
        # Paired by position: only when the server counted exactly the events read here.
        if record.error is None and times is not None and len(times) == self._num_data_events:
            record.server_itl = server_gaps(times, self._content_events)
        return record

    def fail(self, message: str) -> None:
        self._fail(message)

    def _on_content(self, text: str, now: float) -> None:
        record = self.record
        if self._last_content_at is None:
            record.ttft = now - self._sent_at
        else:
            record.itl.append(now - self._last_content_at)
        self._content_events.append(self._num_data_events - 1)
        self._last_content_at = now
        record.latency = now - self._sent_at
        record.num_content_chunks += 1
        self._text_parts.append(text)

    def _fail(self, message: str) -> None:
        if self.record.error is None:
            self.record.error = message[:_MAX_ERROR_CHARS]


def parse_server_timing(header: str | None) -> dict[str, float] | None:
    """``x-splitserve-timing``'s ``name=seconds`` pairs (``ttft=0.1, gateway_queue=0.001, ...``);
    None when absent or malformed (a benchmark of another server, or of an older splitserve)."""
    if not header:
        return None
    timing: dict[str, float] = {}
    for pair in header.split(","):
        name, _, value = pair.strip().partition("=")
        try:
            timing[name] = float(value)
        except ValueError:
            return None
    return timing or None


def _choice_text(choice: dict[str, Any]) -> str:
    if isinstance(text := choice.get("text"), str):
        return text
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return ""
    parts = (delta.get("reasoning_content"), delta.get("reasoning"), delta.get("content"))
    return "".join(part for part in parts if isinstance(part, str))


async def send_request(
    session: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str],
    payload: dict[str, Any],
    record: RequestRecord,
    run_started_at: float,
    before_read: Callable[[], Awaitable[None]] | None = None,
) -> RequestRecord:
    """POST ``payload`` and stream the answer into ``record``; never raises but for cancellation.
    ``before_read`` is awaited before each read of the body (a test starves the client with it,
    as a busy CPU would).

    A request the server disconnects before answering at all is sent once more, on a new
    connection: a server may close a kept-alive connection between two requests (llama.cpp's
    llama-server does, every other request of a single stream), and the pool hands it out
    before it sees the close. Its time counts from the first send."""
    sent_at = time.perf_counter()
    record.start_time = sent_at - run_started_at
    stream = StreamAccumulator(record, sent_at)
    for attempt in range(2):
        answered = False
        try:
            async with session.post(url, json=payload, headers=headers) as response:
                answered = True
                await _read_answer(response, stream, before_read)
            break
        except aiohttp.ServerDisconnectedError as error:
            if answered or attempt:
                stream.fail(f"{type(error).__name__}: {error}")
                break
        except TimeoutError:
            stream.fail("timed out (--request-timeout)")
            break
        except (aiohttp.ClientError, OSError) as error:
            stream.fail(f"{type(error).__name__}: {error}")
            break
    return stream.finish()


async def _read_answer(
    response: aiohttp.ClientResponse, stream: StreamAccumulator, before_read: Callable[[], Awaitable[None]] | None
) -> None:
    if response.status != 200:
        body = (await response.text(errors="replace"))[:_MAX_ERROR_CHARS]
        stream.fail(f"HTTP {response.status} {response.reason}: {body}")
        return
    stream.record.server_timing = parse_server_timing(response.headers.get(SERVER_TIMING_HEADER))
    decoder = SSEDecoder(on_comment=stream.on_comment)
    # Read to the end even after [DONE], so the connection goes back to the pool
    # instead of being closed half-read (a new connection would tax the next TTFT).
    while True:
        if before_read is not None:
            await before_read()
        data = await response.content.readany()
        if not data:
            break
        now = time.perf_counter()
        for event in decoder.feed(data):
            stream.on_event(event, now)
    now = time.perf_counter()
    for event in decoder.close():
        stream.on_event(event, now)


@dataclass(frozen=True, slots=True)
class ServedModel:
    """A model ``GET /v1/models`` lists: its id, and its ``root`` where the server says it (vLLM
    gives the folder it loaded the model from there; splitserve its served name, which is that
    folder when ``--model`` names one and no ``--served-model-name`` is given)."""

    model_id: str
    root: str | None


async def fetch_model(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> ServedModel:
    """The first model ``GET /v1/models`` lists."""
    url = f"{base_url}/v1/models"
    try:
        async with session.get(url, headers=headers) as response:
            if response.status != 200:
                body = (await response.text(errors="replace"))[:500]
                raise ValueError(
                    f"GET {url} answered {response.status}: {body}; pass --model NAME"
                    + (" or --api-key" if response.status in (401, 403) else "")
                )
            listing = await response.json(content_type=None)
    except (aiohttp.ClientError, OSError, TimeoutError, json.JSONDecodeError) as error:
        raise ValueError(
            f"cannot list models at {url} ({error}); is the server up at --base-url? Or pass --model NAME"
        ) from error
    models = listing.get("data") if isinstance(listing, dict) else None
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise ValueError(f"{url} lists no models; pass --model NAME")
    root = models[0].get("root")
    return ServedModel(str(models[0]["id"]), str(root) if root else None)
