"""The large-body check's worker processes (gateway/body_check.py), run for real: what they
refuse and why, and a worker that dies (killed for memory, say) costs the request it was
checking a 503, never the gateway its checks: the next body gets new workers."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.body_check import BodyCheck, check_body, count_json
from gateway.errors import APIError
from gateway.protocol import ChatCompletionRequest, CompletionRequest, TokenizeCompletionRequest


def test_values_and_objects_are_counted_until_past_a_limit() -> None:
    assert count_json({"a": [1, 2, {"b": None}], "c": "x"}, 100, 100) == (7, 2)
    assert count_json([[1] * 10] * 10, 5, 5) == (6, 0)  # stops once past the limit of values
    assert count_json([{}] * 10, 100, 3) == (5, 4)  # or of objects


def test_check_body_refuses_what_fastapi_would_and_what_holds_too_much() -> None:
    assert check_body(CompletionRequest, b'{"prompt": [1, 2, 3]}', 100) is None
    too_many = check_body(CompletionRequest, json.dumps({"prompt": [1] * 200}).encode(), 100)
    assert too_many is not None and too_many.code == "request_too_complex" and "100" in too_many.message
    many_objects = json.dumps({"messages": [{"role": "user", "content": "x"}] * 10}).encode()
    assert check_body(ChatCompletionRequest, many_objects, 64) is not None  # 11 objects: over a sixteenth of 64
    invalid = check_body(CompletionRequest, b'{"prompt": [null, null]}', 100)
    assert invalid is not None and invalid.param == "prompt"
    not_json = check_body(CompletionRequest, b'{"prompt": ', 100)
    assert not_json is not None and "not valid JSON" in not_json.message
    # /tokenize's two shapes: "messages" makes it the chat one.
    assert check_body(TokenizeCompletionRequest, b'{"messages": [{"role": "user", "content": "hi"}]}', 100) is None


def test_a_dead_worker_costs_one_check_a_503_and_the_next_gets_new_workers() -> None:
    async def scenario() -> None:
        check = BodyCheck(max_values=1000)
        try:
            assert await check.run(CompletionRequest, b'{"prompt": "hi"}', "client") is None  # the workers run now
            for process in list(check._processes._processes.values()):  # type: ignore[union-attr]
                process.kill()
            with pytest.raises(APIError) as failed:
                await check.run(CompletionRequest, b'{"prompt": "hi"}', "client")
            assert failed.value.status == 503 and failed.value.code == "body_check_failed"
            assert await check.run(CompletionRequest, b'{"prompt": [1, 2]}', "client") is None
            refused = await check.run(CompletionRequest, json.dumps({"prompt": [1] * 2000}).encode(), "client")
            assert refused is not None and refused.code == "request_too_complex"
        finally:
            check.close()

    asyncio.run(scenario())


def test_only_bodies_that_may_hold_many_values_go_to_a_worker() -> None:
    from gateway.body_check import INLINE_MAX_BYTES, INLINE_MAX_VALUES, max_json_values, needs_worker

    document = {"a": [1, 2, {"b": None}], "c": "x"}
    assert max_json_values(json.dumps(document).encode()) >= count_json(document, 100, 100)[0]
    long_text = json.dumps({"model": "m", "prompt": "word " * INLINE_MAX_BYTES, "max_tokens": 16}).encode()
    assert len(long_text) > INLINE_MAX_BYTES and not needs_worker(long_text)  # one long string: parsed inline
    many_ids = json.dumps({"model": "m", "prompt": list(range(INLINE_MAX_VALUES))}).encode()
    assert needs_worker(many_ids)
    small = json.dumps({"prompt": [1] * 100}).encode()
    assert not needs_worker(small)
    # Separators inside strings count too: text full of commas goes to a worker (never the other way).
    assert needs_worker(json.dumps({"prompt": ", " * INLINE_MAX_BYTES}).encode())


def test_no_process_starts_before_the_first_large_body() -> None:
    """A gateway that never sees a large body runs no worker, nor multiprocessing's resource
    tracker (which a process pool's queues start at once). In a fresh interpreter: another
    test's pool may have started this one's tracker already."""
    import subprocess
    import sys

    script = (
        "import psutil\n"
        "from gateway.body_check import BodyCheck\n"
        "check = BodyCheck(max_values=1000)\n"
        "print(len(psutil.Process().children(recursive=True)))\n"
        "check.close()\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "0", result.stderr
