"""A request's time at the gateway: when it arrived and what the edge did before dispatching it
(:class:`EdgeTiming`, always kept: its TTFT counts from the arrival), and, with tracing on,
its spans (:class:`RequestTrace`, ``cluster/tracing.py`` for the rest of the trace).

The spans of one request here, in call order:

1. The root, from the request's arrival at the gate to its end (``GenerationService.stream``):
   named as OpenTelemetry's GenAI conventions name an inference (``chat MODEL``,
   ``text_completion MODEL``), with their ``gen_ai.*`` attributes and vLLM's latency ones;
   it continues the client's ``traceparent`` when there is one.
2. The edge's costly stages, children of the root: chat template, tokenizing, grammar
   compile, each including its wait for a worker (``gateway/work_pool.py``), recorded when
   the request ends, as the first token's event: only what a call needs (the root, each
   call's span) is made on the way to the first token.
3. One client span per call to an instance (:func:`call_trace`), attempts that failed
   included: ``splitserve.v1.Prefill/Prefill``, ``splitserve.v1.Decode/Decode``,
   ``splitserve.v1.Generation/Generate``; its ``traceparent`` travels in the call's metadata
   and the instance's spans hang under it.
4. Events on the root: the first token (with the TTFT phases), a retry on another instance,
   a KV re-prefill, a migration (``gateway/failover.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from cluster.request_phases import HANDOFF_PHASES, TTFT_PHASES, phase_seconds
from cluster.tracing import Attributes, Tracer, trace_id_of, wall_ns
from splitserve.v1.generation_pb2 import RequestPhases

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from gateway.instances import InstanceState

Metadata = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class EdgeStage:
    name: str  # "chat template", "tokenize", "grammar compile"
    started_at: float  # monotonic seconds
    ended_at: float


@dataclass(slots=True)
class EdgeTiming:
    """A request's arrival at the gate and the costly stages after it (monotonic seconds)."""

    arrived_at: float = field(default_factory=time.monotonic)
    stages: list[EdgeStage] = field(default_factory=list)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        started_at = time.monotonic()
        try:
            yield
        finally:
            self.stages.append(EdgeStage(name, started_at, time.monotonic()))


class RequestTrace:
    """One request's spans at the gateway; made by ``GenerationService.prepare`` when tracing is on."""

    def __init__(
        self,
        tracer: Tracer,
        name: str,
        caller: Mapping[str, str] | None,
        edge: EdgeTiming,
        attributes: Attributes,
    ) -> None:
        self.tracer = tracer
        self.root: Span = tracer.start(name, tracer.parent(caller), edge.arrived_at, "server", attributes)
        self._edge = edge  # its stages become spans at the end, off the path to the first token

    @property
    def trace_id(self) -> str:
        return trace_id_of(self.root)

    def event(self, name: str, attributes: Attributes | None = None) -> None:
        self.root.add_event(name, attributes)

    def finish(
        self,
        ended_at: float,
        outcome: str,
        attributes: Attributes,
        first_token_at: float | None = None,
        phases: RequestPhases | None = None,
    ) -> None:
        """End the root once the request has ended: with the edge's stages, the first token
        (``first_token_at``, monotonic) and its TTFT phases, and the hand-off's phases."""
        for stage in self._edge.stages:
            self.tracer.record(stage.name, self.root, stage.started_at, stage.ended_at)
        self.root.set_attributes(attributes)
        if first_token_at is not None and phases is not None:
            ttft_s = first_token_at - self._edge.arrived_at
            ttft = {f"splitserve.phase.{phase}": phase_seconds(phases, phase) for phase in TTFT_PHASES}
            self.root.add_event(
                "first token", {"gen_ai.latency.time_to_first_token": ttft_s, **ttft}, wall_ns(first_token_at)
            )
            self.root.set_attributes(
                {
                    "gen_ai.latency.time_to_first_token": ttft_s,
                    "gen_ai.latency.time_in_queue": phases.gateway_queue_s + phases.prefill_queue_s,
                    **ttft,
                }
            )
        if phases is not None and phases.decode_queue_s + phases.kv_pull_s + phases.first_decode_step_s:
            self.root.set_attributes(
                {f"splitserve.phase.{phase}": phase_seconds(phases, phase) for phase in HANDOFF_PHASES}
            )
        if outcome not in ("stop", "length", "abort"):
            from opentelemetry.trace import Status, StatusCode

            self.root.set_status(Status(StatusCode.ERROR, outcome))
        self.root.end(end_time=wall_ns(ended_at))


class CallTrace:
    """One call to an instance: its client span and the metadata that carries its context;
    nothing (``metadata`` None) when the request is not traced."""

    def __init__(self, trace: RequestTrace | None, method: str, instance: InstanceState) -> None:
        self.span: Span | None = None
        self.metadata: Metadata | None = None
        self._failed = False
        if trace is None:
            return
        service, _, name = method.rpartition("/")
        self.span = trace.tracer.start(
            method,
            trace.root,
            kind="client",
            attributes={
                "rpc.system": "grpc",
                "rpc.service": service,
                "rpc.method": name,
                "server.address": instance.address,
                "splitserve.instance.id": instance.instance_id,
            },
        )
        self.metadata = trace.tracer.traceparent(self.span)

    def failed(self, error: grpc.aio.AioRpcError) -> None:
        """The call ended with ``error`` (another instance may be tried)."""
        if self.span is not None:
            self._failed = True
            self._error(self.span, error.code().name, error.details() or "")

    def end(self, error: BaseException | None) -> None:
        if self.span is None:
            return
        if isinstance(error, (GeneratorExit, asyncio.CancelledError)):
            self.span.set_attribute("splitserve.cancelled", True)  # the request ended meanwhile
        elif error is not None and not self._failed:
            self._error(self.span, type(error).__name__, str(error))
        self.span.end()

    @staticmethod
    def _error(span: Span, code: str, description: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        span.set_attribute("rpc.grpc.status_code", code)
        span.set_status(Status(StatusCode.ERROR, f"{code}: {description}"))


@contextlib.contextmanager
def call_trace(trace: RequestTrace | None, method: str, instance: InstanceState) -> Iterator[CallTrace]:
    """The block makes one call to ``instance``; it passes ``.metadata`` with the call."""
    call = CallTrace(trace, method, instance)
    try:
        yield call
    except BaseException as error:
        call.end(error)
        raise
    call.end(None)


def caller_trace_headers(headers: Mapping[str, Any] | None) -> dict[str, str] | None:
    """The W3C trace headers of a client's request (HTTP headers or gRPC metadata), if any."""
    if headers is None:
        return None
    found = {key.lower(): str(value) for key, value in headers.items() if key.lower() in ("traceparent", "tracestate")}
    return found or None
