"""A request's spans at the gateway (gateway/request_trace.py) through the dispatcher's
failover, in process: the fake instances of test_dispatch_failover, a real OpenTelemetry SDK
writing to memory. Each call to an instance is a client span under the request's root, a call
that failed is marked so, and a retry, a lost KV prefilled again and a migration are events of
the root. (tests/gateway/test_tracing.py follows one request across real processes.)"""

from __future__ import annotations

import time

import grpc
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from cluster.tracing import Tracer
from gateway.dispatch import Dispatcher
from gateway.request_trace import EdgeTiming, RequestTrace
from tests.gateway.test_dispatch_failover import (
    FIRST,
    FakeDecode,
    FakePrefill,
    collect,
    in_loop,
    make_pool,
    request,
    rpc_error,
    tokens,
)

Code = grpc.StatusCode


def traced_request() -> tuple[InMemorySpanExporter, RequestTrace, object]:
    exported = InMemorySpanExporter()
    tracer = Tracer("unused", "splitserve-gateway", "gateway-0", exporter=exported)
    edge = EdgeTiming()
    with edge.stage("tokenize"):
        pass
    trace = RequestTrace(tracer, "text_completion m", None, edge, {"gen_ai.operation.name": "text_completion"})
    dispatch = request()
    dispatch.trace = trace
    return exported, trace, dispatch


def finished(exported: InMemorySpanExporter, trace: RequestTrace) -> tuple[ReadableSpan, list[ReadableSpan]]:
    """The root and its children, in start order, once the request ended."""
    trace.finish(time.monotonic(), "length", {})
    spans = list(exported.get_finished_spans())
    (root,) = [span for span in spans if span.parent is None]
    children = sorted((span for span in spans if span.parent is not None), key=lambda span: span.start_time or 0)
    assert all(span.parent is not None and span.parent.span_id == root.context.span_id for span in children)
    return root, children


@in_loop
async def test_each_call_is_a_client_span_under_the_root_and_a_retry_is_an_event() -> None:
    exported, trace, dispatch = traced_request()
    failing, answering, decode = FakePrefill(rpc_error(Code.UNAVAILABLE)), FakePrefill(), FakeDecode()
    token_ids, error = await collect(Dispatcher(make_pool(prefill=[failing, answering], decode=[decode])), dispatch)
    assert error is None and token_ids[0] == FIRST
    root, children = finished(exported, trace)
    assert [span.name for span in children] == [
        "tokenize",
        "splitserve.v1.Prefill/Prefill",
        "splitserve.v1.Prefill/Prefill",
        "splitserve.v1.Decode/Decode",
    ]
    assert all(span.kind.name == "CLIENT" for span in children[1:])
    failed, served, decoded = children[1:]
    assert failed.attributes["server.address"] == failing.address
    assert failed.status.status_code == StatusCode.ERROR and failed.attributes["rpc.grpc.status_code"] == "UNAVAILABLE"
    assert served.attributes["server.address"] == answering.address and served.status.status_code == StatusCode.UNSET
    assert decoded.status.status_code == StatusCode.UNSET
    (retry,) = [event for event in root.events if event.name == "retry"]
    assert retry.attributes["splitserve.instance.id"] == failing.address
    assert retry.attributes["splitserve.phase"] == "prefill"


@in_loop
async def test_a_migration_is_an_event_of_the_root() -> None:
    exported, trace, dispatch = traced_request()
    prefill = FakePrefill()
    failing = FakeDecode([tokens(11), tokens(12), rpc_error(Code.UNAVAILABLE)])
    survivor = FakeDecode([tokens(13, 14), tokens(15, finish_reason="length")])
    token_ids, error = await collect(Dispatcher(make_pool(prefill=[prefill], decode=[failing, survivor])), dispatch)
    assert error is None and token_ids == [FIRST, 11, 12, 13, 14, 15]
    root, children = finished(exported, trace)
    (migration,) = [event for event in root.events if event.name == "migration"]
    assert migration.attributes["splitserve.migration"] == 1
    assert migration.attributes["splitserve.num_output_tokens"] == 3  # P's token, 11 and 12
    # Prefill, the D that failed mid-stream, the resumed prompt's prefill, the D that finished.
    assert [(span.name, span.attributes["server.address"], span.status.status_code) for span in children[1:]] == [
        ("splitserve.v1.Prefill/Prefill", prefill.address, StatusCode.UNSET),
        ("splitserve.v1.Decode/Decode", failing.address, StatusCode.ERROR),
        ("splitserve.v1.Prefill/Prefill", prefill.address, StatusCode.UNSET),
        ("splitserve.v1.Decode/Decode", survivor.address, StatusCode.UNSET),
    ]


@in_loop
async def test_a_kv_prefilled_again_is_an_event_of_the_root() -> None:
    exported, trace, dispatch = traced_request()
    prefill, decode = FakePrefill(), FakeDecode([rpc_error(Code.DATA_LOSS, "the pull failed")])
    token_ids, error = await collect(Dispatcher(make_pool(prefill=[prefill], decode=[decode])), dispatch)
    assert error is None and token_ids[0] == FIRST
    root, children = finished(exported, trace)
    (reprefill,) = [event for event in root.events if event.name == "kv re-prefill"]
    assert reprefill.attributes["splitserve.handoff"] == 1
    assert "the pull failed" in str(reprefill.attributes["splitserve.reason"])
    assert [(span.name, span.status.status_code) for span in children[1:]] == [
        ("splitserve.v1.Prefill/Prefill", StatusCode.UNSET),
        ("splitserve.v1.Decode/Decode", StatusCode.ERROR),
        ("splitserve.v1.Prefill/Prefill", StatusCode.UNSET),
        ("splitserve.v1.Decode/Decode", StatusCode.UNSET),
    ]
