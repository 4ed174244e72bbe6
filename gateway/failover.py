"""Retries and migration: what happens to a request when an instance fails on its path
(the path itself: ``gateway/dispatch.py``). The rules follow the ownership of P's pinned KV;
in call order:

1. Prefill (:meth:`Failover.prefill`): a P that fails (down, draining, overloaded, a
   fingerprint it cannot serve) is counted down when it is, and the prefill runs on another
   P, up to ``MAX_ATTEMPTS`` instances (one that could not be reached at all does not count:
   :func:`unreachable`); a client error (a 4xx) ends the request at once. A
   client that leaves mid-prefill sends that P an Abort in the background: it may have
   pinned blocks just before the cancel reached it.
2. Hand-off (:meth:`Failover.decode_and_migrate`, each Decode call through
   :meth:`Failover.stream`): a Decode call that fails before D streamed anything goes to
   another D, up to ``MAX_ATTEMPTS``, while P keeps the blocks pinned under its lease.
3. KV re-prefill: a D that could not pull the KV (P released it, died, the transfer broke)
   hands the request back with ``DATA_LOSS`` before any token (:class:`KVLost`). P's blocks
   are released, the prompt is prefilled again (``kv_only``: the first token is already
   out) under ``REQUEST_ID.kvN``, preferring the same P (its prefix cache still holds most
   blocks), and the new KV goes to a D (step 2); only the last of ``MAX_HANDOFFS`` hand-offs
   lets D recompute the prompt itself.
4. Migration: a D that fails after streaming tokens (:class:`DecodeLost`) hands the request
   to another one: the prompt plus every token sent so far but the last is prefilled again
   (``kv_only``, ``REQUEST_ID.mN``; :func:`resume_request`) and another D continues after
   the last token (step 2), within ``--max-migrations``. A structured output never
   migrates: the new D's grammar matcher would start over at the resumed token.
   A D that drains by handing its streams over (the planner's scale-down, SIGUSR2) ends a
   call with ``handed_over`` (:class:`HandedOver`): the request resumes the same way, under
   ``REQUEST_ID.hN``, on a D other than those that handed it over, outside the migration
   budget (nothing failed); calls say ``may_hand_over`` only for requests that can resume
   (not a structured output) and fewer than ``MAX_HANDOVERS`` times handed over.
5. Cleanup: when the request ends with P's blocks pinned and no D streaming from them (the
   client left, a stop string matched, every attempt failed), ReleaseKV to P runs in the
   background (:meth:`Failover.release`) and outlives the request; :meth:`Failover.drain`
   waits for it.

Every instance is picked within the instance limits (``gateway.instance_limits``): when none
qualifies, the request gets 429 with ``Retry-After``; a re-prefill is never refused.

With tracing on, each call to an instance is a client span of the request's trace, its context
in the call's metadata (:func:`~gateway.request_trace.call_trace`); a retry, a KV re-prefill
and a migration are events of the request's root span.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from http import HTTPStatus
from typing import TypeAlias

import grpc

from cluster.background import BackgroundTasks
from cluster.prefill_control import abort_prefill, release_kv
from gateway.call_mux import CallBody, MuxCall, open_streaming_call
from gateway.dispatch_request import DispatchRequest, PinnedKV, TokenEvent
from gateway.errors import APIError, instance_failure, no_instance
from gateway.flags import DEFAULT_MAX_MIGRATIONS
from gateway.instance_limits import Overloaded
from gateway.instances import InstancePool, InstanceState, Role
from gateway.metrics import GatewayMetrics
from gateway.request_trace import Metadata, RequestTrace, call_trace
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc, generation_pb2

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 3  # per phase: instances that took the call and failed before the request fails
MAX_HANDOFFS = 3  # Decode calls per request that may end in DATA_LOSS and a new prefill
# Hand-overs one request may take: past them its Decode calls say it may not be handed over,
# and a draining instance decodes it to its end (no request moves without bound).
MAX_HANDOVERS = 4
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
StreamingCall: TypeAlias = MuxCall | grpc.aio.UnaryStreamCall
_INSTANCE_DOWN = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN}
PREFILL_METHOD = "splitserve.v1.Prefill/Prefill"  # a call's span name (gateway/request_trace.py)
_STREAM_METHODS: dict[Role, str] = {
    "decode": "splitserve.v1.Decode/Decode",
    "colocated": "splitserve.v1.Generation/Generate",
    "prefill": PREFILL_METHOD,
}


class KVLost(Exception):
    """D could not pull the KV (DATA_LOSS) and streamed nothing: prefill again."""


class DecodeLost(Exception):
    """D failed after streaming tokens: the request may migrate to another D."""

    def __init__(self, api_error: APIError) -> None:
        super().__init__(api_error.message)
        self.api_error = api_error


class HandedOver(Exception):
    """D drains and handed the request back after the tokens it streamed: it resumes on another D."""

    def __init__(self, instance: InstanceState) -> None:
        super().__init__(f"decode instance {instance.instance_id} at {instance.address} handed the request over")
        self.instance = instance


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
        trace=request.trace,
    )


class Failover:
    """The calls to instances that survive an instance's failure, and the cleanup that
    outlives a request."""

    def __init__(
        self,
        pool: InstancePool,
        metrics: GatewayMetrics | None = None,
        max_migrations: int = DEFAULT_MAX_MIGRATIONS,
    ) -> None:
        if max_migrations < 0:
            raise ValueError(f"--max-migrations must be >= 0, got {max_migrations}")
        self.pool = pool
        self.metrics = metrics
        self.max_migrations = max_migrations
        self._background = BackgroundTasks()

    # ---------------------------------------------------------------- prefill

    async def prefill(
        self,
        request: DispatchRequest,
        prefill_request_id: str,
        sampling: generation_pb2.SamplingParams,
        kv_only: bool = False,
        prefer: InstanceState | None = None,
    ) -> tuple[disaggregation_pb2.PrefillResponse, InstanceState, float]:
        """Prefill on the first P that answers (step 1), and when the gateway sent it that
        call (monotonic). ``kv_only``: a re-prefill of a request under way, which no instance
        limit refuses."""
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
        num_attempts = 0
        while num_attempts < MAX_ATTEMPTS:
            prefill = self._within_limits(
                lambda: self.pool.pick_prefill(
                    exclude=tried,
                    num_prompt_tokens=num_prompt_tokens,
                    prefer=prefer,
                    exempt=kv_only,
                    prompt=request.blocks,
                )
            )
            if prefill is None:
                break
            tried.append(prefill)
            try:
                with prefill.call(), call_trace(request.trace, PREFILL_METHOD, prefill) as traced:
                    try:
                        sent_at = time.monotonic()
                        response = await disaggregation_pb2_grpc.PrefillStub(prefill.channel).Prefill(
                            message, timeout=request.timeout_s(), metadata=traced.metadata
                        )
                    except grpc.aio.AioRpcError as error:
                        traced.failed(error)
                        raise
                self._count_routed_prefix(request, prefill, response.num_cached_tokens)
                return response, prefill, sent_at
            except grpc.aio.AioRpcError as error:
                last_error = self._failed(prefill, error, "prefill", request.trace)
                num_attempts += not unreachable(prefill, error)
            except asyncio.CancelledError:
                # The client left mid-prefill: P may have pinned blocks just before the cancel reached it.
                self._background.spawn(abort_prefill(prefill.channel, prefill_request_id, prefill.address))
                raise
        raise _exhausted("prefill", last_error, tried)

    def _count_routed_prefix(self, request: DispatchRequest, prefill: InstanceState, num_cached_tokens: int) -> None:
        """What kv routing expected the chosen P to hold against what it served from its cache:
        a miss is a prefix the index believed there that was evicted, or not there yet."""
        expected, passed_over = request.blocks.expected_hit_tokens, request.blocks.passed_over_tokens
        if self.metrics is not None and passed_over:
            self.metrics.routed_prefix_tokens.labels(outcome="passed_over").inc(passed_over)
        if not expected:
            return
        served = min(expected, num_cached_tokens)
        if served < expected:
            logger.debug(
                "prefill of %s on %s: %d cached prompt tokens expected, %d served",
                request.request_id,
                prefill.address,
                expected,
                num_cached_tokens,
            )
        if self.metrics is not None:
            self.metrics.routed_prefix_tokens.labels(outcome="served").inc(served)
            self.metrics.routed_prefix_tokens.labels(outcome="missed").inc(expected - served)

    async def _reprefill(
        self, request: DispatchRequest, prefill_request_id: str, prefer: InstanceState | None
    ) -> PinnedKV:
        """The prompt's KV again, pinned under a new id (steps 3 and 4); the token P samples is not used."""
        prefilled, prefill, _ = await self.prefill(
            request, prefill_request_id, request.sampling, kv_only=True, prefer=prefer
        )
        if not prefilled.HasField("kv"):
            raise RuntimeError(f"prefill instance {prefill.address} pinned nothing for a kv_only prefill (bug)")
        return PinnedKV(prefill, prefilled.kv)

    # ---------------------------------------------------------------- decode

    async def decode_and_migrate(
        self, request: DispatchRequest, pinned: PinnedKV | None, output_token_ids: list[int]
    ) -> AsyncGenerator[TokenEvent, None]:
        """Decode after ``output_token_ids`` (the tokens already sent; P's first token after a
        prefill there), from P's pinned KV, or prefilling on D itself when ``pinned`` is None.
        A lost KV goes back to prefill (step 3); a D that fails after streaming, or hands the
        request over, passes it to another one (step 4), a failure within the request's budget."""
        decoding = False  # a D has streamed: it owns the KV now and releases P itself
        current = request  # what the next Decode call continues: the prompt, plus tokens moved in by migrations
        num_migrations = handoff = 0
        handed_over_by: list[InstanceState] = []  # draining Ds: the request never goes back to one
        resumable = request.sampling.WhichOneof("structured") is None
        try:
            while True:
                handoff += 1
                may_hand_over = resumable and len(handed_over_by) < MAX_HANDOVERS
                try:
                    if pinned is None:
                        stream = self._decode(current, avoid=handed_over_by, may_hand_over=may_hand_over)
                    else:
                        stream = self._decode(
                            current,
                            pinned.handle,
                            output_token_ids[-1],
                            allow_recompute=handoff >= MAX_HANDOFFS,
                            avoid=handed_over_by,
                            may_hand_over=may_hand_over,
                        )
                    async for event in stream:
                        decoding = True
                        output_token_ids.extend(event.token_ids)
                        yield event
                    return
                except KVLost as lost:
                    if pinned is None or handoff >= MAX_HANDOFFS:
                        raise instance_failure(
                            HTTPStatus.SERVICE_UNAVAILABLE, f"no decode instance could take the KV: {lost}"
                        ) from None
                    logger.warning(
                        "hand-off %d of %s lost its KV (%s); prefilling it again", handoff, request.request_id, lost
                    )
                    if request.trace is not None:
                        request.trace.event(
                            "kv re-prefill", {"splitserve.handoff": handoff, "splitserve.reason": str(lost)}
                        )
                    if self.metrics is not None:
                        self.metrics.kv_reprefills.inc()
                    self.release(pinned)  # a no-op if D's release got there first
                    pinned = await self._reprefill(current, f"{request.request_id}.kv{handoff}", prefer=pinned.prefill)
                    continue
                except DecodeLost as lost:
                    if not resumable:
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
                    outcome, suffix = "resumed", f"m{num_migrations}"
                    reason = lost.api_error.detail or lost.api_error.message
                    logger.warning(
                        "decode of %s failed after %d tokens (%s); migrating it (%d of at most %d)",
                        request.request_id,
                        len(output_token_ids),
                        reason,
                        num_migrations,
                        self.max_migrations,
                    )
                except HandedOver as handed:
                    handed_over_by.append(handed.instance)
                    outcome, suffix, reason = "handed_over", f"h{len(handed_over_by)}", str(handed)
                    logger.info("%s after %d tokens; resuming it on another one", reason, len(output_token_ids))
                # A migration or a hand-over: the last D took P's KV over when it streamed; the new KV
                # is the resumed prompt's, prefilled on a P whatever the first path was (it is long by
                # now, and mostly cached).
                resumed = resume_request(request, output_token_ids)
                if resumed is None:  # the last D had sent every token but not the finish
                    yield TokenEvent(token_ids=[], logprobs=[], finish_reason="length")
                    return
                if self.metrics is not None:
                    self.metrics.migrations.labels(outcome=outcome).inc()
                if request.trace is not None:
                    request.trace.event(
                        "migration",
                        {
                            "splitserve.migration": num_migrations,
                            "splitserve.handovers": len(handed_over_by),
                            "splitserve.num_output_tokens": len(output_token_ids),
                            "splitserve.reason": reason,
                        },
                    )
                if not decoding and pinned is not None:
                    self.release(pinned)  # handed over before a token: nobody pulled P's KV
                decoding, handoff = False, 0
                current = resumed
                # Back to the P that holds the prefix; kv routing finds the prefix itself.
                prefer = pinned.prefill if pinned is not None and self.pool.routing == "load" else None
                pinned = await self._reprefill(current, f"{request.request_id}.{suffix}", prefer=prefer)
        finally:
            if not decoding and pinned is not None:
                self.release(pinned)

    async def _decode(
        self,
        request: DispatchRequest,
        handle: disaggregation_pb2.KVHandle | None = None,
        first_token_id: int = 0,
        allow_recompute: bool = False,
        avoid: list[InstanceState] | None = None,
        may_hand_over: bool = False,
    ) -> AsyncGenerator[TokenEvent, None]:
        """One hand-off (step 2): decode from P's KV ``handle``, continuing after
        ``first_token_id`` (only a D with the handle's fingerprint can take it); with no
        handle, D prefills the prompt itself (conditional disaggregation). Never on a D in
        ``avoid`` (those that handed the request over)."""
        message = disaggregation_pb2.DecodeRequest(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=request.sampling,
            priority=request.priority,
            allow_recompute=allow_recompute,
            cache_salt=request.cache_salt,
            may_hand_over=may_hand_over,
        )
        avoided = avoid or []
        fingerprint = None
        if handle is not None:
            message.first_token_id = first_token_id
            message.kv.CopyFrom(handle)
            fingerprint = handle.fingerprint
        num_prompt_tokens = len(request.prompt_token_ids)
        async for event in self.stream(
            "decode",
            lambda tried: self.pool.pick(
                "decode",
                exclude=tried + avoided,
                fingerprint=fingerprint,
                num_prompt_tokens=num_prompt_tokens,
                prompt=request.blocks,
            ),
            lambda decode, metadata: self.open_call(decode, "decode", message, request.timeout_s(), metadata),
            request,
        ):
            yield event

    def open_call(
        self,
        instance: InstanceState,
        body: CallBody,
        request: disaggregation_pb2.DecodeRequest | generation_pb2.GenerateRequest,
        timeout_s: float | None,
        metadata: Metadata | None,
    ) -> StreamingCall:
        """A streaming call to ``instance``, over this process's call stream to it unless the
        pool says per call (``--instance-calls``)."""
        mux = instance.call_mux if self.pool.multiplex_calls else None
        return open_streaming_call(mux, instance.channel, body, request, timeout_s, metadata)

    async def stream(
        self,
        role: Role,
        pick: Callable[[list[InstanceState]], InstanceState | None],
        open_stream: Callable[[InstanceState, Metadata | None], StreamingCall],
        request: DispatchRequest,
    ) -> AsyncGenerator[TokenEvent, None]:
        """Stream from the first instance that takes the request. Until it has streamed
        something, a failure moves the request to another instance of the role (or, for
        DATA_LOSS, back to prefill: :class:`KVLost`); after that the request fails (its
        tokens are out), or migrates when it was decoding (:class:`DecodeLost`).
        ``open_stream`` makes the call, with the metadata given (the trace's context)."""
        tried: list[InstanceState] = []
        last_error: grpc.aio.AioRpcError | None = None
        num_attempts = 0
        while num_attempts < MAX_ATTEMPTS:
            instance = self._within_limits(lambda: pick(tried))
            if instance is None:
                break
            tried.append(instance)
            with call_trace(request.trace, _STREAM_METHODS[role], instance) as traced:
                sent_at = time.monotonic()
                call = open_stream(instance, traced.metadata)
                streamed = False
                try:
                    with instance.call() as mark_running:
                        async for response in call:
                            if role == "decode" and response.handed_over:
                                raise HandedOver(instance)
                            first, streamed = not streamed, True
                            mark_running()
                            event = TokenEvent.from_response(response, first)
                            handed_over = False
                            if first:
                                event.call_sent_at, event.answered_at = sent_at, time.monotonic()
                            elif isinstance(call, MuxCall):
                                # Responses that queued up while this stream was behind go out as one
                                # event: one detokenizer pass, one chunk, one write for all of them.
                                for queued in call.take_ready():
                                    if role == "decode" and queued.handed_over:
                                        handed_over = True
                                        break
                                    event.extend(TokenEvent.from_response(queued, False))
                            yield event
                            if handed_over:
                                raise HandedOver(instance)
                    return
                except grpc.aio.AioRpcError as error:
                    traced.failed(error)
                    if error.code() == grpc.StatusCode.DATA_LOSS and not streamed:
                        raise KVLost(error.details()) from None
                    last_error = self._failed(instance, error, role, request.trace)
                    num_attempts += not unreachable(instance, error)
                    if streamed:
                        api_error = _as_api_error(
                            error, f"{role} instance {instance.instance_id} at {instance.address} failed mid-stream"
                        )
                        if role == "decode":
                            raise DecodeLost(api_error) from error
                        raise api_error from error
                finally:
                    if not call.done():
                        call.cancel()  # the instance aborts the request and frees its blocks
        raise _exhausted(role, last_error, tried)

    # --------------------------------------------------------------- cleanup

    def release(self, pinned: PinnedKV) -> None:
        """Free P's pinned blocks now rather than at lease expiry, once nobody will pull them
        (a no-op if D already released them). It must outlive the request's task."""
        prefill = pinned.prefill
        self._background.spawn(release_kv(prefill.channel, pinned.prefill_request_id, prefill.address))

    async def drain(self) -> None:
        """Wait for background cleanup (releases, aborts) to reach the instances."""
        await self._background.wait()

    # --------------------------------------------------------------- helpers

    def _within_limits(self, pick: Callable[[], InstanceState | None]) -> InstanceState | None:
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

    def _failed(
        self, instance: InstanceState, error: grpc.aio.AioRpcError, phase: str, trace: RequestTrace | None
    ) -> grpc.aio.AioRpcError:
        """Classify a failed call: the client's fault raises now; otherwise try elsewhere."""
        code = error.code()
        if code not in _RETRYABLE:
            raise _as_api_error(error, f"{phase} instance {instance.instance_id} at {instance.address}")
        logger.warning(
            "%s on %s failed (%s: %s); trying another instance", phase, instance.address, code.name, error.details()
        )
        if trace is not None:
            trace.event(
                "retry",
                {
                    "splitserve.phase": phase,
                    "splitserve.instance.id": instance.instance_id,
                    "rpc.grpc.status_code": code.name,
                },
            )
        if code in _INSTANCE_DOWN:
            self.pool.record_failure(instance)
        return error


def unreachable(instance: InstanceState, error: grpc.aio.AioRpcError) -> bool:
    """Whether a failed call never reached the instance: gRPC could not connect (its channel
    is failing to), so the instance holds nothing of the request. Such a try costs the
    request a connection attempt, not one of its ``MAX_ATTEMPTS``: when a host with several
    instances dies, its neighbours in the ranking are all dead at once, and the request goes
    on past them to an instance that is up (``tried`` keeps each instance to one try)."""
    return (
        error.code() == grpc.StatusCode.UNAVAILABLE
        and instance.channel.get_state(try_to_connect=False) == grpc.ChannelConnectivity.TRANSIENT_FAILURE
    )


def _exhausted(role: str, last_error: grpc.aio.AioRpcError | None, tried: list[InstanceState]) -> APIError:
    if last_error is None:
        return no_instance(role)
    names = ", ".join(f"{s.instance_id} at {s.address}" for s in tried)
    return _as_api_error(last_error, f"every {role} instance tried failed ({names}); last")


def _as_api_error(error: grpc.aio.AioRpcError, where: str) -> APIError:
    code = error.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return APIError(HTTPStatus.BAD_REQUEST, error.details() or "invalid request")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return APIError(HTTPStatus.GATEWAY_TIMEOUT, "the request timed out", code="timeout")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return instance_failure(HTTPStatus.TOO_MANY_REQUESTS, f"{where}: {error.details()}")
    return instance_failure(HTTPStatus.SERVICE_UNAVAILABLE, f"{where}: {code.name}: {error.details()}")
