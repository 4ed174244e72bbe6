"""One request's path through the instances: Prefill on a P, the first token back
at once, then Decode on a D with P's KV handle, streaming tokens. With
``--disagg-min-prompt-tokens``, a prompt that D would mostly not have to compute (short, or
in its prefix cache) skips P: the Decode call carries no handle and D prefills it itself.

Admission first: instances over ``--max-queue-delay`` or ``--max-inflight-per-instance``
take nothing new (``gateway.admission``); when none qualifies the request gets 429
with ``Retry-After`` before any instance sees it.

Retries follow the ownership rules: a prefill that fails (instance down,
draining, overloaded) runs again on another P; a hand-off that fails before D
streamed anything goes to another D while P keeps the blocks pinned under its
lease. A D that could not pull the KV (P released it, died, the transfer broke)
hands the request back with ``DATA_LOSS``: the gateway prefills the prompt again
(``kv_only``: the first token is already out), preferring the same P — its prefix
cache still holds most blocks — and hands the new KV to a D; only the last
hand-off attempt lets D recompute the prompt itself. Once D has streamed tokens,
its failure migrates the request: the prompt plus every token sent so far is
prefilled again (``kv_only``) and another D continues after the last token, within
``--max-migrations`` (:func:`resume_request`). Ending the stream early — the
client left, a stop string matched — cancels the Decode call (D aborts and frees at
once) and releases P's blocks if no D took them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Literal

import grpc

from cluster.background import BackgroundTasks
from cluster.prefill_control import abort_prefill, release_kv
from gateway.admission import Overloaded
from gateway.errors import APIError, no_instance
from gateway.instances import InstancePool, InstanceState, Role
from gateway.metrics import GatewayMetrics
from gateway.prefix_index import PromptBlocks
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc, generation_pb2, generation_pb2_grpc

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 3  # per phase: instances tried before the request fails
MAX_HANDOFFS = 3  # Decode calls per request that may end in DATA_LOSS and a new prefill
PDPath = Literal["disaggregated", "decode"]  # prefill on a P and hand off, or on the D itself
DEFAULT_MAX_MIGRATIONS = 2  # times a request may move to another D after its D failed mid-stream
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


@dataclass(slots=True)
class DispatchRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: generation_pb2.SamplingParams
    priority: int = 0
    deadline: float = float("inf")  # monotonic
    cache_salt: str = ""  # mixed into prefix-cache hashes on every instance; empty: none
    _blocks: PromptBlocks | None = None

    @property
    def blocks(self) -> PromptBlocks:
        """The prompt's block-hash chains, for kv routing; computed on first use."""
        if self._blocks is None:
            self._blocks = PromptBlocks(self.prompt_token_ids, self.cache_salt)
        return self._blocks


@dataclass(slots=True)
class TokenEvent:
    """New tokens for a request, as instances produce them."""

    token_ids: list[int]
    logprobs: list[generation_pb2.TokenLogprob]
    finish_reason: str | None = None  # "stop", "length", "abort"; None while running
    stop_token_id: int | None = None
    num_cached_tokens: int = 0  # first event only: prompt tokens a prefix cache served
    kv_transfer: disaggregation_pb2.KVTransfer | None = None  # the hand-off, when D reports it


@dataclass(slots=True)
class _Pinned:
    """Prompt KV pinned on a P for this request: where, and under which id."""

    prefill: InstanceState
    handle: disaggregation_pb2.KVHandle

    @property
    def prefill_request_id(self) -> str:
        return self.handle.request_id


class _KVLost(Exception):
    """D could not pull the KV (DATA_LOSS) and streamed nothing: prefill again."""


class _DecodeLost(Exception):
    """D failed after streaming tokens: the request may migrate to another D."""

    def __init__(self, api_error: APIError) -> None:
        super().__init__(api_error.message)
        self.api_error = api_error


def resume_request(request: DispatchRequest, output_token_ids: list[int]) -> DispatchRequest | None:
    """The request as a new decode instance continues it after ``output_token_ids`` (every token
    sent so far): its prompt is the original prompt plus all of them but the last, which the
    new D takes as its first token; max_tokens and min_tokens shrink by the tokens that moved
    into the prompt, so the total stays what the client asked. None when no token is left to
    generate."""
    num_moved = len(output_token_ids) - 1
    sampling = generation_pb2.SamplingParams()
    sampling.CopyFrom(request.sampling)
    if sampling.HasField("max_tokens"):
        if sampling.max_tokens - len(output_token_ids) <= 0:
            return None
        sampling.max_tokens -= num_moved
    sampling.min_tokens = max(0, sampling.min_tokens - num_moved)
    return DispatchRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids + output_token_ids[:-1],
        sampling=sampling,
        priority=request.priority,
        deadline=request.deadline,
        cache_salt=request.cache_salt,
    )


class Dispatcher:
    def __init__(
        self,
        pool: InstancePool,
        metrics: GatewayMetrics | None = None,
        max_migrations: int = DEFAULT_MAX_MIGRATIONS,
        disagg_min_prompt_tokens: int = 0,
    ) -> None:
        if max_migrations < 0:
            raise ValueError(f"--max-migrations must be >= 0, got {max_migrations}")
        if disagg_min_prompt_tokens < 0:
            raise ValueError(
                f"--disagg-min-prompt-tokens must be >= 0 (0: always disaggregate), got {disagg_min_prompt_tokens}"
            )
        self.pool = pool
        self.metrics = metrics
        self.max_migrations = max_migrations
        self.disagg_min_prompt_tokens = disagg_min_prompt_tokens
        self._background = BackgroundTasks()

    async def generate(self, request: DispatchRequest) -> AsyncIterator[TokenEvent]:
        """Stream a request's tokens. Raises APIError (before or between events) on failure."""
        if self.pool.healthy("colocated"):
            async for event in self._colocated(request):
                yield event
            return
        path, reason = self._pd_decision(request)
        if self.metrics is not None:
            self.metrics.pd_decisions.labels(path=path, reason=reason).inc()
        if path == "decode":
            async for event in self._decode_and_migrate(request, None, []):
                yield event
            return
        prefilled, prefill = await self._prefill(request, request.request_id, request.sampling)
        first = TokenEvent(
            token_ids=[prefilled.first_token_id],
            logprobs=[prefilled.first_logprob] if prefilled.HasField("first_logprob") else [],
            finish_reason=prefilled.finish_reason or None,
            num_cached_tokens=prefilled.num_cached_tokens,
        )
        if first.finish_reason is None and not prefilled.HasField("kv"):
            raise RuntimeError(
                f"prefill instance {prefill.address} returned neither a KV handle nor a finish reason (bug)"
            )
        if first.finish_reason is not None:
            yield first
            return
        pinned = _Pinned(prefill, _with_request_id(prefilled.kv, request.request_id))
        try:
            yield first
        except BaseException:  # the stream ended at its first token (client gone, stop string)
            self._free_in_background(pinned)
            raise
        async for event in self._decode_and_migrate(request, pinned, [prefilled.first_token_id]):
            yield event

    def _pd_decision(self, request: DispatchRequest) -> tuple[PDPath, str]:
        """Conditional disaggregation: where the prompt is prefilled, and why. A prompt whose
        uncached part on the best decode instance is under ``--disagg-min-prompt-tokens`` (it
        is short, or mostly in that instance's prefix cache) is prefilled there: a trip through
        P and a KV pull would cost more than computing it beside the running decodes."""
        threshold = self.disagg_min_prompt_tokens
        num_prompt_tokens = len(request.prompt_token_ids)
        if threshold <= 0:
            return "disaggregated", "always"
        if num_prompt_tokens < threshold:
            return "decode", "short_prompt"
        num_uncached = self.pool.min_decode_uncached_tokens(num_prompt_tokens, request.blocks)
        if num_uncached is not None and num_uncached < threshold:
            return "decode", "cached_on_decode"
        return "disaggregated", "uncached_prompt"

    async def _decode_and_migrate(
        self, request: DispatchRequest, pinned: _Pinned | None, output_token_ids: list[int]
    ) -> AsyncIterator[TokenEvent]:
        """Decode after ``output_token_ids`` (the tokens already sent; P's first token after a
        prefill there), from P's pinned KV, or prefilling on D itself when ``pinned`` is None.
        A lost KV goes back to prefill; a D that fails after streaming hands the request to
        another one (migration), within the request's budget."""
        decoding = False  # a D has streamed: it owns the KV now and releases P itself
        current = request  # what the next Decode call continues: the prompt, plus tokens moved in by migrations
        num_migrations = handoff = 0
        try:
            while True:
                handoff += 1
                try:
                    if pinned is None:
                        stream = self._decode(current)
                    else:
                        stream = self._decode(
                            current, pinned.handle, output_token_ids[-1], allow_recompute=handoff >= MAX_HANDOFFS
                        )
                    async for event in stream:
                        decoding = True
                        output_token_ids.extend(event.token_ids)
                        yield event
                    return
                except _KVLost as lost:
                    if pinned is None or handoff >= MAX_HANDOFFS:
                        raise APIError(
                            HTTPStatus.SERVICE_UNAVAILABLE,
                            f"no decode instance could take the KV: {lost}",
                            code="instance_failed",
                        ) from None
                    logger.warning(
                        "hand-off %d of %s lost its KV (%s); prefilling it again", handoff, request.request_id, lost
                    )
                    if self.metrics is not None:
                        self.metrics.kv_reprefills.inc()
                    self._free_in_background(pinned)  # a no-op if D's release got there first
                    pinned = await self._reprefill(current, f"{request.request_id}.kv{handoff}", prefer=pinned.prefill)
                except _DecodeLost as lost:
                    if request.sampling.WhichOneof("structured") is not None:
                        # A new D's grammar matcher would start over at the resumed first token,
                        # not after every token sent: the output would leave its format.
                        if self.metrics is not None:
                            self.metrics.migrations.labels(outcome="unsupported").inc()
                        raise lost.api_error from None
                    if num_migrations >= self.max_migrations:
                        if self.metrics is not None:
                            self.metrics.migrations.labels(outcome="exhausted").inc()
                        raise lost.api_error from None
                    num_migrations += 1
                    resumed = resume_request(request, output_token_ids)
                    if resumed is None:  # the failed D had sent every token but not the finish
                        yield TokenEvent(token_ids=[], logprobs=[], finish_reason="length")
                        return
                    logger.warning(
                        "decode of %s failed after %d tokens (%s); migrating it (%d of at most %d)",
                        request.request_id,
                        len(output_token_ids),
                        lost.api_error.message,
                        num_migrations,
                        self.max_migrations,
                    )
                    if self.metrics is not None:
                        self.metrics.migrations.labels(outcome="resumed").inc()
                    # The failed D took P's KV over when it streamed; the new KV is the resumed prompt's,
                    # prefilled on a P whatever the first path was (it is long by now, and mostly cached).
                    decoding, handoff = False, 0
                    current = resumed
                    # Back to the P that holds the prefix; kv routing finds the prefix itself.
                    prefer = pinned.prefill if pinned is not None and self.pool.routing == "load" else None
                    pinned = await self._reprefill(current, f"{request.request_id}.m{num_migrations}", prefer=prefer)
        finally:
            if not decoding and pinned is not None:
                self._free_in_background(pinned)

    # ---------------------------------------------------------------- prefill

    async def _prefill(
        self,
        request: DispatchRequest,
        prefill_request_id: str,
        sampling: generation_pb2.SamplingParams,
        kv_only: bool = False,
        prefer: InstanceState | None = None,
    ) -> tuple[disaggregation_pb2.PrefillResponse, InstanceState]:
        """``kv_only``: a re-prefill of an admitted request, which no admission limit refuses."""
        tried: list[InstanceState] = []
        message = disaggregation_pb2.PrefillRequest(
            request_id=prefill_request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=sampling,
            priority=request.priority,
            cache_salt=request.cache_salt,
            kv_only=kv_only,
        )
        num_prompt_tokens = len(request.prompt_token_ids)
        last_error: grpc.aio.AioRpcError | None = None
        for _ in range(MAX_ATTEMPTS):
            prefill = self._admit(
                lambda: self.pool.pick_prefill(
                    exclude=tried,
                    num_prompt_tokens=num_prompt_tokens,
                    prefer=prefer,
                    admitted=kv_only,
                    prompt=request.blocks,
                )
            )
            if prefill is None:
                break
            tried.append(prefill)
            try:
                with prefill.call():
                    response = await disaggregation_pb2_grpc.PrefillStub(prefill.channel).Prefill(
                        message, timeout=_remaining(request)
                    )
                return response, prefill
            except grpc.aio.AioRpcError as error:
                last_error = self._failed(prefill, error, "prefill")
            except asyncio.CancelledError:
                # The client left mid-prefill: P may have pinned blocks just before the cancel reached it.
                self._background.spawn(abort_prefill(prefill.channel, prefill_request_id, prefill.address))
                raise
        raise _exhausted("prefill", last_error)

    async def _reprefill(self, request: DispatchRequest, prefill_request_id: str, prefer: InstanceState) -> _Pinned:
        """The prompt's KV again, pinned under a new id; the token P samples is not used."""
        prefilled, prefill = await self._prefill(
            request, prefill_request_id, request.sampling, kv_only=True, prefer=prefer
        )
        if not prefilled.HasField("kv"):
            raise RuntimeError(f"prefill instance {prefill.address} pinned nothing for a kv_only prefill (bug)")
        return _Pinned(prefill, _with_request_id(prefilled.kv, prefill_request_id))

    # ----------------------------------------------------------------- decode

    async def _decode(
        self,
        request: DispatchRequest,
        handle: disaggregation_pb2.KVHandle | None = None,
        first_token_id: int = 0,
        allow_recompute: bool = False,
    ) -> AsyncIterator[TokenEvent]:
        """Decode from P's KV ``handle``, continuing after ``first_token_id`` (only a D with the
        handle's fingerprint can take it); with no handle, D prefills the prompt itself
        (conditional disaggregation)."""
        message = disaggregation_pb2.DecodeRequest(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=request.sampling,
            priority=request.priority,
            allow_recompute=allow_recompute,
            cache_salt=request.cache_salt,
        )
        fingerprint = None
        if handle is not None:
            message.first_token_id = first_token_id
            message.kv.CopyFrom(handle)
            fingerprint = handle.fingerprint
        num_prompt_tokens = len(request.prompt_token_ids)
        async for event in self._stream_with_failover(
            "decode",
            lambda tried: self.pool.pick(
                "decode",
                exclude=tried,
                fingerprint=fingerprint,
                num_prompt_tokens=num_prompt_tokens,
                prompt=request.blocks,
            ),
            lambda decode: disaggregation_pb2_grpc.DecodeStub(decode.channel).Decode(
                message, timeout=_remaining(request)
            ),
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
        num_prompt_tokens = len(request.prompt_token_ids)
        async for event in self._stream_with_failover(
            "colocated",
            lambda tried: self.pool.pick(
                "colocated", exclude=tried, num_prompt_tokens=num_prompt_tokens, prompt=request.blocks
            ),
            lambda instance: generation_pb2_grpc.GenerationStub(instance.channel).Generate(
                message, timeout=_remaining(request)
            ),
        ):
            yield event

    async def _stream_with_failover(
        self,
        role: Role,
        pick: Callable[[list[InstanceState]], InstanceState | None],
        open_stream: Callable[[InstanceState], grpc.aio.UnaryStreamCall],
    ) -> AsyncIterator[TokenEvent]:
        """Stream from the first instance that takes the request. Until it has streamed
        something, a failure moves the request to another instance of the role (or, for
        DATA_LOSS, back to prefill: :class:`_KVLost`); after that the request fails (its
        tokens are out)."""
        tried: list[InstanceState] = []
        last_error: grpc.aio.AioRpcError | None = None
        for _ in range(MAX_ATTEMPTS):
            instance = self._admit(lambda: pick(tried))
            if instance is None:
                break
            tried.append(instance)
            call = open_stream(instance)
            streamed = False
            try:
                with instance.call() as prefilled:
                    async for response in call:
                        first, streamed = not streamed, True
                        prefilled()
                        yield _token_event(response, first)
                return
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.DATA_LOSS and not streamed:
                    raise _KVLost(error.details()) from None
                last_error = self._failed(instance, error, role)
                if streamed:
                    api_error = _as_api_error(error, f"{role} instance {instance.instance_id} failed mid-stream")
                    if role == "decode":
                        raise _DecodeLost(api_error) from error
                    raise api_error from error
            finally:
                if not call.done():
                    call.cancel()  # the instance aborts the request and frees its blocks
        raise _exhausted(role, last_error)

    # ---------------------------------------------------------------- helpers

    def _admit(self, pick: Callable[[], InstanceState | None]) -> InstanceState | None:
        """Run a pick; an :class:`Overloaded` pool becomes a 429 with ``Retry-After``."""
        try:
            return pick()
        except Overloaded as overloaded:
            if self.metrics is not None:
                self.metrics.rejected.inc()
            raise APIError(
                HTTPStatus.TOO_MANY_REQUESTS,
                f"{overloaded}; retry later",
                code="overloaded",
                retry_after_s=overloaded.retry_after_s,
            ) from None

    def _failed(self, instance: InstanceState, error: grpc.aio.AioRpcError, phase: str) -> grpc.aio.AioRpcError:
        """Classify a failed call: the client's fault raises now; otherwise try elsewhere."""
        code = error.code()
        if code not in _RETRYABLE:
            raise _as_api_error(error, f"{phase} instance {instance.instance_id}")
        logger.warning(
            "%s on %s failed (%s: %s); trying another instance", phase, instance.address, code.name, error.details()
        )
        if code in _INSTANCE_DOWN:
            self.pool.record_failure(instance)
        return error

    def _free_in_background(self, pinned: _Pinned) -> None:
        """Free P's pinned blocks now rather than at lease expiry, once nobody will pull them
        (a no-op if D already released them). It must outlive the request's task."""
        prefill = pinned.prefill
        self._background.spawn(release_kv(prefill.channel, pinned.prefill_request_id, prefill.address))

    async def drain(self) -> None:
        """Wait for background cleanup (releases, aborts) to reach the instances."""
        await self._background.wait()


def _with_request_id(handle: disaggregation_pb2.KVHandle, prefill_request_id: str) -> disaggregation_pb2.KVHandle:
    """The handle naming P's id for its blocks (a P that predates the field leaves it empty)."""
    if not handle.request_id:
        handle.request_id = prefill_request_id
    return handle


def _token_event(
    response: disaggregation_pb2.DecodeResponse | generation_pb2.GenerateResponse, first: bool
) -> TokenEvent:
    event = TokenEvent(
        token_ids=list(response.token_ids),
        logprobs=list(response.logprobs),
        finish_reason=response.finish_reason or None,
        stop_token_id=response.stop_token_id if response.HasField("stop_token_id") else None,
    )
    if isinstance(response, disaggregation_pb2.DecodeResponse):
        event.kv_transfer = response.kv_transfer if response.HasField("kv_transfer") else None
        event.num_cached_tokens = response.num_cached_tokens if first else 0  # set by a local prefill only
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
