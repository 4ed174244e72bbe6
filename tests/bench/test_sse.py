"""SSE decoding and the timing of streamed chunks, on synthetic bytes and clocks."""

from __future__ import annotations

import json

import pytest

from bench.client import RequestRecord, StreamAccumulator
from bench.sse import SSEDecoder, SSEEvent


def _feed_in_pieces(stream: bytes, size: int) -> list[SSEEvent]:
    decoder = SSEDecoder()
    events = []
    for start in range(0, len(stream), size):
        events += decoder.feed(stream[start : start + size])
    return events + decoder.close()


STREAM = (
    ": keep-alive ping\r\n\r\n"
    'data: {"choices": [{"text": "caf\u00e9 \u65e5\u672c"}]}\r\n\r\n'
    "event: error\n"
    'data: {"a":\n'
    "data: 1}\n\n"
    "data:no-space\r\r"
    "data: [DONE]\n\n"
).encode()


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(STREAM)])
def test_decoder_gives_the_same_events_however_the_bytes_are_split(size: int) -> None:
    # Splits land inside CRLF pairs and inside multi-byte UTF-8 characters.
    assert _feed_in_pieces(STREAM, size) == [
        SSEEvent('{"choices": [{"text": "caf\u00e9 \u65e5\u672c"}]}'),
        SSEEvent('{"a":\n1}', event="error"),
        SSEEvent("no-space"),
        SSEEvent("[DONE]"),
    ]


def test_decoder_waits_for_the_blank_line_and_close_flushes_an_unterminated_event() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b'data: {"x": 1}\n') == []
    assert decoder.feed(b"\n") == [SSEEvent('{"x": 1}')]
    assert decoder.feed(b"data: [DONE]") == []
    assert decoder.close() == [SSEEvent("[DONE]")]


def _data(chunk: dict | str) -> SSEEvent:
    return SSEEvent(chunk if isinstance(chunk, str) else json.dumps(chunk))


def _completion(text: str, finish_reason: str | None = None) -> SSEEvent:
    return _data({"choices": [{"index": 0, "text": text, "finish_reason": finish_reason}]})


def _run(events: list[tuple[float, SSEEvent]], sent_at: float = 10.0) -> RequestRecord:
    stream = StreamAccumulator(RequestRecord(prompt_len=5, output_len=3), sent_at)
    for now, event in events:
        stream.on_event(event, now)
    return stream.finish()


def test_completion_stream_times_ttft_itl_and_latency_on_content_chunks() -> None:
    usage = {"choices": [], "usage": {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9}}
    record = _run(
        [
            (10.25, _completion(" a")),
            (10.35, _completion(" b")),
            (10.60, _completion(" c")),
            (10.70, _completion("", "length")),  # finish chunk: no token, times nothing
            (10.71, _data(usage)),
            (10.72, _data("[DONE]")),
        ]
    )
    assert record.success and record.error is None
    assert record.ttft == pytest.approx(0.25)
    assert record.itl == pytest.approx([0.10, 0.25])
    assert record.latency == pytest.approx(0.60)
    assert record.output_tokens == 3 and record.prompt_len == 6  # the server's usage wins
    assert record.generated_text == " a b c" and record.num_content_chunks == 3


def test_chat_role_delta_is_not_the_first_token() -> None:
    def delta(**fields: str) -> SSEEvent:
        return _data({"choices": [{"index": 0, "delta": fields, "finish_reason": None}]})

    record = _run(
        [
            (10.01, delta(role="assistant", content="")),
            (10.50, delta(content="Hi")),
            (10.60, delta(reasoning_content="hmm")),
            (10.80, delta(content="!")),
            (10.81, _data("[DONE]")),
        ]
    )
    assert record.success
    assert record.ttft == pytest.approx(0.50)
    assert record.itl == pytest.approx([0.10, 0.20])
    assert record.output_tokens is None  # no usage chunk: counted later
    assert record.generated_text == "Hihmm!"


@pytest.mark.parametrize(
    ("events", "error"),
    [
        ([_completion(" a"), _data({"error": {"message": "engine died", "type": "server_error"}})], "engine died"),
        ([_completion(" a"), SSEEvent('{"message": "overloaded"}', event="error")], "overloaded"),
        ([_completion(" a"), SSEEvent("{not json")], "malformed SSE data"),
        ([_completion(" a")], "before data: [DONE]"),
        ([_completion("", "length"), _data("[DONE]")], "no content"),
    ],
)
def test_broken_streams_fail_with_their_error(events: list[SSEEvent], error: str) -> None:
    record = _run([(11.0 + i, event) for i, event in enumerate(events)])
    assert not record.success
    assert error in record.error


def test_events_after_done_are_ignored() -> None:
    record = _run([(10.1, _completion(" a")), (10.2, _data("[DONE]")), (10.3, _completion(" late"))])
    assert record.success and record.generated_text == " a" and record.itl == []
