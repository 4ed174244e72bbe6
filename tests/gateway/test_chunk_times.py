"""The gateway's chunk write times (gateway/chunk_times.py), over real HTTP from uvicorn: asked
for, a stream ends with one SSE comment holding one time per chunk written before it, from 0,
never decreasing, at least the instance's token gap apart between tokens; not asked for, the
stream is as before."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from gateway.chunk_times import CHUNK_TIMES_COMMENT, CHUNK_TIMES_HEADER
from tests.gateway.inprocess import make_chat_checkpoint
from tests.gateway.threaded import MODEL_NAME, paced_pool, served_gateway

NUM_TOKENS = 6
GAP_S = 0.01  # between the instance's tokens: a lower bound of the server's gap between their chunks


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_checkpoint(tmp_path_factory.mktemp("model"), slow_loops=False)


def _body(endpoint: str) -> dict[str, object]:
    prompt: dict[str, object] = (
        {"messages": [{"role": "user", "content": "hello"}]} if endpoint == "/v1/chat/completions" else {"prompt": "hi"}
    )
    return {"model": MODEL_NAME, "max_tokens": NUM_TOKENS, "stream": True, **prompt}


def _blocks(client: httpx.Client, endpoint: str, headers: dict[str, str], **body: object) -> list[str]:
    """The stream's SSE blocks (an event or a comment each), in order."""
    with client.stream("POST", endpoint, json=_body(endpoint) | body, headers=headers) as response:
        assert response.status_code == 200, response.read()
        text = response.read().decode()
    return [block for block in text.split("\n\n") if block]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_carries_one_write_time_per_chunk_only_when_asked(model: Path, endpoint: str) -> None:
    with served_gateway(model, paced_pool(NUM_TOKENS, GAP_S)) as url, httpx.Client(base_url=url, timeout=60) as client:
        asked = _blocks(client, endpoint, {CHUNK_TIMES_HEADER: "1"}, stream_options={"include_usage": True})
        plain = _blocks(client, endpoint, {})
        not_streamed = client.post(
            endpoint, json=_body(endpoint) | {"stream": False}, headers={CHUNK_TIMES_HEADER: "1"}
        )

    *chunks, comment, done = asked
    assert done == "data: [DONE]"
    assert all(chunk.startswith("data: {") for chunk in chunks)
    # Chat: the role chunk, then one chunk a token; completions: one a token; then the usage chunk.
    num_role = 1 if endpoint == "/v1/chat/completions" else 0
    assert len(chunks) == num_role + NUM_TOKENS + 1
    name, _, values = comment.removeprefix(": ").partition("=")
    assert comment.startswith(": ") and name == CHUNK_TIMES_COMMENT
    offsets_ms = [float(value) for value in values.split(",")]
    assert len(offsets_ms) == len(chunks)  # one per chunk written before the comment
    assert offsets_ms[0] == 0.0
    assert offsets_ms == sorted(offsets_ms)
    token_ms = offsets_ms[num_role : num_role + NUM_TOKENS]
    assert all(b - a >= GAP_S * 1000 for a, b in zip(token_ms, token_ms[1:])), offsets_ms

    assert not any(block.startswith(":") for block in plain)
    assert len(plain) == num_role + NUM_TOKENS + 1  # the tokens and [DONE]: no usage asked for
    assert not_streamed.status_code == 200 and CHUNK_TIMES_COMMENT not in not_streamed.text
