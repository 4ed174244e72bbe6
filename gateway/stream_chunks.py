"""The SSE event of each streamed token, written without building a pydantic model for it.

A stream's chunks differ only in their text, finish reason and stop reason: the id, object,
creation time and model are the request's. The gateway frames every token of every stream,
so this is its hottest path: building a ``CompletionResponse`` (or ``ChatCompletionChunk``)
per token and serializing it cost more than the text itself. :class:`StreamChunks` renders
the request's constant head once and each chunk's variable tail with the standard library's
JSON encoder, byte for byte what the models in gateway/protocol.py serialize to (a test keeps
them equal); a chunk that carries logprobs, rare and costly anyway, still goes through the
models.

The creation time is the request's, in every chunk, as OpenAI sends it (the models' default
took a new time per chunk).
"""

from __future__ import annotations

import functools
import json
import time
from typing import Literal

# As pydantic-core writes strings: non-ASCII characters as they are, control characters escaped.
_json_text = functools.partial(json.dumps, ensure_ascii=False)


def _json(value: str | int | None) -> str:
    # Most chunks carry no finish or stop reason: "null" without the encoder.
    return "null" if value is None else _json_text(value)


ChunkObject = Literal["text_completion", "chat.completion.chunk"]


class StreamChunks:
    """One streamed request's chunk events (``data: {...}\\n\\n``)."""

    __slots__ = ("_head",)

    def __init__(self, completion_id: str, model_name: str, obj: ChunkObject) -> None:
        created = int(time.time())
        self._head = (
            f'data: {{"id":{_json(completion_id)},"object":"{obj}","created":{created},'
            f'"model":{_json(model_name)},"choices":[{{"index":'
        )

    def text(
        self, index: int, text: str, finish_reason: str | None = None, stop_reason: int | str | None = None
    ) -> str:
        """A completions chunk: ``choices[0]`` is prompt ``index``'s new text."""
        return (
            f'{self._head}{index},"text":{_json(text)},"logprobs":null,"finish_reason":{_json(finish_reason)},'
            f'"stop_reason":{_json(stop_reason)}}}],"usage":null}}\n\n'
        )

    def delta(
        self,
        content: str,
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
        role: Literal["assistant"] | None = None,
    ) -> str:
        """A chat chunk: the delta of the one choice."""
        return (
            f'{self._head}0,"delta":{{"role":{_json(role)},"content":{_json(content)}}},"logprobs":null,'
            f'"finish_reason":{_json(finish_reason)},"stop_reason":{_json(stop_reason)}}}],"usage":null}}\n\n'
        )
