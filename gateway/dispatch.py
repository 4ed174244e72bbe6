"""One request's path through the instances: Prefill on a P, the first token back
at once, then Decode on a D with P's KV handle, streaming tokens.

Retries follow the ownership rules: a prefill that fails (instance down,
draining, overloaded) runs again on another P; a hand-off that fails before D
streamed anything goes to another D while P keeps the blocks pinned under its
lease. Once D has streamed tokens, its failure fails the request (the tokens
are out). Ending the stream early — the client left, a stop string matched —
cancels the Decode call (D aborts and frees at once) and releases P's blocks if
no D took them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus

import grpc
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc, generation_pb2, generation_pb2_grpc

from gateway.errors import APIError, no_instance
from gateway.instances import InstancePool, InstanceState, Role

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 3  # per phase: instances tried before the request fails
# An instance answering with these is down, draining or full: another one may serve.
_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.FAILED_PRECONDITION,  # a fingerprint mismatch: another D may match
}
_INSTANCE_DOWN = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN}
_RELEASE_TIMEOUT_S = 5.0


@dataclass(slots=True)
class DispatchRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: generation_pb2.SamplingParams
    priority: int = 0
    deadline: float = float("inf")  # monotonic
    cache_salt: str = ""  # mixed into prefix-cache hashes on every instance; empty: none


@dataclass(slots=True)
class TokenEvent:
    """New tokens for a request, as instances produce them."""

    token_ids: list[int]
    logprobs: list[generation_pb2.TokenLogprob]
    finish_reason: str | None = None  # "stop", "length", "abort"; None while running
    stop_token_id: int | None = None
    num_cached_tokens: int = 0  # first event only: prompt tokens a prefix cache served
    kv_transfer: disaggregation_pb2.KVTransfer | None = None  # the hand-off, when D reports it


class Dispatcher:
    def __init__(self, pool: InstancePool) -> None:
        self.pool = pool
        self._background: set[asyncio.Task[object]] = set()

    async def generate(self, request: DispatchRequest) -> AsyncIterator[TokenEvent]:
        """Stream a request's tokens. Raises APIError (before or between events) on failure."""
        if self.pool.healthy("colocated"):
            async for event in self._colocated(request):
                yield event
            return
        prefilled, prefill = await self._prefill(request)
        first = TokenEvent(
            token_ids=[prefilled.first_token_id],
            logprobs=[prefilled.first_logprob] if prefilled.HasField("first_logprob") else [],
            finish_reason=prefilled.finish_reason or None,
            num_cached_tokens=prefilled.num_cached_tokens,
        )
        if first.finish_reason is None and not prefilled.HasField("kv"):
            raise RuntimeError(f"prefill instance {prefill.address} returned neither a KV handle nor a finish reason (bug)")
        if first.finish_reason is not None:
            yield first
            return
        decoding = False  # a D has streamed: it owns the KV now and releases P itself
        try:
            yield first
            async for event in self._decode(request, prefilled):
                decoding = True
                yield event
        finally:
            if not decoding:
                self._in_background(self._free_on_prefill(prefill, request.request_id, abort=False))

    # ---------------------------------------------------------------- prefill

    async def _prefill(self, request: DispatchRequest) -> tuple[disaggregation_pb2.PrefillResponse, InstanceState]:
        tried: list[InstanceState] = []
        message = disaggregation_pb2.PrefillRequest(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=request.sampling,
            priority=request.priority,
            cache_salt=request.cache_salt,
        )
        last_error: grpc.aio.AioRpcError | None = None
        for _ in range(MAX_ATTEMPTS):
            prefill = self.pool.pick_prefill(exclude=tried)
            if prefill is None:
                break
            tried.append(prefill)
            try:
                return await disaggregation_pb2_grpc.PrefillStub(prefill.channel).Prefill(message, timeout=_remaining(request)), prefill
            except grpc.aio.AioRpcError as error:
                last_error = self._failed(prefill, error, "prefill")
            except asyncio.CancelledError:
                # The client left mid-prefill: P may have pinned blocks just before the cancel reached it.
                self._in_background(self._free_on_prefill(prefill, request.request_id, abort=True))
                raise
        raise _exhausted("prefill", last_error)

    # ----------------------------------------------------------------- decode

    async def _decode(self, request: DispatchRequest, prefilled: disaggregation_pb2.PrefillResponse) -> AsyncIterator[TokenEvent]:
        message = disaggregation_pb2.DecodeRequest(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            first_token_id=prefilled.first_token_id,
            sampling=request.sampling,
            kv=prefilled.kv,
            priority=request.priority,
            cache_salt=request.cache_salt,
        )
        fingerprint = prefilled.kv.fingerprint
        async for event in self._stream_with_failover(
            "decode",
            lambda tried: self.pool.pick("decode", exclude=tried, fingerprint=fingerprint),
            lambda decode: disaggregation_pb2_grpc.DecodeStub(decode.channel).Decode(message, timeout=_remaining(request)),
        ):
            yield event

    # ------------------------------------------------------------- colocated

    async def _colocated(self, request: DispatchRequest) -> AsyncIterator[TokenEvent]:
        message = generation_pb2.GenerateRequest(
            request_id=request.request_id,
            token_ids=generation_pb2.TokenIds(ids=request.prompt_token_ids),
            sampling=request.sampling,
            priority=request.priority,
            cache_salt=request.cache_salt,
        )
        async for event in self._stream_with_failover(
            "colocated",
            lambda tried: self.pool.pick("colocated", exclude=tried),
            lambda instance: generation_pb2_grpc.GenerationStub(instance.channel).Generate(message, timeout=_remaining(request)),
        ):
            yield event

    async def _stream_with_failover(
        self,
        role: Role,
        pick: Callable[[list[InstanceState]], InstanceState | None],
        open_stream: Callable[[InstanceState], grpc.aio.UnaryStreamCall],
    ) -> AsyncIterator[TokenEvent]:
        """Stream from the first instance that takes the request. Until it has streamed
        something, a failure moves the request to another instance of the role; after
        that the request fails (its tokens are out)."""
        tried: list[InstanceState] = []
        last_error: grpc.aio.AioRpcError | None = None
        for _ in range(MAX_ATTEMPTS):
            instance = pick(tried)
            if instance is None:
                break
            tried.append(instance)
            call = open_stream(instance)
            streamed = False
            try:
                async for response in call:
                    first, streamed = not streamed, True
                    yield _token_event(response, first)
                return
            except grpc.aio.AioRpcError as error:
                last_error = self._failed(instance, error, role)
                if streamed:
                    raise _as_api_error(error, f"{role} instance {instance.instance_id} failed mid-stream") from error
            finally:
                if not call.done():
                    call.cancel()  # the instance aborts the request and frees its blocks
        raise _exhausted(role, last_error)

    # ---------------------------------------------------------------- helpers

    def _failed(self, instance: InstanceState, error: grpc.aio.AioRpcError, phase: str) -> grpc.aio.AioRpcError:
        """Classify a failed call: the client's fault raises now; otherwise try elsewhere."""
        code = error.code()
        if code not in _RETRYABLE:
            raise _as_api_error(error, f"{phase} instance {instance.instance_id}")
        logger.warning("%s on %s failed (%s: %s); trying another instance", phase, instance.address, code.name, error.details())
        if code in _INSTANCE_DOWN:
            self.pool.record_failure(instance)
        return error

    async def _free_on_prefill(self, prefill: InstanceState, request_id: str, abort: bool) -> None:
        """Free P's pinned blocks now rather than at lease expiry: ReleaseKV once nobody will
        pull them (a no-op if D already did), Abort when the prefill itself may still run."""
        stub = disaggregation_pb2_grpc.PrefillStub(prefill.channel)
        call = stub.Abort if abort else stub.ReleaseKV
        try:
            await call(disaggregation_pb2.RequestRef(request_id=request_id), timeout=_RELEASE_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            name = "Abort" if abort else "ReleaseKV"
            logger.info("%s of %s on %s failed (%s); its lease frees the blocks", name, request_id, prefill.address, error.code().name)

    def _in_background(self, coroutine: Awaitable[object]) -> None:
        """Run cleanup that must happen even though the request's task is ending."""
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        """Wait for background cleanup (releases, aborts) to reach the instances."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)


def _token_event(response: disaggregation_pb2.DecodeResponse | generation_pb2.GenerateResponse, first: bool) -> TokenEvent:
    event = TokenEvent(
        token_ids=list(response.token_ids),
        logprobs=list(response.logprobs),
        finish_reason=response.finish_reason or None,
        stop_token_id=response.stop_token_id if response.HasField("stop_token_id") else None,
    )
    if isinstance(response, disaggregation_pb2.DecodeResponse):
        event.kv_transfer = response.kv_transfer if response.HasField("kv_transfer") else None
    elif first:
        event.num_cached_tokens = response.usage.cached_tokens
    return event


def _remaining(request: DispatchRequest) -> float | None:
    if request.deadline == float("inf"):
        return None
    remaining = request.deadline - time.monotonic()
    if remaining <= 0:
        raise APIError(HTTPStatus.GATEWAY_TIMEOUT, "the request timed out", code="timeout")
    return remaining


def _exhausted(role: str, last_error: grpc.aio.AioRpcError | None) -> APIError:
    if last_error is None:
        return no_instance(role)
    return _as_api_error(last_error, f"every {role} instance tried failed; last")


def _as_api_error(error: grpc.aio.AioRpcError, where: str) -> APIError:
    code = error.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return APIError(HTTPStatus.BAD_REQUEST, error.details() or "invalid request")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return APIError(HTTPStatus.GATEWAY_TIMEOUT, "the request timed out", code="timeout")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return APIError(HTTPStatus.TOO_MANY_REQUESTS, f"{where}: {error.details()}", code="overloaded")
    return APIError(HTTPStatus.SERVICE_UNAVAILABLE, f"{where}: {code.name}: {error.details()}", code="instance_failed")
