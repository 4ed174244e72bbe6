"""Conversions at the gRPC edge: protobuf messages <-> engine and connector types.
Converted once here; nothing inward sees a protobuf message."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from engine.outputs import EngineCoreOutput
from engine.sampler import TokenLogprobs
from kv_connector.base import KVSource
from kv_connector.fingerprint import Fingerprint
from splitserve.v1 import disaggregation_pb2, generation_pb2

# The streamed responses that carry an engine output's tokens: the colocated and the decode instance's.
TokenResponse = TypeVar("TokenResponse", generation_pb2.GenerateResponse, disaggregation_pb2.DecodeResponse)


def output_to_proto(output: EngineCoreOutput, response_type: type[TokenResponse]) -> TokenResponse:
    """The fields every streamed response takes from one engine output (its new tokens, their
    logprobs, how it finished); the caller adds what its own response says besides."""
    response = response_type(
        request_id=output.request_id,
        token_ids=output.new_token_ids,
        logprobs=[logprobs_to_proto(lp) for lp in output.new_logprobs],
        finish_reason=output.finish_reason or "",
    )
    if isinstance(output.stop_reason, int):
        response.stop_token_id = output.stop_reason
    return response


def logprobs_to_proto(logprobs: TokenLogprobs) -> generation_pb2.TokenLogprob:
    return generation_pb2.TokenLogprob(
        token_id=logprobs.token_id,
        logprob=logprobs.logprob,
        rank=logprobs.rank,
        top=[generation_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in logprobs.top_logprobs],
    )


def fingerprint_to_proto(fingerprint: Fingerprint) -> disaggregation_pb2.Fingerprint:
    return disaggregation_pb2.Fingerprint(
        model=fingerprint.model,
        dtype=fingerprint.dtype,
        block_size=fingerprint.block_size,
        num_layers=fingerprint.num_layers,
        num_kv_heads=fingerprint.num_kv_heads,
        head_dim=fingerprint.head_dim,
        tensor_parallel_size=fingerprint.tensor_parallel_size,
        stage_first_layers=fingerprint.stage_first_layers,
        draft=fingerprint.draft,
    )


def fingerprint_from_proto(message: disaggregation_pb2.Fingerprint) -> Fingerprint:
    return Fingerprint(
        model=message.model,
        dtype=message.dtype,
        block_size=message.block_size,
        num_layers=message.num_layers,
        num_kv_heads=message.num_kv_heads,
        head_dim=message.head_dim,
        tensor_parallel_size=message.tensor_parallel_size,
        stage_first_layers=tuple(message.stage_first_layers) or (0,),
        draft=message.draft,
    )


def kv_source_from_proto(
    handle: disaggregation_pb2.KVHandle, prompt_token_ids: Sequence[int], cache_salt: str
) -> KVSource:
    """``prompt_token_ids`` and ``cache_salt``: the Decode call's, whose prompt's KV the handle holds."""
    return KVSource(
        request_id=handle.request_id,
        address=handle.connector_address,
        block_ids=tuple(handle.block_ids),
        num_tokens=handle.num_tokens,
        fingerprint=fingerprint_from_proto(handle.fingerprint),
        token_ids=tuple(prompt_token_ids),
        pull_token=handle.pull_token,
        cache_salt=cache_salt,
        chunk_digests=tuple(handle.chunk_digests),
        rank_addresses=tuple(handle.rank_connector_addresses),
        draft_kv_digest=handle.draft_kv_digest,
    )
