"""What the dispatcher (``gateway/dispatch.py``) and its failover (``gateway/failover.py``)
pass around: a request as the instances see it (token ids in, token ids out), the tokens
they send back, and the prompt KV a prefill instance holds pinned for it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from http import HTTPStatus

from gateway.errors import APIError
from gateway.instances import InstanceState
from gateway.prefix_index import PromptBlocks
from gateway.request_trace import RequestTrace
from splitserve.v1 import disaggregation_pb2, generation_pb2


@dataclass(slots=True)
class DispatchRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: generation_pb2.SamplingParams
    priority: int = 0
    deadline: float = float("inf")  # monotonic
    cache_salt: str = ""  # mixed into prefix-cache hashes on every instance; empty: none
    trace: RequestTrace | None = None  # its spans at the gateway, when tracing is on
    _blocks: PromptBlocks | None = None

    @property
    def blocks(self) -> PromptBlocks:
        """The prompt's block-hash chains, for kv routing; computed on first use."""
        if self._blocks is None:
            self._blocks = PromptBlocks(self.prompt_token_ids, self.cache_salt)
        return self._blocks

    def timeout_s(self) -> float | None:
        """The time left for a call to an instance; None without a deadline. Raises a 504
        APIError once the deadline has passed."""
        if self.deadline == float("inf"):
            return None
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise APIError(HTTPStatus.GATEWAY_TIMEOUT, "the request timed out", code="timeout")
        return remaining


@dataclass(slots=True)
class TokenEvent:
    """New tokens for a request, as instances produce them."""

    token_ids: list[int]
    logprobs: list[generation_pb2.TokenLogprob]
    finish_reason: str | None = None  # "stop", "length", "abort"; None while running
    stop_token_id: int | None = None
    num_cached_tokens: int = 0  # first event only: prompt tokens a prefix cache served
    kv_transfer: disaggregation_pb2.KVTransfer | None = None  # the hand-off, when D reports it
    phases: generation_pb2.RequestPhases | None = None  # the instance's phases of its call, once per call
    # A call's first event: when the gateway sent the call and when its first answer came
    # (monotonic), around the instance's phases: the hop's time (cluster/request_phases.py).
    call_sent_at: float | None = None
    answered_at: float | None = None

    @classmethod
    def from_response(
        cls, response: disaggregation_pb2.DecodeResponse | generation_pb2.GenerateResponse, first: bool
    ) -> TokenEvent:
        """One streamed response of a decode or colocated instance; ``first``: the stream's first."""
        event = cls(
            token_ids=list(response.token_ids),
            logprobs=list(response.logprobs),
            finish_reason=response.finish_reason or None,
            stop_token_id=response.stop_token_id if response.HasField("stop_token_id") else None,
        )
        if isinstance(response, disaggregation_pb2.DecodeResponse):
            event.kv_transfer = response.kv_transfer if response.HasField("kv_transfer") else None
            event.num_cached_tokens = response.num_cached_tokens if first else 0  # set by a local prefill only
            event.phases = response.phases if response.HasField("phases") else None
        else:
            if first:
                event.num_cached_tokens = response.usage.cached_tokens
            if response.HasField("timings") and response.timings.HasField("phases"):
                event.phases = response.timings.phases
        return event

    def extend(self, later: TokenEvent) -> None:
        """Take in the tokens of a later event of the same call (neither is its first), so that
        they go out as one: what several responses that were waiting together say at once."""
        self.token_ids += later.token_ids
        self.logprobs += later.logprobs
        self.finish_reason = later.finish_reason
        self.stop_token_id = later.stop_token_id
        self.phases = self.phases or later.phases
        self.kv_transfer = self.kv_transfer or later.kv_transfer


@dataclass(slots=True)
class PinnedKV:
    """Prompt KV pinned on a P for this request: where, and under which id."""

    prefill: InstanceState
    handle: disaggregation_pb2.KVHandle

    @property
    def prefill_request_id(self) -> str:
        return self.handle.request_id
