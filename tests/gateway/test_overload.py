"""The gateway under overload and faults, over real prefill and decode processes: KV a
decode instance cannot pull goes back to prefill and the stream continues unchanged;
with --max-queue-delay, requests that would queue too long get 429 with Retry-After
at once. Free blocks are back to total on every instance afterwards."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc
from tests.checkpoints import LONG_MODEL_KV_MEMORY, LONG_PROMPT_TOKENS, random_prompts
from tests.gateway.processes import finish_stream, routes, running_gateway, stream_until
from tests.services.client import assert_all_free
from tests.services.processes import Service, running

pytest.importorskip("ucxx")

FLOAT32 = ["--dtype", "float32"]


@pytest.fixture(scope="module")
def prefill(long_model: Path) -> Iterator[Service]:
    with running("prefill", long_model, *LONG_MODEL_KV_MEMORY, *FLOAT32) as service:
        yield service


@pytest.fixture(scope="module")
def decode(long_model: Path) -> Iterator[Service]:
    """One sequence at a time, so a request can be held queued behind another."""
    with running("decode", long_model, *LONG_MODEL_KV_MEMORY, *FLOAT32, "--max-num-seqs", "1") as service:
        yield service


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = [float(line.split()[-1]) for line in text.splitlines() if re.match(rf"{name}(\{{.*\}})? ", line)]
    return sum(values)


def token_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    """Random prompts of token ids the gateway's tokenizer knows (its vocabulary is smaller than the model's)."""
    return [[token % 300 for token in prompt] for prompt in random_prompts(lengths, seed)]


def completion(prompt: list[int], max_tokens: int, stream: bool = False) -> dict[str, object]:
    return {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": stream}


def open_stream(url: str, body: dict[str, object]) -> tuple[httpx.Client, httpx.Response, dict[str, object]]:
    """A streaming completion and its first event; the rest is left in ``response.lines``."""
    client = httpx.Client(timeout=120)
    response = client.send(
        client.build_request("POST", f"{url}/v1/completions", json={**body, "stream": True}), stream=True
    )
    assert response.status_code == 200
    response.lines = response.iter_lines()  # type: ignore[attr-defined]
    first = next(line for line in response.lines if line.startswith("data: {"))  # type: ignore[attr-defined]
    return client, response, json.loads(first.removeprefix("data: "))


def test_kv_lost_on_prefill_is_prefilled_again_and_the_stream_is_unchanged(
    long_model: Path, prefill: Service, decode: Service
) -> None:
    busy_prompt, prompt = token_prompts([20, 70], seed=50)
    with running_gateway(long_model, *routes(prefill, decode)) as gateway:
        expected = httpx.post(f"{gateway.url}/v1/completions", json=completion(prompt, 12), timeout=120).json()
        busy_client, busy = stream_until(gateway.url, completion(busy_prompt, 3000), num_chunks=2)  # holds D's one slot
        client, response, first = open_stream(gateway.url, completion(prompt, 12))  # the first token, from P
        request_id = first["id"]  # the gateway's id for the request, which P pins its KV under
        # P loses the KV while the request waits on D (a restart, an operator, a bug): D learns it
        # at its next lease renewal and hands the request back; the gateway prefills it again.
        stub = disaggregation_pb2_grpc.PrefillStub(prefill.channel)
        assert stub.ReleaseKV(disaggregation_pb2.RequestRef(request_id=request_id)).released
        deadline = time.monotonic() + 120  # a safety net
        while metric(gateway.url, "splitserve_kv_reprefills_total") < 1:
            assert time.monotonic() < deadline, "the lost KV was never prefilled again"
            time.sleep(0.1)
        busy.close()
        busy_client.close()
        events = finish_stream(response)
        client.close()
        text = "".join(e["choices"][0]["text"] for e in [first, *events] if e.get("choices"))
        assert text == expected["choices"][0]["text"]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert metric(gateway.url, "splitserve_kv_recomputes_total") == 0
        counters = decode.load().counters
        assert counters.num_kv_handbacks == 1 and counters.num_kv_recomputes == 0
        assert prefill.load().counters.num_lease_expiries == 0
    assert_all_free(prefill, decode)


def test_max_queue_delay_refuses_at_once_with_retry_after(long_model: Path, prefill: Service, decode: Service) -> None:
    prompts = token_prompts([LONG_PROMPT_TOKENS] * 5, seed=51)
    with running_gateway(long_model, *routes(prefill, decode), "--max-queue-delay", "0.5") as gateway:
        # P's warm-up and one long prefill measure its rate; then each long prompt is seconds of P's time.
        assert metric(gateway.url, "splitserve_instance_prefill_tokens_per_second") > 0
        assert (
            httpx.post(f"{gateway.url}/v1/completions", json=completion(prompts[0], 1), timeout=120).status_code == 200
        )
        deadline = time.monotonic() + 120  # a safety net
        while (
            metric(gateway.url, "splitserve_instance_pending_prefill_tokens") > 0
        ):  # a report taken mid-prefill says so
            assert time.monotonic() < deadline
            time.sleep(0.1)
        with ThreadPoolExecutor(4) as pool:
            answers = list(
                pool.map(
                    lambda prompt: httpx.post(f"{gateway.url}/v1/completions", json=completion(prompt, 1), timeout=120),
                    prompts[1:],
                )
            )
        refused = [a for a in answers if a.status_code == 429]
        assert len(answers) - len(refused) >= 1 and len(refused) >= 2, [a.status_code for a in answers]
        assert all(a.status_code in (200, 429) for a in answers)
        for answer in refused:
            assert (
                answer.json()["error"]["code"] == "overloaded"
                and "--max-queue-delay" in answer.json()["error"]["message"]
            )
            assert int(answer.headers["retry-after"]) >= 1
        assert metric(gateway.url, "splitserve_requests_rejected_total") == len(refused)
    assert_all_free(prefill, decode)
