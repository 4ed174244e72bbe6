"""An incremental decoder for ``text/event-stream`` (server-sent events), the way
OpenAI-compatible servers stream completions: bytes go in as the network delivers
them, complete events come out.

It follows the WHATWG event-stream rules: lines end in CRLF, LF or CR; a blank line
dispatches the event; ``data:`` lines of one event join with ``\\n``; lines starting
with ``:`` are comments (keep-alive pings, or splitserve's chunk times: bench/token_gaps.py),
handed to ``on_comment`` when one is given; one space after the colon is dropped.
Bytes are decoded as UTF-8 incrementally, so a character split across two network
reads is never mangled.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable
from dataclasses import dataclass

_LINE_END = re.compile(r"\r\n|\r|\n")


@dataclass(slots=True)
class SSEEvent:
    data: str
    event: str = "message"


class SSEDecoder:
    def __init__(self, on_comment: Callable[[str], None] | None = None) -> None:
        """``on_comment``: called with each comment line's text (without the colon and one
        space), as the line is read, so before the events of the same ``feed`` are returned."""
        self._on_comment = on_comment
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buffer = ""
        self._data_lines: list[str] = []
        self._event = "message"

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """The events that ``chunk`` completes, in order; partial lines wait for the next chunk."""
        self._buffer += self._utf8.decode(chunk)
        return self._drain(final=False)

    def close(self) -> list[SSEEvent]:
        """Events left when the stream ends. An event whose closing blank line never came is
        still returned (servers that close right after their last ``data:`` line exist)."""
        self._buffer += self._utf8.decode(b"", final=True)
        events = self._drain(final=True)
        if self._buffer:
            self._line(self._buffer, events)
            self._buffer = ""
        self._dispatch(events)
        return events

    def _drain(self, final: bool) -> list[SSEEvent]:
        events: list[SSEEvent] = []
        consumed = 0
        for match in _LINE_END.finditer(self._buffer):
            # A CR at the very end may be the first half of a CRLF split across reads.
            if not final and match.group() == "\r" and match.end() == len(self._buffer):
                break
            self._line(self._buffer[consumed : match.start()], events)
            consumed = match.end()
        self._buffer = self._buffer[consumed:]
        return events

    def _line(self, line: str, events: list[SSEEvent]) -> None:
        if not line:
            self._dispatch(events)
            return
        if line.startswith(":"):
            if self._on_comment is not None:
                self._on_comment(line[2:] if line.startswith(": ") else line[1:])
            return
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data_lines.append(value)
        elif field == "event":
            self._event = value
        # "id" and "retry" do not matter to a benchmark client.

    def _dispatch(self, events: list[SSEEvent]) -> None:
        if self._data_lines:
            events.append(SSEEvent(data="\n".join(self._data_lines), event=self._event))
        self._data_lines = []
        self._event = "message"
