"""An instance's side of a request's phases and trace spans, made from the plain timestamps the
engine keeps (``engine/request_timing.py``) and those the servicer takes itself (the call's
arrival, its answer, the KV publish or pull).

Each servicer, once the engine has handed the request's first output over:

1. builds the call's :class:`RequestPhases` (:func:`prefill_phases`, :func:`handoff_phases`,
   :func:`local_phases`), which travel to the gateway in its answer (the gateway adds its own
   and the rest: its TTFT is their sum) and into this instance's histograms
   (``serving/metrics.py``, ``PhaseMetrics``);
2. with tracing on, records the call's spans under the context the gateway sent in the call's
   metadata (``cluster/tracing.py``): the call's server span and, inside it, the queue, each
   prompt chunk, the KV publish (P), or the queue for blocks, the KV pull and the first
   decode step (D); then, as a stream goes on, each token that came late as an event with
   the step that made it (:meth:`CallSpans.step`).

D starts its call's server span when the call arrives rather than at the first output: while
it holds P's KV handle, its lease keeper (``decode_svc/leases.py``) adds each lease renewal P
confirms to that span as it happens (:meth:`CallSpans.kv_lease_renewed`), and a call handed
back before any token (its KV lost) still has its span. The spans inside it are recorded
after the first response all the same. P's call span has ended by the time D renews: the
renewals are events of D's span only.

Phase boundaries are the same moments on both paths, so the spans and the phases always agree.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from cluster.tracing import Attributes, Tracer, wall_ns
from engine.request_timing import RequestTiming, StepStats
from kv_connector.base import TransferStats
from splitserve.v1.generation_pb2 import RequestPhases

if TYPE_CHECKING:
    from opentelemetry.trace import Span

RPC_ATTRIBUTES = {"rpc.system": "grpc"}
# A gap between two of a stream's tokens longer than this is an event of its call's span.
SLOW_TOKEN_GAP_S = 0.2


@dataclass(frozen=True, slots=True)
class KVPublish:
    """P's publish of a request's KV (``prefill_svc/leases.py``), monotonic seconds."""

    started_at: float
    ended_at: float
    num_blocks: int
    connector: str


class KVPullRecord(Protocol):
    """D's pull of a hand-off's KV (``decode_svc/kv_loader.py``), monotonic seconds; ``stats``
    None when it failed (``error``) or never ran."""

    @property
    def started_at(self) -> float: ...
    @property
    def ended_at(self) -> float: ...
    @property
    def num_local_hit_blocks(self) -> int: ...
    @property
    def stats(self) -> TransferStats | None: ...
    @property
    def error(self) -> str | None: ...


def _first_scheduled(received_at: float, timing: RequestTiming) -> float:
    return timing.first_scheduled_at if timing.first_scheduled_at is not None else received_at


def _first_token(after: float, timing: RequestTiming) -> float:
    return timing.first_token_at if timing.first_token_at is not None else after


def prefill_phases(received_at: float, timing: RequestTiming, answered_at: float) -> RequestPhases:
    """A Prefill call's: its queue, its prompt's computation, and the KV publish up to its answer."""
    scheduled = _first_scheduled(received_at, timing)
    first_token = _first_token(scheduled, timing)
    return RequestPhases(
        prefill_queue_s=scheduled - received_at,
        prefill_compute_s=first_token - scheduled,
        kv_publish_s=answered_at - first_token,
        num_prefill_chunks=len(timing.prompt_chunks),
    )


def local_phases(received_at: float, timing: RequestTiming) -> RequestPhases:
    """A call whose prompt this instance prefilled itself (colocated, or D without a handle)."""
    scheduled = _first_scheduled(received_at, timing)
    return RequestPhases(
        prefill_queue_s=scheduled - received_at,
        prefill_compute_s=_first_token(scheduled, timing) - scheduled,
        num_prefill_chunks=len(timing.prompt_chunks),
    )


def handoff_phases(received_at: float, timing: RequestTiming) -> RequestPhases:
    """A Decode call with a KV handle: the wait for blocks, the pull, and the first decode step."""
    load_started = timing.kv_load_started_at if timing.kv_load_started_at is not None else received_at
    loaded = timing.kv_loaded_at if timing.kv_loaded_at is not None else load_started
    return RequestPhases(
        decode_queue_s=load_started - received_at,
        kv_pull_s=loaded - load_started,
        first_decode_step_s=_first_token(loaded, timing) - loaded,
        num_prefill_chunks=len(timing.prompt_chunks),  # a recompute after a failed pull
    )


# ------------------------------------------------------------------------------ spans


class CallSpans:
    """The spans of one gRPC call on an instance, under the context its caller sent."""

    def __init__(
        self,
        tracer: Tracer,
        method: str,
        metadata: Iterable[tuple[str, Any]] | None,
        received_at: float,
        attributes: Attributes,
    ) -> None:
        """``method``: ``splitserve.v1.Prefill/Prefill`` (the RPC conventions' span name);
        ``metadata``: the call's (``context.invocation_metadata()``), with the caller's context."""
        service, _, name = method.rpartition("/")
        self.tracer = tracer
        self.server = tracer.start(
            method,
            tracer.parent(metadata),
            received_at,
            kind="server",
            attributes={**RPC_ATTRIBUTES, "rpc.service": service, "rpc.method": name, **attributes},
        )
        self.received_at = received_at
        self._last_step_ended_at: float | None = None

    def prompt(self, timing: RequestTiming) -> None:
        """The queue before the first prompt chunk, and each chunk."""
        self.tracer.record("queue", self.server, self.received_at, _first_scheduled(self.received_at, timing))
        self.prompt_chunks(timing)

    def prompt_chunks(self, timing: RequestTiming) -> None:
        for index, chunk in enumerate(timing.prompt_chunks):
            self.tracer.record(
                "prefill chunk",
                self.server,
                chunk.started_at,
                chunk.ended_at,
                attributes={
                    "splitserve.chunk.index": index,
                    "splitserve.chunk.num_tokens": chunk.num_tokens,
                    "splitserve.step.num_batched_tokens": chunk.num_batched_tokens,
                },
            )

    def publish(self, publish: KVPublish) -> None:
        self.tracer.record(
            "kv publish",
            self.server,
            publish.started_at,
            publish.ended_at,
            attributes={"splitserve.kv.connector": publish.connector, "splitserve.kv.num_blocks": publish.num_blocks},
        )

    def handoff(self, timing: RequestTiming, pull: KVPullRecord | None, connector: str) -> None:
        """D's queue for blocks, its pull (bytes and blocks as the KV transfer metric counts
        them), and the step that sampled its first token."""
        load_started = timing.kv_load_started_at if timing.kv_load_started_at is not None else self.received_at
        self.tracer.record("decode queue", self.server, self.received_at, load_started)
        if pull is not None:
            attributes: dict[str, str | int | float] = {
                "splitserve.kv.connector": connector,
                "splitserve.kv.num_local_hit_blocks": pull.num_local_hit_blocks,
            }
            if pull.stats is not None:
                attributes |= {
                    "splitserve.kv.num_bytes": pull.stats.num_bytes,
                    "splitserve.kv.num_blocks": pull.stats.num_blocks,
                    "splitserve.kv.num_messages": pull.stats.num_messages,
                }
            span = self.tracer.start("kv pull", self.server, pull.started_at, attributes=attributes)
            if pull.error is not None:
                _set_error(span, pull.error)  # before the end: an ended span takes no status
            span.end(end_time=wall_ns(pull.ended_at))
        self.prompt_chunks(timing)  # a recompute after a failed pull
        self.first_step(timing)

    def first_step(self, timing: RequestTiming) -> None:
        if timing.first_token_step_started_at is not None and timing.first_token_at is not None:
            self.tracer.record(
                "first decode step", self.server, timing.first_token_step_started_at, timing.first_token_at
            )

    def step(self, step: StepStats) -> None:
        """A step that produced the call's tokens: a gap over :data:`SLOW_TOKEN_GAP_S` since the
        previous one becomes an event, with what the step held (rows, prompt tokens,
        preemptions, loads just finished), so that a trace says why a token came late."""
        previous, self._last_step_ended_at = self._last_step_ended_at, step.ended_at
        if previous is None or step.ended_at - previous <= SLOW_TOKEN_GAP_S:
            return
        self.server.add_event(
            "slow token",
            {
                "splitserve.gap_s": step.ended_at - previous,
                "splitserve.step.seconds": step.ended_at - step.started_at,
                "splitserve.step.num_rows": step.num_rows,
                "splitserve.step.num_decodes": step.num_decodes,
                "splitserve.step.num_prefill_tokens": step.num_prefill_tokens,
                "splitserve.step.num_preempted": step.num_preempted,
                "splitserve.step.num_loads_finished": step.num_loads_finished,
            },
            wall_ns(step.ended_at),
        )

    def kv_lease_renewed(self, prefill_address: str, prefill_request_id: str, lease_s: float) -> None:
        """P at ``prefill_address`` just confirmed the renewal of the lease on the KV this call
        holds: an event now, so that a trace shows D keeping P's blocks while the request
        waited for its pull. A renewal answered after the call ended adds nothing."""
        if self.server.is_recording():
            self.server.add_event(
                "kv lease renewed",
                {
                    "splitserve.kv.prefill_address": prefill_address,
                    "splitserve.kv.prefill_request_id": prefill_request_id,
                    "splitserve.kv.lease_s": lease_s,
                },
            )

    def end(self, ended_at: float, attributes: Attributes | None = None, error: str | None = None) -> None:
        """The call ended: its attributes (with :func:`spec_decode_attributes`) and outcome."""
        if attributes:
            self.server.set_attributes(attributes)
        if error is not None:
            _set_error(self.server, error)
        self.server.end(end_time=wall_ns(ended_at))


def spec_decode_attributes(num_draft_tokens: int, num_accepted_tokens: int) -> dict[str, int]:
    """A call's speculative decoding, for its span: drafts verified for the request and those
    the target accepted (nothing for a request that drafted nothing)."""
    if not num_draft_tokens:
        return {}
    return {
        "splitserve.spec.num_draft_tokens": num_draft_tokens,
        "splitserve.spec.num_accepted_tokens": num_accepted_tokens,
    }


def _set_error(span: Span, description: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, description))
