"""A real OTLP/gRPC trace receiver on loopback for the tracing tests (opentelemetry-proto's
TraceService), and what they read in a trace: the spans it was sent, each with the service
and instance that sent it, their attributes and events, the W3C header that starts a trace."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

SPAN_ORDER_SLACK_NS = 1_000_000  # spans of different processes: their clocks converted to wall time apart
GATEWAY, PREFILL, DECODE = "splitserve-gateway", "splitserve-prefill", "splitserve-decode"
PREFILL_CALL, DECODE_CALL = "splitserve.v1.Prefill/Prefill", "splitserve.v1.Decode/Decode"


def attribute_values(pairs: Iterable[common_pb2.KeyValue]) -> dict[str, Any]:
    """A span's (or an event's) attributes as plain values (None for an empty one)."""
    return {kv.key: _value(kv.value) for kv in pairs}


def _value(value: common_pb2.AnyValue) -> Any:
    which = value.WhichOneof("value")
    return getattr(value, which) if which is not None else None


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    service: str
    instance: str
    span: trace_pb2.Span

    @property
    def name(self) -> str:
        return self.span.name

    @property
    def is_root(self) -> bool:
        """The gateway's span of the whole request."""
        return self.service == GATEWAY and self.span.kind == trace_pb2.Span.SPAN_KIND_SERVER

    def attribute(self, key: str) -> Any:
        values = attribute_values(self.span.attributes)
        if key not in values:
            raise KeyError(f"{self.name} ({self.service}) has no attribute {key}")
        return values[key]

    def events(self, name: str) -> list[trace_pb2.Span.Event]:
        return [event for event in self.span.events if event.name == name]


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._changed = threading.Condition()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def Export(self, request, context):  # noqa: N802 - gRPC signature
        with self._changed:
            for resource_spans in request.resource_spans:
                resource = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    self.spans += [
                        ReceivedSpan(resource["service.name"], resource["service.instance.id"], span)
                        for span in scope_spans.spans
                    ]
            self._changed.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, done: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 60.0) -> list[ReceivedSpan]:
        with self._changed:
            assert self._changed.wait_for(lambda: done(self.spans), timeout_s), [
                (s.service, s.name) for s in self.spans
            ]
            return list(self.spans)

    def trace(self, trace_id: str, done: Callable[[list[ReceivedSpan]], bool]) -> list[ReceivedSpan]:
        """The spans of one trace (32 hex digits), once ``done`` holds for them."""
        wanted = bytes.fromhex(trace_id)

        def of_trace(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
            return [s for s in spans if s.span.trace_id == wanted]

        return of_trace(self.wait_for(lambda spans: done(of_trace(spans))))


@contextmanager
def running_collector() -> Iterator[Collector]:
    receiver = Collector()
    try:
        yield receiver
    finally:
        receiver.server.stop(grace=None)


def traceparent(trace_id: str, span_id: str | None = None) -> dict[str, str]:
    """The W3C header of a client's span in ``trace_id`` (``span_id``: a random one by default)."""
    return {"traceparent": f"00-{trace_id}-{span_id or secrets.token_hex(8)}-01"}


def new_trace_id() -> str:
    return secrets.token_hex(16)


def one(spans: list[ReceivedSpan], service: str, name: str) -> ReceivedSpan:
    (found,) = [s for s in spans if s.service == service and s.name == name]
    return found


def in_order(*spans: trace_pb2.Span) -> None:
    """Each span starts after the one before it started (and they nest or follow each other)."""
    for earlier, later in zip(spans, spans[1:]):
        assert earlier.start_time_unix_nano <= later.start_time_unix_nano + SPAN_ORDER_SLACK_NS, (earlier, later)
