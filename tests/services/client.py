"""Client-side helpers for the service tests: the gateway's calls, made by hand."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from engine import LLM, SamplingParams
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc, generation_pb2
from tests.services.processes import Service

MAX_TOKENS = 8
GREEDY = generation_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def expected_tokens(colocated: LLM, prompt: list[int]) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return colocated.generate([prompt], params)[0].outputs[0].token_ids


def run_prefill(
    prefill: Service,
    request_id: str,
    prompt: list[int],
    sampling: generation_pb2.SamplingParams = GREEDY,
    cache_salt: str = "",
) -> disaggregation_pb2.PrefillResponse:
    stub = disaggregation_pb2_grpc.PrefillStub(prefill.channel)
    return stub.Prefill(
        disaggregation_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling, cache_salt=cache_salt
        ),
        timeout=30,
    )


def decode_request(
    request_id: str,
    prompt: list[int],
    prefilled: disaggregation_pb2.PrefillResponse,
    sampling: generation_pb2.SamplingParams = GREEDY,
    allow_recompute: bool = False,
    cache_salt: str = "",
) -> disaggregation_pb2.DecodeRequest:
    """The Decode call the gateway makes after ``prefilled``: P's first token and KV handle."""
    return disaggregation_pb2.DecodeRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        first_token_id=prefilled.first_token_id,
        sampling=sampling,
        kv=prefilled.kv,
        allow_recompute=allow_recompute,
        cache_salt=cache_salt,
    )


def run_decode(
    decode: Service,
    request_id: str,
    prompt: list[int],
    prefilled: disaggregation_pb2.PrefillResponse,
    allow_recompute: bool = False,
    sampling: generation_pb2.SamplingParams = GREEDY,
    cache_salt: str = "",
) -> tuple[list[int], list[disaggregation_pb2.DecodeResponse]]:
    """The whole Decode stream: the tokens (P's first one included) and every response."""
    stub = disaggregation_pb2_grpc.DecodeStub(decode.channel)
    request = decode_request(request_id, prompt, prefilled, sampling, allow_recompute, cache_salt)
    responses = list(stub.Decode(request, timeout=60))
    tokens = [prefilled.first_token_id] + [t for r in responses for t in r.token_ids]
    return tokens, responses


def assert_altered_handle_refused(
    prefill: Service,
    decode: Service,
    colocated: LLM,
    request_id: str,
    prompt: list[int],
    alter: Callable[[disaggregation_pb2.KVHandle], None],
    code: grpc.StatusCode,
    message: str,
) -> None:
    """Prefill ``prompt``, ``alter`` its KV handle, and check that D refuses the handle with
    ``code`` and ``message`` before allocating anything; the genuine handle then decodes as the
    colocated engine does (and D releases P's blocks)."""
    prefilled = run_prefill(prefill, request_id, prompt)
    genuine = disaggregation_pb2.KVHandle()
    genuine.CopyFrom(prefilled.kv)
    alter(prefilled.kv)
    with pytest.raises(grpc.RpcError) as raised:
        run_decode(decode, request_id, prompt, prefilled)
    assert raised.value.code() == code
    assert message in raised.value.details()
    assert_all_free(decode)
    prefilled.kv.CopyFrom(genuine)
    tokens, _ = run_decode(decode, request_id, prompt, prefilled)
    assert tokens == expected_tokens(colocated, prompt)
    assert_all_free(prefill, decode)


def assert_all_free(*services: Service) -> None:
    for service in services:
        report = service.wait_all_free()
        assert report.num_free_blocks == report.num_total_blocks, f"{service.address} leaked blocks"
        assert report.num_running == report.num_waiting == 0


def assert_pulled_only_what_decode_lacked(
    transfer: disaggregation_pb2.KVTransfer, num_blocks: int, num_local_hit_blocks: int
) -> None:
    """D's first response says it skipped exactly its own prefix-cache hits and pulled the rest of
    the prompt's ``num_blocks`` blocks."""
    assert transfer.num_local_hit_blocks == num_local_hit_blocks
    assert transfer.num_pulled_blocks == num_blocks - num_local_hit_blocks


def assert_an_abort_during_the_hand_off_frees_every_block(
    prefill: Service, decode: Service, request_id: str, prompt: list[int]
) -> None:
    """A Decode call aborted once its KV has arrived ends with "abort", and neither side holds a
    block after."""
    prefilled = run_prefill(prefill, request_id, prompt)
    stub = disaggregation_pb2_grpc.DecodeStub(decode.channel)
    sampling = generation_pb2.SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    call = stub.Decode(decode_request(request_id, prompt, prefilled, sampling=sampling), timeout=60)
    next(call)  # decoding: the KV has arrived
    stub.Abort(disaggregation_pb2.RequestRef(request_id=request_id), timeout=5)
    assert [response for response in call][-1].finish_reason == "abort"
    assert_all_free(prefill, decode)
