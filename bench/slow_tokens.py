"""Why a token came late: an OTLP/gRPC trace receiver in the benchmark's process that keeps
the ``slow token`` events the decode (and colocated) instances add to a call's span
(``serving/request_timing.py``: a gap over 200 ms between two of the call's steps, with what
the step that ended it held), and a table of them by cause.

A gap is the step's own time plus the time the engine spent on anything else since the
call's previous step (``outside``: other steps the call was not in, the event loop, the
operating system's scheduler). The cause a gap is filed under is the first that holds:

- ``preempted``: the step sent requests back to wait for blocks;
- ``prefill in step``: it computed prompt tokens (a recompute, or a colocated prefill);
- ``loads finished``: hand-offs whose pull had just finished joined it;
- ``outside the step``: most of the gap was spent outside the step;
- ``long step``: none of the above, the step itself was long (many rows).

``python -m bench.overload --explain-slow-tokens`` runs it beside the overload benchmark.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2

EVENT = "slow token"
CAUSES = ("preempted", "prefill in step", "loads finished", "outside the step", "long step")


@dataclass(frozen=True, slots=True)
class SlowToken:
    """One late token of one call, as its instance explained it."""

    service: str
    instance: str
    gap_s: float
    step_s: float
    num_rows: int
    num_decodes: int
    num_prefill_tokens: int
    num_preempted: int
    num_loads_finished: int

    @property
    def outside_s(self) -> float:
        return max(0.0, self.gap_s - self.step_s)

    @property
    def cause(self) -> str:
        if self.num_preempted:
            return "preempted"
        if self.num_prefill_tokens:
            return "prefill in step"
        if self.num_loads_finished:
            return "loads finished"
        if self.outside_s > self.step_s:
            return "outside the step"
        return "long step"


def _values(pairs: Any) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for kv in pairs:
        value: common_pb2.AnyValue = kv.value
        which = value.WhichOneof("value")
        values[kv.key] = getattr(value, which) if which is not None else None
    return values


def slow_token(service: str, instance: str, attributes: dict[str, Any]) -> SlowToken:
    return SlowToken(
        service=service,
        instance=instance,
        gap_s=float(attributes["splitserve.gap_s"]),
        step_s=float(attributes["splitserve.step.seconds"]),
        num_rows=int(attributes["splitserve.step.num_rows"]),
        num_decodes=int(attributes["splitserve.step.num_decodes"]),
        num_prefill_tokens=int(attributes["splitserve.step.num_prefill_tokens"]),
        num_preempted=int(attributes["splitserve.step.num_preempted"]),
        num_loads_finished=int(attributes["splitserve.step.num_loads_finished"]),
    )


class SlowTokenReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every ``slow token`` event of the spans it is sent; counts the spans."""

    def __init__(self) -> None:
        self.slow_tokens: list[SlowToken] = []
        self.num_spans = 0
        self._lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 - gRPC signature
        found: list[SlowToken] = []
        num_spans = 0
        for resource_spans in request.resource_spans:
            resource = _values(resource_spans.resource.attributes)
            service, instance = str(resource.get("service.name", "")), str(resource.get("service.instance.id", ""))
            for scope_spans in resource_spans.scope_spans:
                num_spans += len(scope_spans.spans)
                found += [
                    slow_token(service, instance, _values(event.attributes))
                    for span in scope_spans.spans
                    for event in span.events
                    if event.name == EVENT
                ]
        with self._lock:
            self.slow_tokens += found
            self.num_spans += num_spans
        return trace_service_pb2.ExportTraceServiceResponse()


@contextmanager
def receiving() -> Iterator[tuple[SlowTokenReceiver, str]]:
    """A receiver listening on a free loopback port, and its endpoint for ``--otlp-traces-endpoint``."""
    receiver = SlowTokenReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield receiver, f"http://127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def summarize(slow_tokens: list[SlowToken], over_s: float = 0.2) -> dict[str, Any]:
    """The gaps over ``over_s`` by cause (count, largest, mean step and outside time), and the
    ten largest with what their steps held."""
    gaps = sorted((t for t in slow_tokens if t.gap_s > over_s), key=lambda t: t.gap_s, reverse=True)
    by_cause: dict[str, dict[str, float]] = {}
    for cause in CAUSES:
        of_cause = [t for t in gaps if t.cause == cause]
        if of_cause:
            by_cause[cause] = {
                "count": len(of_cause),
                "max_gap_ms": round(1000 * of_cause[0].gap_s, 1),
                "mean_step_ms": round(1000 * sum(t.step_s for t in of_cause) / len(of_cause), 1),
                "mean_outside_ms": round(1000 * sum(t.outside_s for t in of_cause) / len(of_cause), 1),
            }
    largest = [{**asdict(t), "cause": t.cause, "outside_s": round(t.outside_s, 4)} for t in gaps[:10]]
    return {"num_gaps": len(gaps), "over_ms": 1000 * over_s, "by_cause": by_cause, "largest": largest}


def table(summary: dict[str, Any]) -> str:
    lines = [
        f"{summary['num_gaps']} token gaps over {summary['over_ms']:.0f} ms, by what the step that ended them held:",
        "",
        "| cause | gaps | largest (ms) | mean step (ms) | mean outside the step (ms) |",
        "|---|---|---|---|---|",
    ]
    for cause, row in summary["by_cause"].items():
        lines.append(
            f"| {cause} | {row['count']:.0f} | {row['max_gap_ms']:.0f} | {row['mean_step_ms']:.0f} | "
            f"{row['mean_outside_ms']:.0f} |"
        )
    return "\n".join(lines)
