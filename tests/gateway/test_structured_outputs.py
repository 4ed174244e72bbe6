"""Structured outputs through the gateway, with the official ``openai`` client and over
gRPC, in front of a real prefill and decode instance (tiny random model, KV over UCX):
random weights write JSON only because the grammar makes them. A bad schema, regex or
grammar is a 400 naming it, before any instance is touched."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import jsonschema
import openai
import pytest

from gateway.dispatch_request import DispatchRequest, TokenEvent
from splitserve.v1 import generation_pb2, generation_pb2_grpc
from tests.engine.test_structured_output import GRAMMAR, GRAMMAR_TEXT, PERSON, REGEX
from tests.gateway.inprocess import MODEL_NAME, InProcessGateway, make_chat_checkpoint, run_inprocess
from tests.services.processes import Service

pytest.importorskip("ucxx")

CHAT = [{"role": "user", "content": "Who is the user?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_checkpoint(tmp_path_factory.mktemp("llama-chat"), slow_loops=False)


def openai_client(gateway: InProcessGateway) -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=gateway.app)
    http_client = httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=60)
    return openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="unused", http_client=http_client, max_retries=0)


def test_the_openai_client_gets_output_in_the_requested_format(model: Path, instances: tuple[Service, Service]) -> None:
    async def scenario(gateway: InProcessGateway) -> None:
        client = openai_client(gateway)
        response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
        for seed in range(3):
            chat = await client.chat.completions.create(
                model=MODEL_NAME,
                messages=CHAT,
                max_tokens=100,
                temperature=1.0,
                seed=seed,
                response_format=response_format,  # type: ignore[arg-type]
            )
            assert chat.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(chat.choices[0].message.content or ""), PERSON)

        stream = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=CHAT,
            max_tokens=100,
            temperature=0.0,
            response_format=response_format,
            stream=True,  # type: ignore[arg-type]
        )
        text, reasons = "", []
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                reasons.append(chunk.choices[0].finish_reason)
        assert reasons[-1] == "stop"
        jsonschema.validate(json.loads(text), PERSON)

        for extra_body, check in (
            ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
            ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
            ({"guided_grammar": GRAMMAR}, GRAMMAR_TEXT.fullmatch),
            ({"structured_outputs": {"json": PERSON}}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
            ({"response_format": {"type": "json_object"}}, lambda t: t.startswith("{")),
        ):
            completion = await client.completions.create(
                model=MODEL_NAME, prompt="The quick brown fox", max_tokens=100, temperature=0.0, extra_body=extra_body
            )
            choice = completion.choices[0]
            assert check(choice.text), (extra_body, choice.text)
            assert choice.finish_reason == "stop" or "response_format" in extra_body, (extra_body, choice)
        await client.close()

    run_inprocess(instances, model, scenario)


def test_a_concurrent_mixed_batch_through_prefill_and_decode_all_parses(
    model: Path, instances: tuple[Service, Service]
) -> None:
    """Constrained and free requests decode in the same batches on D: each keeps its own format."""
    formats: list[tuple[dict[str, object], object]] = [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
            lambda t: jsonschema.validate(json.loads(t), PERSON) is None,
        ),
        ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
        ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
        ({"structured_outputs": {"grammar": GRAMMAR}}, GRAMMAR_TEXT.fullmatch),
        ({"ignore_eos": True}, lambda t: True),  # free: runs to max_tokens
    ]

    async def scenario(gateway: InProcessGateway) -> None:
        client = openai_client(gateway)

        async def one(index: int) -> None:
            extra_body, check = formats[index % len(formats)]
            completion = await client.completions.create(
                model=MODEL_NAME,
                prompt=f"The quick brown fox {index}",
                max_tokens=100,
                temperature=1.0,
                seed=index,
                extra_body=extra_body,
            )
            choice = completion.choices[0]
            assert check(choice.text), (extra_body, choice.text)  # type: ignore[operator]
            assert choice.finish_reason == ("length" if "ignore_eos" in extra_body else "stop"), (extra_body, choice)

        gateway.service.slots.max_pending = 20  # one client holds three quarters of them: 15
        await asyncio.gather(*(one(i) for i in range(15)))
        await client.close()

    run_inprocess(instances, model, scenario)


def test_a_grammar_cut_short_finishes_with_length(model: Path, instances: tuple[Service, Service]) -> None:
    async def scenario(gateway: InProcessGateway) -> None:
        response = await gateway.client.post(
            "/v1/completions", json={"prompt": "The quick", "max_tokens": 4, "temperature": 0, "guided_regex": "b{100}"}
        )
        choice = response.json()["choices"][0]
        assert (choice["finish_reason"], choice["text"]) == ("length", choice["text"][:1] * len(choice["text"]))

    run_inprocess(instances, model, scenario)


# (body fields, the error's param, words the message must have)
BAD: list[tuple[dict[str, object], str, str]] = [
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
        "response_format.json_schema.schema",
        "strin",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
        "needs json_schema.schema",
    ),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ({"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs.regex", "regex"),
    ({"guided_grammar": 'root ::= "a" missing'}, "guided_grammar", "missing"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"structured_outputs": {}}, "structured_outputs", "is empty"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag is not supported"),
    (
        {"guided_regex": "a", "response_format": {"type": "json_object"}},
        "guided_regex",
        "one structured output per request",
    ),
]


def test_a_bad_format_is_a_400_naming_it_before_any_instance_is_touched(
    model: Path, instances: tuple[Service, Service]
) -> None:
    async def scenario(gateway: InProcessGateway) -> None:
        async def refuse(request: DispatchRequest) -> AsyncIterator[TokenEvent]:
            raise AssertionError(f"{request.request_id} reached the dispatcher")
            yield  # an async generator, as the dispatcher's

        gateway.service.dispatcher.generate = refuse  # type: ignore[method-assign]
        for fields, param, words in BAD:
            for path, body in (
                ("/v1/completions", {"prompt": "hi", "max_tokens": 4, **fields}),
                ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, **fields}),
            ):
                response = await gateway.client.post(path, json=body)
                assert response.status_code == 400, (fields, response.text)
                error = response.json()["error"]
                assert error["param"] == param and words in error["message"], (fields, error)
        stub = generation_pb2_grpc.GenerationStub(gateway.grpc_channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in stub.Generate(
                generation_pb2.GenerateRequest(text="hi", sampling=generation_pb2.SamplingParams(regex="a(b"))
            ):
                pass
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.regex" in (
            refused.value.details() or ""
        )
        assert gateway.service.num_pending == 0

    run_inprocess(instances, model, scenario)


def test_grpc_generate_takes_a_format_in_its_sampling_oneof(model: Path, instances: tuple[Service, Service]) -> None:
    async def scenario(gateway: InProcessGateway) -> None:
        stub = generation_pb2_grpc.GenerationStub(gateway.grpc_channel)
        for sampling, check in (
            (
                generation_pb2.SamplingParams(temperature=0.0, max_tokens=100, json_schema=json.dumps(PERSON)),
                lambda t: jsonschema.validate(json.loads(t), PERSON) is None,
            ),
            (
                generation_pb2.SamplingParams(
                    temperature=0.0, max_tokens=100, choice=generation_pb2.Choices(choices=["up", "down"])
                ),
                lambda t: t in ("up", "down"),
            ),
        ):
            responses = [
                r
                async for r in stub.Generate(
                    generation_pb2.GenerateRequest(text="The quick brown fox", sampling=sampling)
                )
            ]
            text = "".join(r.text for r in responses)
            assert responses[-1].finish_reason == "stop" and check(text), text

    run_inprocess(instances, model, scenario)
