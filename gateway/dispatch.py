"""One request's path through the instances, in call order (what happens when an instance
fails on it: ``gateway/failover.py``):

1. :meth:`Dispatcher.generate`: with colocated instances in the pool, the request streams
   from one of them (``Generation.Generate``, both phases there) and the path ends here.
2. :meth:`Dispatcher._pd_decision`: with ``--disagg-min-prompt-tokens``, a prompt that D
   would mostly not have to compute (short, or in its prefix cache) skips P: the Decode
   call (step 5) carries no handle and D prefills it itself.
3. Prefill on a P (:meth:`Failover.prefill <gateway.failover.Failover.prefill>`): P runs
   the prompt, samples the first token and keeps the prompt's KV pinned under a lease; its
   answer carries the token and the KV handle.
4. The first token goes to the client at once. If the stream ends there (the client left, a
   stop string matched), P's blocks are released in the background.
5. Decode on a D with P's handle (:meth:`Failover.decode_and_migrate
   <gateway.failover.Failover.decode_and_migrate>`): D pulls the KV, releases P, and
   streams the tokens after the first, which go to the client as they come. Ending the
   stream early cancels the Decode call (D aborts and frees at once) and releases P's
   blocks if no D took them.

Instance limits first: instances over ``--max-queue-delay`` or ``--max-inflight-per-instance``
take nothing new (``gateway.instance_limits``); when none qualifies the request gets 429 with
``Retry-After`` before any instance sees it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Literal

from gateway.dispatch_request import DispatchRequest, PinnedKV, TokenEvent
from gateway.failover import Failover
from gateway.flags import DEFAULT_MAX_MIGRATIONS
from gateway.instances import InstancePool
from gateway.metrics import GatewayMetrics
from splitserve.v1 import generation_pb2

PDPath = Literal["disaggregated", "decode"]  # prefill on a P and hand off, or on the D itself


class Dispatcher:
    def __init__(
        self,
        pool: InstancePool,
        metrics: GatewayMetrics | None = None,
        max_migrations: int = DEFAULT_MAX_MIGRATIONS,
        disagg_min_prompt_tokens: int = 0,
    ) -> None:
        self.failover = Failover(pool, metrics, max_migrations)
        if disagg_min_prompt_tokens < 0:
            raise ValueError(
                f"--disagg-min-prompt-tokens must be >= 0 (0: always disaggregate), got {disagg_min_prompt_tokens}"
            )
        self.pool = pool
        self.metrics = metrics
        self.disagg_min_prompt_tokens = disagg_min_prompt_tokens

    async def generate(self, request: DispatchRequest) -> AsyncGenerator[TokenEvent, None]:
        """Stream a request's tokens. Raises APIError (before or between events) on failure."""
        if self.pool.healthy("colocated"):
            async for event in self._colocated(request):
                yield event
            return
        path, reason = self._pd_decision(request)
        if self.metrics is not None:
            self.metrics.pd_decisions.labels(path=path, reason=reason).inc()
        if path == "decode":
            async for event in self.failover.decode_and_migrate(request, None, []):
                yield event
            return
        prefilled, prefill, sent_at = await self.failover.prefill(request, request.request_id, request.sampling)
        answered_at = time.monotonic()
        first = TokenEvent(
            token_ids=[prefilled.first_token_id],
            logprobs=[prefilled.first_logprob] if prefilled.HasField("first_logprob") else [],
            finish_reason=prefilled.finish_reason or None,
            num_cached_tokens=prefilled.num_cached_tokens,
            phases=prefilled.phases if prefilled.HasField("phases") else None,
            call_sent_at=sent_at,
            answered_at=answered_at,
        )
        if first.finish_reason is None and not prefilled.HasField("kv"):
            raise RuntimeError(
                f"prefill instance {prefill.address} returned neither a KV handle nor a finish reason (bug)"
            )
        if first.finish_reason is not None:
            yield first
            return
        pinned = PinnedKV(prefill, prefilled.kv)
        try:
            yield first
        except BaseException:  # the stream ended at its first token (client gone, stop string)
            self.failover.release(pinned)
            raise
        async for event in self.failover.decode_and_migrate(request, pinned, [prefilled.first_token_id]):
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

    async def _colocated(self, request: DispatchRequest) -> AsyncGenerator[TokenEvent, None]:
        message = generation_pb2.GenerateRequest(
            request_id=request.request_id,
            token_ids=generation_pb2.TokenIds(ids=request.prompt_token_ids),
            sampling=request.sampling,
            priority=request.priority,
            cache_salt=request.cache_salt,
        )
        num_prompt_tokens = len(request.prompt_token_ids)
        async for event in self.failover.stream(
            "colocated",
            lambda tried: self.pool.pick(
                "colocated", exclude=tried, num_prompt_tokens=num_prompt_tokens, prompt=request.blocks
            ),
            lambda instance, metadata: self.failover.open_call(
                instance, "generate", message, request.timeout_s(), metadata
            ),
            request,
        ):
            yield event

    async def drain(self) -> None:
        """Wait for background cleanup (releases, aborts) to reach the instances."""
        await self.failover.drain()
