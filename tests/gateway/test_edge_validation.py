"""The public edge refuses what it cannot serve with a 4xx in OpenAI's shape, naming
the field or the limit, and never loses capacity to it: integers beyond the wire
types, non-finite floats, chat-template keywords, oversized bodies, prompts and
stop lists, a nonzero priority while priority is off. A failure nobody expected
ends a stream with an error event (REST) or INTERNAL (gRPC), and every path
gives the request's pending slot back.

The gateway runs in the test's loop (``tests.gateway.inprocess``) in front of a
real prefill and decode instance (tiny random model, KV over UCX)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from gateway.chat_template import RenderStopped
from gateway.dispatch_request import DispatchRequest, TokenEvent
from gateway.limits import RequestLimits
from splitserve.v1 import generation_pb2, generation_pb2_grpc
from tests.gateway.inprocess import InProcessGateway, make_chat_checkpoint, run_inprocess
from tests.services.processes import Service

pytest.importorskip("ucxx")

LIMITS = RequestLimits(
    max_body_bytes=64 << 10,
    max_prompts=8,
    max_prompt_chars=2000,
    max_stop=4,
    max_stop_chars=16,
    chat_template_timeout_s=0.5,
)
GOOD = {"prompt": "The capital of France is", "max_tokens": 8, "ignore_eos": True, "temperature": 0}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
BIG = 2**31

# (path, JSON body or raw bytes, status, the error's param)
HOSTILE: list[tuple[str, dict[str, object] | bytes, int, str | None]] = [
    ("/v1/completions", {**GOOD, "top_k": BIG}, 400, "top_k"),
    ("/v1/completions", {**GOOD, "seed": 2**63}, 400, "seed"),
    ("/v1/completions", {**GOOD, "seed": -(2**63) - 1}, 400, "seed"),
    ("/v1/completions", {**GOOD, "stop_token_ids": [BIG]}, 400, "stop_token_ids.0"),
    ("/v1/chat/completions", {"messages": CHAT, "min_tokens": BIG}, 400, "min_tokens"),
    ("/v1/completions", {**GOOD, "priority": 2**40}, 400, "priority"),
    ("/v1/completions", {**GOOD, "priority": -BIG - 1}, 400, "priority"),
    ("/v1/completions", {**GOOD, "priority": 1}, 400, "priority"),  # priority is off
    ("/v1/completions", {**GOOD, "max_tokens": BIG}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "n": BIG}, 400, "n"),
    ("/v1/completions", {**GOOD, "logprobs": BIG}, 400, "logprobs"),
    ("/v1/completions", {**GOOD, "best_of": BIG}, 400, "best_of"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": BIG}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": BIG}, 400, "max_completion_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": Infinity}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "top_p": NaN}', 400, "top_p"),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": -Infinity}',
        400,
        "frequency_penalty",
    ),
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"5": Infinity}}', 400, "logit_bias.5"),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}},
        400,
        "chat_template_kwargs.tokenize",
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "chat_template_kwargs": {"chat_template": "INJECTED {{ 7*7 }}"}},
        400,
        "chat_template_kwargs.chat_template",
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "chat_template_kwargs": {"messages": []}},
        400,
        "chat_template_kwargs.messages",
    ),
    (
        "/tokenize",
        {"messages": CHAT, "chat_template_kwargs": {"chat_template": "INJECTED {{ 7*7 }}"}},
        400,
        "chat_template_kwargs.chat_template",
    ),
    ("/v1/completions", {**GOOD, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {**GOOD, "stop": "x" * 17}, 400, "stop"),
    ("/v1/completions", {**GOOD, "stop_token_ids": [1, 2, 3, 4, 5]}, 400, "stop_token_ids"),
    ("/v1/completions", {**GOOD, "prompt": "x" * 2001}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": ["hi"] * 9}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [[5, 6]] * 9}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [2**40]}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "cache_salt": ""}, 400, "cache_salt"),
    ("/v1/completions", {**GOOD, "prompt": "hi " * 30_000}, 413, None),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_checkpoint(tmp_path_factory.mktemp("llama-chat"))


async def post(gateway: InProcessGateway, path: str, body: dict[str, object] | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return await gateway.client.post(path, content=body, headers={"content-type": "application/json"})
    return await gateway.client.post(path, json=body)


def assert_error(response: httpx.Response, status: int, param: str | None) -> dict[str, object]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["param"] == param, error
    return error


def test_thousands_of_hostile_requests_get_400_and_give_their_slots_back(
    model: Path, instances: tuple[Service, Service]
) -> None:
    """Each holds a pending slot from the gate on (gateway/gate.py), and gives it back."""

    async def scenario(gateway: InProcessGateway) -> None:
        rounds = 100  # 3,100 requests, 50 at a time
        for _ in range(rounds):
            for batch_start in range(0, len(HOSTILE), 50):
                batch = HOSTILE[batch_start : batch_start + 50]
                responses = await asyncio.gather(*(post(gateway, path, body) for path, body, _, _ in batch))
                for (_, _, status, param), response in zip(batch, responses, strict=True):
                    assert_error(response, status, param)
        assert gateway.service.num_pending == 0
        # Every slot free again: a good request runs.
        good = await post(gateway, "/v1/completions", GOOD)
        assert good.status_code == 200, good.text
        assert good.json()["usage"]["completion_tokens"] == GOOD["max_tokens"]
        assert gateway.service.num_pending == 0
        metrics = (await gateway.client.get("/metrics")).text
        assert "splitserve_num_pending_requests 0.0" in metrics

    # A slot for each request of a batch, which all arrive at once.
    run_inprocess(instances, model, scenario, LIMITS, max_pending_requests=len(HOSTILE))


def test_a_hundred_thousand_prompts_is_a_400(model: Path, instances: tuple[Service, Service]) -> None:
    """Refused before any work: no prompt is tokenized, nothing dispatched."""

    async def scenario(gateway: InProcessGateway) -> None:
        service = gateway.service
        tokenized: list[str] = []
        dispatched: list[DispatchRequest] = []
        encode, generate = service.tokenizer.encode, service.dispatcher.generate

        async def counted_encode(text: str, **options: Any) -> list[int]:
            tokenized.append(text)
            return await encode(text, **options)

        def counted_generate(request: DispatchRequest) -> AsyncIterator[TokenEvent]:
            dispatched.append(request)
            return generate(request)

        service.tokenizer.encode = counted_encode  # type: ignore[method-assign]
        service.dispatcher.generate = counted_generate  # type: ignore[method-assign]
        response = await post(gateway, "/v1/completions", {**GOOD, "prompt": ["a"] * 100_000})
        error = assert_error(response, 400, "prompt")
        assert error["code"] == "too_many_prompts" and "--max-prompts-per-request" in str(error["message"])
        assert tokenized == [] and dispatched == []
        # The counters see a request that gets through.
        assert (await post(gateway, "/v1/completions", {**GOOD, "prompt": ["a", "b"]})).status_code == 200
        assert tokenized == ["a", "b"] and len(dispatched) == 2

    # The default body limit (8 MiB) lets the 500 KB body through to the prompt limit.
    run_inprocess(instances, model, scenario, RequestLimits(max_prompts=LIMITS.max_prompts))


def test_a_chunked_body_over_the_limit_gets_413(model: Path, instances: tuple[Service, Service]) -> None:
    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the size is only known as it arrives
        yield b'{"prompt": "'
        for _ in range(LIMITS.max_body_bytes // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    async def scenario(gateway: InProcessGateway) -> None:
        response = await gateway.client.post(
            "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
        )
        assert "content-length" not in response.request.headers
        assert_error(response, 413, None)
        assert (await post(gateway, "/v1/completions", GOOD)).status_code == 200

    run_inprocess(instances, model, scenario, LIMITS)


def test_priority_is_honoured_only_when_enabled(model: Path, instances: tuple[Service, Service]) -> None:
    async def scenario(gateway: InProcessGateway) -> None:
        response = await post(gateway, "/v1/completions", {**GOOD, "priority": 5})
        assert response.status_code == 200, response.text
        assert_error(await post(gateway, "/v1/completions", {**GOOD, "priority": BIG}), 400, "priority")

    run_inprocess(instances, model, scenario, LIMITS, enable_priority=True)


def test_chat_template_kwargs(model: Path, instances: tuple[Service, Service]) -> None:
    async def tokens(gateway: InProcessGateway, **body: object) -> list[int]:
        response = await post(gateway, "/tokenize", {"messages": CHAT, **body})
        assert response.status_code == 200, response.text
        return response.json()["tokens"]

    async def text(gateway: InProcessGateway, **body: object) -> str:
        ids = await tokens(gateway, **body)
        return (await post(gateway, "/detokenize", {"tokens": ids})).json()["prompt"]

    async def scenario(gateway: InProcessGateway) -> None:
        assert await text(gateway) == "user: What is the capital of France?\nassistant:"
        # A variable the template reads passes; so do the two flags, overriding the request's fields.
        assert (
            await text(gateway, chat_template_kwargs={"enable_thinking": True})
            == "user: What is the capital of France?\nthink: assistant:"
        )
        assert (
            await text(gateway, chat_template_kwargs={"add_generation_prompt": False})
            == "user: What is the capital of France?\n"
        )
        # A key the template does not read is ignored (and logged), as unknown request fields are.
        assert await tokens(gateway, chat_template_kwargs={"no_such_variable": 1}) == await tokens(gateway)
        # Keywords that steer rendering or tokenizing, or names the renderer binds, are refused.
        for key, value in (
            ("tokenize", False),
            ("return_dict", False),
            ("chat_template", "{{ 7*7 }}"),
            ("bos_token", "x"),
            ("raise_exception", 1),
            ("padding", True),
        ):
            response = await post(
                gateway, "/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {key: value}}
            )
            assert_error(response, 400, f"chat_template_kwargs.{key}")
        assert_error(
            await post(gateway, "/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"tools": "x"}}),
            400,
            "chat_template_kwargs.tools",
        )
        assert_error(
            await post(
                gateway,
                "/v1/chat/completions",
                {"messages": CHAT, "chat_template_kwargs": {"continue_final_message": "yes"}},
            ),
            400,
            "chat_template_kwargs.continue_final_message",
        )
        # The template's own error (raise_exception) is the client's to fix.
        misplaced = [*CHAT, {"role": "system", "content": "late"}]
        error = assert_error(await post(gateway, "/v1/chat/completions", {"messages": misplaced}), 400, "messages")
        assert "the system message must come first" in str(error["message"])
        # A chat completion through the template still runs.
        response = await post(
            gateway,
            "/v1/chat/completions",
            {"messages": CHAT, "max_tokens": 4, "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": True}},
        )
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4, response.text
        assert gateway.service.num_pending == 0

    run_inprocess(instances, model, scenario, LIMITS)


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    """Wait for ``condition``; ``timeout_s`` is only a safety net against a hang, far past the wait."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what} after {timeout_s} s"
        await asyncio.sleep(0.01)


def test_a_slow_chat_template_times_out_off_the_event_loop(model: Path, instances: tuple[Service, Service]) -> None:
    async def scenario(gateway: InProcessGateway) -> None:
        chat_template = gateway.service.tokenizer.chat_template
        render = chat_template._render
        loop_thread = threading.get_ident()
        render_threads: list[int] = []
        outcomes: list[BaseException | str] = []
        rendered = threading.Event()

        def observed_render(conversation: list[dict[str, Any]], kwargs: dict[str, Any], stop: threading.Event) -> str:
            render_threads.append(threading.get_ident())
            try:
                text = render(conversation, kwargs, stop)
            except BaseException as error:
                outcomes.append(error)
                raise
            else:
                outcomes.append(text)
                return text
            finally:
                rendered.set()

        chat_template._render = observed_render  # type: ignore[method-assign]
        # 100 million Jinja loop turns (the sandbox's largest range, a thousand times over): many seconds
        # on any machine against a limit of half a second, so only the time limit can end this render.
        body = {"messages": CHAT, "chat_template_kwargs": {"slow_loops": 100_000}}
        slow = asyncio.create_task(post(gateway, "/v1/chat/completions", body))
        await until(lambda: bool(render_threads), "the render to start")
        # The loop is free while the template renders: it answers, and the render is on another thread.
        assert (await gateway.client.get("/health")).status_code == 200
        response = await slow
        error = assert_error(response, 400, "messages")
        assert "--chat-template-timeout" in str(error["message"])
        assert render_threads and loop_thread not in render_threads, (render_threads, loop_thread)
        # The render stopped at the time limit rather than running its loops out, freeing its worker.
        await until(rendered.is_set, "the render to return")
        assert len(outcomes) == 1 and isinstance(outcomes[0], RenderStopped), outcomes
        await until(lambda: gateway.service.tokenizer.pool.num_running == 0, "the render's worker to be free")

    run_inprocess(instances, model, scenario, LIMITS)


def _failing_dispatch(num_tokens: int):
    """Stands in for the dispatcher: streams a few tokens, then fails as a bug would."""

    async def generate(request: DispatchRequest) -> AsyncIterator[TokenEvent]:
        for token in range(num_tokens):
            yield TokenEvent(token_ids=[10 + token], logprobs=[])
        raise RuntimeError("a bug mid-stream")

    return generate


def test_an_unexpected_failure_mid_stream_ends_with_an_error_event(
    model: Path, instances: tuple[Service, Service]
) -> None:
    async def scenario(gateway: InProcessGateway) -> None:
        gateway.service.dispatcher.generate = _failing_dispatch(3)  # type: ignore[method-assign]
        response = await post(gateway, "/v1/completions", {**GOOD, "stream": True})
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and error["code"] == "internal_error" and "bug" in error["message"]
        assert len(events) == 3 + 2 and all(json.loads(e)["choices"] for e in events[:3])
        assert gateway.service.num_pending == 0
        # Not streaming: a 500 in OpenAI's shape.
        assert_error(await post(gateway, "/v1/completions", GOOD), 500, None)
        assert gateway.service.num_pending == 0
        # gRPC: INTERNAL with the same message, after the tokens that made it.
        stub = generation_pb2_grpc.GenerationStub(gateway.grpc_channel)
        call = stub.Generate(
            generation_pb2.GenerateRequest(text="hello", sampling=generation_pb2.SamplingParams(max_tokens=8))
        )
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            async for response_message in call:
                received.append(response_message)
        assert failed.value.code() == grpc.StatusCode.INTERNAL and "bug" in (failed.value.details() or "")
        assert len(received) == 3
        assert gateway.service.num_pending == 0

    run_inprocess(instances, model, scenario, LIMITS)


def test_grpc_refuses_non_finite_floats_and_disabled_priority(model: Path, instances: tuple[Service, Service]) -> None:
    async def scenario(gateway: InProcessGateway) -> None:
        stub = generation_pb2_grpc.GenerationStub(gateway.grpc_channel)
        for request in (
            generation_pb2.GenerateRequest(text="hi", sampling=generation_pb2.SamplingParams(temperature=float("inf"))),
            generation_pb2.GenerateRequest(
                text="hi", sampling=generation_pb2.SamplingParams(repetition_penalty=float("nan"))
            ),
            generation_pb2.GenerateRequest(text="hi", priority=3),
            generation_pb2.GenerateRequest(text="x" * 2001),
            generation_pb2.GenerateRequest(text="hi", sampling=generation_pb2.SamplingParams(stop=["a"] * 5)),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in stub.Generate(request):
                    pass
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request
        assert gateway.service.num_pending == 0

    run_inprocess(instances, model, scenario, LIMITS)
