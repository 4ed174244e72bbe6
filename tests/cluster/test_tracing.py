"""cluster/tracing.py: where traces go (the flag, the standard variables, off), the W3C
context carried between processes, spans of past moments on the right clock, and a
collector that is down or never answers costing a process nothing but the spans it drops."""

from __future__ import annotations

import ast
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cluster.tracing import MAX_QUEUED_SPANS, TRACEPARENT, Tracer, trace_id_of, traces_endpoint, wall_ns
from tests.stores import free_port

ROOT = Path(__file__).resolve().parents[2]

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


def in_memory(service: str = "splitserve-test") -> tuple[Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return Tracer("unused", service, f"{service}-0", exporter=exporter), exporter


def test_the_flag_wins_then_the_standard_variables_and_either_can_be_switched_off() -> None:
    assert traces_endpoint(None, {}) is None
    assert traces_endpoint("http://flag:4317", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://env"}) == "http://flag:4317"
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://all:4317", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4317"}
    assert traces_endpoint(None, environ) == "http://t:4317"
    assert traces_endpoint(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://all:4317"}) == "http://all:4317"
    assert traces_endpoint("http://flag:4317", {"OTEL_SDK_DISABLED": "true"}) is None
    assert traces_endpoint("http://flag:4317", {"OTEL_TRACES_EXPORTER": "none"}) is None


def test_tracing_off_imports_no_opentelemetry_on_the_request_path() -> None:
    # The gateway's request path and the tracing module, tracing off: nothing of OpenTelemetry
    # loads. (Not the whole gateway: redis-py imports the SDK for its own metrics.)
    code = (
        "import sys; "
        "import cluster.tracing, cluster.request_phases, gateway.generation, gateway.openai_chat, "
        "gateway.openai_completions, gateway.grpc_front, gateway.failover, gateway.request_trace; "
        "from cluster.tracing import start_tracing; "
        "assert start_tracing(None, 'splitserve-gateway', 'g') is None; "
        "loaded = sorted(m for m in sys.modules if m.startswith('opentelemetry')); "
        "assert not loaded, loaded"
    )
    environ = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=environ)
    assert result.returncode == 0, result.stderr[-2000:]


def test_opentelemetry_is_imported_only_where_tracing_is_on() -> None:
    # In every first-party module: inside a function (run once tracing is on), or for types only.
    found = []
    for package in ("cluster", "gateway", "serving", "prefill_svc", "decode_svc", "colocated_svc", "launcher"):
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            deferred = {
                id(node)
                for block in ast.walk(tree)
                if isinstance(block, (ast.FunctionDef, ast.AsyncFunctionDef))
                or (isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING")
                for node in ast.walk(block)
            }
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [node.module or ""]
                else:
                    continue
                if any(name.startswith("opentelemetry") for name in names) and id(node) not in deferred:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found


def test_a_callee_continues_the_trace_of_the_span_whose_traceparent_it_got() -> None:
    gateway, exported = in_memory("splitserve-gateway")
    root = gateway.start("chat m", None, kind="server")
    call = gateway.start("splitserve.v1.Prefill/Prefill", root, kind="client")
    metadata = gateway.traceparent(call)
    assert [key for key, _ in metadata] == [TRACEPARENT]
    prefill, _ = in_memory("splitserve-prefill")
    server = prefill.start("splitserve.v1.Prefill/Prefill", prefill.parent(metadata), kind="server")
    assert server.get_span_context().trace_id == root.get_span_context().trace_id
    assert server.parent is not None and server.parent.span_id == call.get_span_context().span_id
    for span in (server, call, root):
        span.end()
    assert [span.name for span in exported.get_finished_spans()] == ["splitserve.v1.Prefill/Prefill", "chat m"]


def test_a_clients_traceparent_is_continued_and_a_malformed_one_starts_a_new_trace() -> None:
    tracer, _ = in_memory()
    header = {"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"}
    root = tracer.start("chat m", tracer.parent(header), kind="server")
    assert trace_id_of(root) == CLIENT_TRACE_ID
    assert root.parent is not None and format(root.parent.span_id, "016x") == CLIENT_SPAN_ID
    assert tracer.parent({"traceparent": "00-not-a-trace-01"}) is None
    assert tracer.parent({"x-other": "1"}) is None
    assert tracer.parent(None) is None


def test_a_span_of_past_moments_is_placed_on_the_wall_clock_of_those_moments() -> None:
    tracer, exported = in_memory()
    now = time.monotonic()
    tracer.record("queue", None, now - 2.0, now - 1.5)
    (span,) = exported.get_finished_spans()
    assert span.start_time is not None and span.end_time is not None
    assert span.end_time - span.start_time == pytest.approx(0.5e9, abs=1e6)
    assert abs(span.start_time - wall_ns(now - 2.0)) < 5e6
    assert span.resource.attributes["service.name"] == "splitserve-test"
    assert span.resource.attributes["service.instance.id"] == "splitserve-test-0"


@pytest.mark.parametrize("collector", ["down", "blackholed"])
def test_a_collector_down_or_silent_never_blocks_recording_and_shutdown_is_bounded(collector: str) -> None:
    with socket.socket() as listening:
        if collector == "blackholed":
            # Accepted by the kernel, never answered: gRPC's handshake waits for nothing.
            listening.bind(("127.0.0.1", 0))
            listening.listen(64)
            port = listening.getsockname()[1]
        else:
            port = free_port()  # nothing listens there
        tracer = Tracer(f"http://127.0.0.1:{port}", "splitserve-test", "t")
        # More than the queue holds: the newest are dropped, none is waited for.
        for _ in range(MAX_QUEUED_SPANS + 100):
            tracer.start("step", None).end()
        # Returns after its timeout although the export is still stuck (retrying, or waiting
        # for an answer that never comes), which is left to its daemon thread.
        tracer.shutdown(timeout_s=1.0)
        assert any(thread.name == "otel-shutdown" and thread.is_alive() for thread in threading.enumerate())
