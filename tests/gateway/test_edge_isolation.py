"""What one client does never reaches another's request: gRPC callers that choose the
same request id get independent streams (the gateway runs each under its own id),
and ``cache_salt`` keeps prefix-cache blocks apart on both prefill and decode.

A real gateway process (REST and gRPC) over a real prefill and decode instance
(tiny random model, KV over UCX)."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest

from splitserve.v1 import disaggregation_pb2, generation_pb2, generation_pb2_grpc
from tests.gateway.processes import HTTPProcess, routes, running_gateway
from tests.services.client import assert_all_free, run_decode, run_prefill
from tests.services.processes import Service
from tests.stores import free_port

pytest.importorskip("ucxx")

MODEL_NAME = "tiny"
BLOCK_SIZE = 16
NUM_TEXT_TOKENS = 300  # the tiny tokenizer's vocabulary (the model's is padded beyond it)
GREEDY = generation_pb2.SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)


@pytest.fixture(scope="module")
def gateway(model: Path, instances: tuple[Service, Service]) -> Iterator[HTTPProcess]:
    grpc_port = free_port()
    prefill, decode = instances
    with running_gateway(
        model, *routes(prefill, decode), "--grpc-port", str(grpc_port), "--served-model-name", MODEL_NAME
    ) as process:
        process.grpc_port = grpc_port  # type: ignore[attr-defined]
        yield process


def unique_prompt(num_tokens: int) -> list[int]:
    """Token ids no earlier request used, so no prefix cache holds them yet."""
    return random.Random().choices(range(3, NUM_TEXT_TOKENS), k=num_tokens)


def test_grpc_callers_with_the_same_request_id_get_independent_streams(
    gateway: HTTPProcess, instances: tuple[Service, Service]
) -> None:
    prompt = unique_prompt(12)
    request = generation_pb2.GenerateRequest(
        request_id="same", token_ids=generation_pb2.TokenIds(ids=prompt), sampling=GREEDY
    )
    with grpc.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:  # type: ignore[attr-defined]
        stub = generation_pb2_grpc.GenerationStub(channel)
        expected = [t for response in stub.Generate(request, timeout=60) for t in response.token_ids]
        assert len(expected) == GREEDY.max_tokens

        # Two at once, to the end: each gets the whole of its own stream.
        results: list[list[generation_pb2.GenerateResponse]] = [[], []]

        def read(index: int) -> None:
            results[index] = list(stub.Generate(request, timeout=60))

        threads = [threading.Thread(target=read, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for responses in results:
            assert [t for r in responses for t in r.token_ids] == expected
            assert {r.request_id for r in responses} == {"same"}  # the caller's id, echoed
            assert responses[-1].finish_reason == "length"

        # One caller leaves mid-stream: the other, with the same id, is not aborted.
        victim = stub.Generate(request, timeout=60)
        next(victim), next(victim)
        survivor = stub.Generate(request, timeout=60)
        first = next(survivor)
        victim.cancel()
        rest = list(survivor)
        assert [t for r in [first, *rest] for t in r.token_ids] == expected
        assert rest[-1].finish_reason == "length"
        with pytest.raises(grpc.RpcError) as cancelled:
            list(victim)
        assert cancelled.value.code() == grpc.StatusCode.CANCELLED
    assert_all_free(*instances)


def test_cache_salt_separates_prefix_caches(gateway: HTTPProcess, instances: tuple[Service, Service]) -> None:
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    prompt = unique_prompt(2 * BLOCK_SIZE + 5)  # two full blocks to cache

    def cached_tokens(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt is not None else None
        response = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra
        )
        return response.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]

    assert cached_tokens("tenant-a") == 0
    assert cached_tokens("tenant-b") == 0  # same prompt, another salt: nothing shared
    assert cached_tokens(None) == 0
    assert cached_tokens("tenant-a") == 2 * BLOCK_SIZE  # same salt: the blocks are shared
    # The gRPC front takes the salt too.
    with grpc.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:  # type: ignore[attr-defined]
        request = generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIds(ids=prompt),
            sampling=generation_pb2.SamplingParams(temperature=0, max_tokens=2),
            cache_salt="tenant-b",
        )
        final = list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60))[-1]
        assert final.usage.cached_tokens == 2 * BLOCK_SIZE
    assert_all_free(*instances)


def test_decode_salts_its_own_prefix_cache_lookups(instances: tuple[Service, Service]) -> None:
    """D reuses its own cached blocks instead of pulling them only under the same salt."""
    prefill, decode = instances
    prompt = unique_prompt(2 * BLOCK_SIZE + 5)
    sampling = generation_pb2.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def hand_off(request_id: str, salt: str) -> disaggregation_pb2.KVTransfer:
        prefilled = run_prefill(prefill, request_id, prompt, sampling, cache_salt=salt)
        _, responses = run_decode(decode, request_id, prompt, prefilled, sampling=sampling, cache_salt=salt)
        assert responses[-1].finish_reason == "length"
        return next(r.kv_transfer for r in responses if r.HasField("kv_transfer"))

    first = hand_off("salt-1", "tenant-a")
    assert (first.num_local_hit_blocks, first.num_pulled_blocks) == (0, 3)
    other = hand_off("salt-2", "tenant-b")
    assert other.num_local_hit_blocks == 0  # D's blocks for tenant-a are not tenant-b's
    again = hand_off("salt-3", "tenant-a")
    assert again.num_local_hit_blocks == 2  # the two full blocks, from D's own cache
    assert_all_free(*instances)
