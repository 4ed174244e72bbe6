"""The hand-written chunk events equal, byte for byte, what the protocol models serialize to,
for every kind of text the detokenizer hands over (quotes, backslashes, control characters,
non-ASCII, emoji, empty) and every finish and stop reason."""

from __future__ import annotations

import json

import pytest

from gateway.openai_common import sse
from gateway.protocol import ChatChunkChoice, ChatCompletionChunk, CompletionChoice, CompletionResponse, DeltaMessage
from gateway.stream_chunks import StreamChunks

TEXTS = ["", "Paris", ' "quoted" \\ back', "line\nfeed\ttab\r\x00\x01\x1f\x7f", "héllo 東京 🙂", "\u2028\u2029"]
ENDINGS = [(None, None), ("stop", None), ("stop", 42), ("stop", "###"), ("length", None), ("abort", None)]


@pytest.mark.parametrize("finish_reason, stop_reason", ENDINGS)
@pytest.mark.parametrize("text", TEXTS)
def test_a_completion_chunk_is_the_models_serialization(text: str, finish_reason: str | None, stop_reason) -> None:
    chunks = StreamChunks('cmpl-"id"', "Model/ñame", "text_completion")
    created = json.loads(chunks.text(0, "").removeprefix("data: "))["created"]
    for index in (0, 3):
        model = CompletionResponse(
            id='cmpl-"id"',
            model="Model/ñame",
            created=created,
            choices=[CompletionChoice(index=index, text=text, finish_reason=finish_reason, stop_reason=stop_reason)],
        )
        assert chunks.text(index, text, finish_reason, stop_reason) == sse(model)


@pytest.mark.parametrize("finish_reason, stop_reason", ENDINGS)
@pytest.mark.parametrize("text", TEXTS)
def test_a_chat_chunk_is_the_models_serialization(text: str, finish_reason: str | None, stop_reason) -> None:
    chunks = StreamChunks("chatcmpl-1", "m", "chat.completion.chunk")
    created = json.loads(chunks.delta("").removeprefix("data: "))["created"]

    def model(delta: DeltaMessage) -> str:
        choice = ChatChunkChoice(index=0, delta=delta, finish_reason=finish_reason, stop_reason=stop_reason)
        return sse(ChatCompletionChunk(id="chatcmpl-1", model="m", created=created, choices=[choice]))

    assert chunks.delta(text, finish_reason, stop_reason) == model(DeltaMessage(content=text))
    assert chunks.delta(text, finish_reason, stop_reason, role="assistant") == model(
        DeltaMessage(role="assistant", content=text)
    )
