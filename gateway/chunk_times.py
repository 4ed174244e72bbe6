"""When the gateway wrote each chunk of a stream, for a client that asks: the server's side
of every token gap, so that a benchmark can tell a slow server from a client starved of CPU.

A client measures when it *read* a chunk; on a shared host a busy client reads late and
its gaps grow while the server's do not. The gateway's account, set beside the client's,
says which side a figure measures.

How it travels, and why:

- Asked with the request header ``x-splitserve-chunk-times: 1`` (any OpenAI client sends
  one through its ``extra_headers``). A header rather than a body field: it is about the
  transport, not the completion, and it means the same on both endpoints. Opt-in, because
  a few hand-written SSE readers (vLLM's benchmark client among them) parse every line
  after stripping ``data: `` and would choke on the line below.
- Answered with one SSE comment line after the last chunk, just before ``data: [DONE]``:
  ``: splitserve-chunk-times-ms=0.000,0.412,25.873,...``, the time each body chunk was
  handed to the ASGI ``send``, in milliseconds from the first one, one per chunk written
  before it (role, content, finish, usage and error chunks alike, in order). The client
  pairs them with the ``data:`` events it read, by position. A comment, because every SSE
  parser that follows the WHATWG rules (the OpenAI SDKs, browsers' EventSource) skips it.
  Not a response header: headers leave with the first token. Not an HTTP trailer (the
  Server-Timing spec allows one there): uvicorn sends no ASGI trailers and few clients
  read them. Not the request log line: it is written when the instances finish the
  request, before the last chunks go out, and no client can pair its gaps with a log.

A stream's path, in call order (all on the event loop):

1. The endpoint calls :func:`chunk_clock` with the request's headers: a :class:`ChunkClock`
   when asked, else None (and nothing below happens).
2. ``gateway/openai_common.sse_response`` answers with a :class:`ChunkTimedResponse`, whose
   ``send`` appends ``time.monotonic()`` as each non-empty body message is handed on: one
   float per chunk, nothing else per token.
3. After its last chunk (an error event included) the body generator yields
   :meth:`ChunkClock.comment`: by then every earlier chunk has gone through ``send``, since
   the response asks the generator for the next chunk only after sending the previous one.

The time is taken before ``send`` and so does not include waiting on a full socket: a
client that stops reading long enough to fill the socket buffers holds the server's later
chunks back too, and then both sides' gaps show it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, Mapping
from dataclasses import dataclass, field

from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

CHUNK_TIMES_HEADER = "x-splitserve-chunk-times"
CHUNK_TIMES_COMMENT = "splitserve-chunk-times-ms"
_ASKED = {"1", "true", "yes", "on"}


@dataclass(slots=True)
class ChunkClock:
    """The monotonic times at which one response's body chunks were handed to ``send``."""

    times: list[float] = field(default_factory=list)

    def comment(self) -> str:
        """The SSE comment line carrying the times so far, as ms offsets from the first."""
        first = self.times[0] if self.times else 0.0
        offsets = ",".join(f"{(t - first) * 1000:.3f}" for t in self.times)
        return f": {CHUNK_TIMES_COMMENT}={offsets}\n\n"


def chunk_clock(headers: Mapping[str, str]) -> ChunkClock | None:
    """A clock for a stream whose request asked for its chunk times; None otherwise."""
    value = headers.get(CHUNK_TIMES_HEADER)
    return ChunkClock() if value is not None and value.strip().lower() in _ASKED else None


class ChunkTimedResponse(StreamingResponse):
    """A ``StreamingResponse`` that records on ``clock`` when each body chunk is handed to ``send``."""

    def __init__(
        self,
        content: AsyncIterable[str],
        clock: ChunkClock,
        headers: Mapping[str, str] | None = None,
        media_type: str | None = None,
    ) -> None:
        super().__init__(content, headers=headers, media_type=media_type)
        self.clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        times = self.clock.times

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                times.append(time.monotonic())
            await send(message)

        await super().__call__(scope, receive, timed_send)
