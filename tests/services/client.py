"""Client-side helpers for the service tests: the gateway's calls, made by hand."""

from __future__ import annotations

from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc, generation_pb2

from engine import LLM, SamplingParams
from tests.services.processes import Service

MAX_TOKENS = 8
GREEDY = generation_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def expected_tokens(colocated: LLM, prompt: list[int]) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return colocated.generate([prompt], params)[0].outputs[0].token_ids


def run_prefill(
    prefill: Service, request_id: str, prompt: list[int], sampling: generation_pb2.SamplingParams = GREEDY
) -> disaggregation_pb2.PrefillResponse:
    stub = disaggregation_pb2_grpc.PrefillStub(prefill.channel)
    return stub.Prefill(disaggregation_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling), timeout=30)


def run_decode(
    decode: Service,
    request_id: str,
    prompt: list[int],
    prefilled: disaggregation_pb2.PrefillResponse,
    allow_recompute: bool = False,
    sampling: generation_pb2.SamplingParams = GREEDY,
) -> tuple[list[int], list[disaggregation_pb2.DecodeResponse]]:
    stub = disaggregation_pb2_grpc.DecodeStub(decode.channel)
    responses = list(stub.Decode(disaggregation_pb2.DecodeRequest(
        request_id=request_id, prompt_token_ids=prompt, first_token_id=prefilled.first_token_id,
        sampling=sampling, kv=prefilled.kv, allow_recompute=allow_recompute), timeout=60))
    tokens = [prefilled.first_token_id] + [t for r in responses for t in r.token_ids]
    return tokens, responses


def assert_all_free(*services: Service) -> None:
    for service in services:
        report = service.wait_all_free()
        assert report.num_free_blocks == report.num_total_blocks, f"{service.address} leaked blocks"
        assert report.num_running == report.num_waiting == 0
