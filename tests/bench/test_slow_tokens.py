"""bench/slow_tokens.py: the receiver keeps the decode span's ``slow token`` events it is sent
over OTLP/gRPC, and files each gap under the cause its step's figures give."""

from __future__ import annotations

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from bench import slow_tokens
from bench.slow_tokens import SlowToken


def _attribute(key: str, value: float | int | str) -> common_pb2.KeyValue:
    if isinstance(value, str):
        return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(string_value=value))
    if isinstance(value, float):
        return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(double_value=value))
    return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(int_value=value))


def _event(gap_s: float, step_s: float, **counts: int) -> trace_pb2.Span.Event:
    figures = {"num_rows": 3, "num_decodes": 3, "num_prefill_tokens": 0, "num_preempted": 0, "num_loads_finished": 0}
    figures |= counts
    return trace_pb2.Span.Event(
        name="slow token",
        attributes=[
            _attribute("splitserve.gap_s", gap_s),
            _attribute("splitserve.step.seconds", step_s),
            *(_attribute(f"splitserve.step.{name}", value) for name, value in figures.items()),
        ],
    )


def _token(gap_s: float, step_s: float, **counts: int) -> SlowToken:
    figures = {"num_rows": 3, "num_decodes": 3, "num_prefill_tokens": 0, "num_preempted": 0, "num_loads_finished": 0}
    return SlowToken("splitserve-decode", "d0", gap_s, step_s, **(figures | counts))


def test_the_receiver_keeps_the_slow_token_events_of_the_spans_it_is_sent() -> None:
    span = trace_pb2.Span(
        name="splitserve.v1.Decode/Decode",
        events=[_event(0.5, 0.45, num_preempted=1), trace_pb2.Span.Event(name="kv lease renewed"), _event(0.3, 0.01)],
    )
    request = trace_service_pb2.ExportTraceServiceRequest(
        resource_spans=[
            trace_pb2.ResourceSpans(
                resource=resource_pb2.Resource(
                    attributes=[
                        _attribute("service.name", "splitserve-decode"),
                        _attribute("service.instance.id", "d0"),
                    ]
                ),
                scope_spans=[trace_pb2.ScopeSpans(spans=[span, trace_pb2.Span(name="kv pull")])],
            )
        ]
    )
    with slow_tokens.receiving() as (receiver, endpoint), grpc.insecure_channel(endpoint.split("//")[1]) as channel:
        trace_service_pb2_grpc.TraceServiceStub(channel).Export(request, timeout=10)
    assert receiver.num_spans == 2
    assert receiver.slow_tokens == [
        _token(0.5, 0.45, num_preempted=1),
        _token(0.3, 0.01),
    ]
    assert [t.cause for t in receiver.slow_tokens] == ["preempted", "outside the step"]


def test_each_gap_is_filed_under_the_first_cause_that_holds() -> None:
    assert _token(0.4, 0.3, num_preempted=2, num_prefill_tokens=64).cause == "preempted"
    assert _token(0.4, 0.3, num_prefill_tokens=64, num_loads_finished=1).cause == "prefill in step"
    assert _token(0.4, 0.3, num_loads_finished=1).cause == "loads finished"
    assert _token(0.4, 0.1).cause == "outside the step"
    assert _token(0.4, 0.3, num_rows=40).cause == "long step"


def test_the_summary_counts_only_gaps_over_the_threshold_and_lists_the_largest_first() -> None:
    tokens = [_token(0.25, 0.2), _token(0.9, 0.1), _token(0.15, 0.1), _token(0.6, 0.5, num_loads_finished=1)]
    summary = slow_tokens.summarize(tokens, over_s=0.2)
    assert summary["num_gaps"] == 3
    assert summary["by_cause"] == {
        "loads finished": {"count": 1, "max_gap_ms": 600.0, "mean_step_ms": 500.0, "mean_outside_ms": 100.0},
        "outside the step": {"count": 1, "max_gap_ms": 900.0, "mean_step_ms": 100.0, "mean_outside_ms": 800.0},
        "long step": {"count": 1, "max_gap_ms": 250.0, "mean_step_ms": 200.0, "mean_outside_ms": 50.0},
    }
    assert [row["gap_s"] for row in summary["largest"]] == [0.9, 0.6, 0.25]
    assert "| outside the step | 1 | 900 | 100 | 800 |" in slow_tokens.table(summary)
