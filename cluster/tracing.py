"""Distributed tracing with OpenTelemetry: each process (gateway, prefill, decode, colocated)
sends its spans of a request to an OTLP/gRPC collector, all in the request's one trace.

Off by default, and then free: without ``--otlp-traces-endpoint`` (or the standard
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``) no process
imports the OpenTelemetry SDK (:func:`start_tracing` returns None, and callers skip every
span), and a request carries no trace context. The flag and its helpers are light on
purpose: ``splitserve up`` reads them without the SDK.

On, spans never cost serving more than building them: a finished span goes into a bounded
queue (:data:`MAX_QUEUED_SPANS`; when it is full the newest spans are dropped, never waited
for) that the SDK's batch processor exports from a thread of its own, a batch at a time, each
export bounded by the exporter's timeout (``OTEL_EXPORTER_OTLP_TRACES_TIMEOUT``, 10 s). A
collector that is down or does not answer only makes that thread retry and drop; its
complaints are logged at most once a minute (:class:`_RateLimitedLog`), and shutting down
waits for it :data:`SHUTDOWN_TIMEOUT_S` at most.

A request's context, in call order:

1. Gateway: its root span continues the client's W3C ``traceparent`` header when it sends
   one (:meth:`Tracer.parent`), else starts a trace.
2. Gateway to instance: each gRPC call to P or D has a client span, whose ``traceparent``
   (:meth:`Tracer.traceparent`) travels in the call's metadata beside the cluster's call
   credential (``cluster/auth.py``).
3. Instance: the servicer reads it from the call's metadata (:meth:`Tracer.parent`) and
   records its spans under it once the engine has handed the request's output over
   (``serving/request_timing.py``), from the plain timestamps the engine kept
   (``engine/request_timing.py``).

Times: the engine and the services measure ``time.monotonic()``; spans take wall-clock
nanoseconds, converted at recording time (:func:`wall_ns`).
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span

logger = logging.getLogger(__name__)

TRACEPARENT = "traceparent"  # W3C Trace Context; gRPC metadata keys are lowercase, as HTTP/2 headers
TRACESTATE = "tracestate"
ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
MAX_QUEUED_SPANS = 8192  # ended spans waiting for export; beyond it new ones are dropped
MAX_EXPORT_BATCH = 512
EXPORT_DELAY_MS = 1000  # a batch goes out at least this often while spans wait
SHUTDOWN_TIMEOUT_S = 3.0  # at exit, how long the last export may take
_SDK_LOGGERS = ("opentelemetry.sdk._shared_internal", "opentelemetry.exporter.otlp.proto.grpc.exporter")
_LOG_EVERY_S = 60.0

SpanKindName = Literal["internal", "server", "client"]
Attributes = Mapping[str, str | bool | int | float | list[str] | list[int]]


def add_tracing_arguments(parser: argparse.ArgumentParser) -> None:
    """``--otlp-traces-endpoint``: vLLM's flag, on the gateway, every instance and ``splitserve up``."""
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="send OpenTelemetry traces to this OTLP/gRPC collector, e.g. http://127.0.0.1:4317 (http: plain, "
        "https: TLS); default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT, else off",
    )


def tracing_argv(args: argparse.Namespace) -> list[str]:
    """The flag as given, for a child process to parse the same (its environment has the variables)."""
    return ["--otlp-traces-endpoint", args.otlp_traces_endpoint] if args.otlp_traces_endpoint else []


def traces_endpoint(flag: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """Where traces go: the flag, else the standard variables; None (off) when neither is set,
    or when ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` says so."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    return flag or next((environ[name] for name in ENDPOINT_ENV if environ.get(name)), None)


def start_tracing(flag: str | None, service_name: str, instance_id: str) -> Tracer | None:
    """This process's tracer, or None when tracing is off (nothing imported then)."""
    endpoint = traces_endpoint(flag)
    if endpoint is None:
        return None
    tracer = Tracer(endpoint, service_name, instance_id)
    logger.info("%s %s: sending traces to %s", service_name, instance_id, endpoint)
    return tracer


def wall_ns(monotonic_s: float) -> int:
    """A ``time.monotonic()`` reading of this process as Unix nanoseconds, for a span's times."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class Tracer:
    """This process's spans, batched to an OTLP/gRPC collector. Thread-safe: the SDK locks."""

    def __init__(
        self, endpoint: str, service_name: str, instance_id: str, exporter: SpanExporter | None = None
    ) -> None:
        """``exporter``: where spans go instead of OTLP to ``endpoint``, at once (tests read them)."""
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        for name in _SDK_LOGGERS:
            logging.getLogger(name).addFilter(_RateLimitedLog())
        self.endpoint = endpoint
        # OTEL_RESOURCE_ATTRIBUTES adds to these (deployment.environment, ...); these win.
        resource = Resource.create(
            {"service.name": service_name, "service.namespace": "splitserve", "service.instance.id": instance_id}
        )
        # No exit hook of the SDK's: its shutdown waits 30 s for a collector that does not answer.
        self._provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        self._provider.add_span_processor(
            SimpleSpanProcessor(exporter)
            if exporter is not None
            else BatchSpanProcessor(
                OTLPSpanExporter(endpoint=endpoint),
                max_queue_size=MAX_QUEUED_SPANS,
                schedule_delay_millis=EXPORT_DELAY_MS,
                max_export_batch_size=MAX_EXPORT_BATCH,
            )
        )
        self._tracer = self._provider.get_tracer("splitserve")
        self._propagator = TraceContextTextMapPropagator()
        self._kinds = {"internal": SpanKind.INTERNAL, "server": SpanKind.SERVER, "client": SpanKind.CLIENT}

    def parent(self, carrier: Mapping[str, str] | Iterable[tuple[str, Any]] | None) -> Context | None:
        """The context a caller sent: ``traceparent`` (and ``tracestate``) from HTTP headers or
        gRPC metadata; None when there is none, or it is malformed (a new trace starts then)."""
        if carrier is None:
            return None
        pairs = carrier.items() if isinstance(carrier, Mapping) else carrier
        fields = {
            key.lower(): value.decode("latin-1") if isinstance(value, bytes) else str(value)
            for key, value in pairs
            if key.lower() in (TRACEPARENT, TRACESTATE)
        }
        if TRACEPARENT not in fields:
            return None
        from opentelemetry import trace

        context = self._propagator.extract(fields)
        return context if trace.get_current_span(context).get_span_context().is_valid else None

    def start(
        self,
        name: str,
        parent: Context | Span | None,
        start_s: float | None = None,
        kind: SpanKindName = "internal",
        attributes: Attributes | None = None,
    ) -> Span:
        """A span under ``parent`` (a span, a context a caller sent, or None: a new trace),
        from ``start_s`` (``time.monotonic()``; default now). The caller ends it."""
        return self._tracer.start_span(
            name,
            context=self._context(parent),
            kind=self._kinds[kind],
            attributes=attributes,
            start_time=wall_ns(start_s) if start_s is not None else None,
        )

    def record(
        self,
        name: str,
        parent: Context | Span | None,
        start_s: float,
        end_s: float,
        kind: SpanKindName = "internal",
        attributes: Attributes | None = None,
    ) -> Span:
        """A span of something that already happened, from ``start_s`` to ``end_s`` (monotonic)."""
        span = self.start(name, parent, start_s, kind, attributes)
        span.end(end_time=wall_ns(end_s))
        return span

    def traceparent(self, span: Span) -> tuple[tuple[str, str], ...]:
        """gRPC metadata (or HTTP headers) that make a callee's spans children of ``span``."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._context(span))
        return tuple(carrier.items())

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Export what is queued, waiting ``timeout_s`` at most: the SDK's own shutdown waits
        for a collector that does not answer up to its export timeout, so it runs on a thread
        of its own that the process does not wait for beyond that."""
        done = threading.Thread(target=self._provider.shutdown, name="otel-shutdown", daemon=True)
        done.start()
        done.join(timeout_s)
        if done.is_alive():
            logger.warning("traces still queued for %s after %.0f s at exit were dropped", self.endpoint, timeout_s)

    @staticmethod
    def _context(parent: Context | Span | None) -> Context | None:
        from opentelemetry import trace

        if isinstance(parent, trace.Span):
            return trace.set_span_in_context(parent)
        return parent


def trace_id_of(span: Span) -> str:
    """The span's trace id as the W3C header writes it (32 hex digits)."""
    return format(span.get_span_context().trace_id, "032x")


class _RateLimitedLog(logging.Filter):
    """Lets each of the SDK's messages through once a minute at most: a collector that is down
    makes it complain at every export (and, with the queue full, at every span)."""

    def __init__(self) -> None:
        super().__init__()
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        now, key = time.monotonic(), str(record.msg)
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < _LOG_EVERY_S:
                return False
            self._last[key] = now
        return True
