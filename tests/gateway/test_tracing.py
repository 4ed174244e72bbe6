"""One request across real processes (gateway, prefill, decode; tiny random model, UCX on
loopback), traced into a real OTLP/gRPC receiver on loopback (opentelemetry-proto's
TraceService): one trace, continuing the client's ``traceparent``, whose spans come from all
three processes with the right parents, in order, the KV pull's bytes those the KV transfer
metric counted. Then the phases: each request's TTFT phases add up to its TTFT, in the
Prometheus histograms and in the ``x-splitserve-timing`` header, and the request's log line
says the same. Last, the collector goes away and then answers nothing: requests are served
as before and every process still stops at once. (A retried and a migrated request:
tests/gateway/test_tracing_failover.py.)"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.trace.v1 import trace_pb2

from cluster.request_phases import HANDOFF_PHASES, TTFT_PHASES
from tests.gateway.otlp_collector import Collector, ReceivedSpan, in_order, one, running_collector
from tests.gateway.processes import HTTPProcess, routes, running_gateway
from tests.services.processes import Service, running
from tests.stores import free_port

pytest.importorskip("ucxx")

CLIENT_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN_ID = "b7ad6b7169203331"
BODY = {"prompt": "Once upon a time, in a land far away,", "max_tokens": 12, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    with running_collector() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def stack(model: Path, collector: Collector) -> Iterator[tuple[HTTPProcess, Service, Service, int]]:
    """Gateway, P and D, all tracing to the collector; P's own metrics on the port returned."""
    traced = ("--otlp-traces-endpoint", collector.endpoint)
    metrics_port = free_port()
    with (
        running("prefill", model, "--lease-seconds", "10", "--metrics-port", str(metrics_port), *traced) as prefill,
        running("decode", model, *traced) as decode,
        running_gateway(model, *routes(prefill, decode), "--request-log", "json", *traced) as gateway,
    ):
        yield gateway, prefill, decode, metrics_port


def metric(text: str, name: str, **labels: str) -> float:
    selector = "".join(f'{key}="{value}",?' for key, value in labels.items())
    pattern = rf"^{re.escape(name)}(?:\{{{selector}\}})? (\S+)$" if labels else rf"^{re.escape(name)} (\S+)$"
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def scrape(gateway: HTTPProcess) -> str:
    return httpx.get(f"{gateway.url}/metrics", timeout=10).text


def test_one_request_is_one_trace_across_the_three_processes(
    stack: tuple[HTTPProcess, Service, Service, int], collector: Collector
) -> None:
    gateway, _, _, _ = stack
    before = scrape(gateway)
    response = httpx.post(
        f"{gateway.url}/v1/completions",
        json=BODY,
        headers={"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    pulled_bytes = metric(scrape(gateway), "splitserve_kv_transfer_bytes_total") - metric(
        before, "splitserve_kv_transfer_bytes_total"
    )
    trace_id = bytes.fromhex(CLIENT_TRACE_ID)
    expected = {
        ("splitserve-gateway", "splitserve.v1.Prefill/Prefill"),
        ("splitserve-gateway", "splitserve.v1.Decode/Decode"),
        ("splitserve-prefill", "splitserve.v1.Prefill/Prefill"),
        ("splitserve-prefill", "queue"),
        ("splitserve-prefill", "prefill chunk"),
        ("splitserve-prefill", "kv publish"),
        ("splitserve-decode", "splitserve.v1.Decode/Decode"),
        ("splitserve-decode", "decode queue"),
        ("splitserve-decode", "kv pull"),
        ("splitserve-decode", "first decode step"),
    }

    def complete(spans: list[ReceivedSpan]) -> bool:
        mine = [s for s in spans if s.span.trace_id == trace_id]
        return expected <= {(s.service, s.name) for s in mine} and any(
            s.span.kind == s.span.SPAN_KIND_SERVER and s.service == "splitserve-gateway" for s in mine
        )

    spans = [s for s in collector.wait_for(complete) if s.span.trace_id == trace_id]
    (root,) = [s for s in spans if s.service == "splitserve-gateway" and s.span.kind == trace_pb2.Span.SPAN_KIND_SERVER]
    # The gateway continued the client's trace, under the client's span, named as GenAI names it.
    assert root.span.parent_span_id == bytes.fromhex(CLIENT_SPAN_ID)
    assert root.name.startswith("text_completion ") and root.attribute("gen_ai.operation.name") == "text_completion"
    assert root.attribute("gen_ai.usage.output_tokens") == BODY["max_tokens"]
    assert "first token" in [event.name for event in root.span.events]
    assert {s.service for s in spans} == {"splitserve-gateway", "splitserve-prefill", "splitserve-decode"}

    prefill_call = one(spans, "splitserve-gateway", "splitserve.v1.Prefill/Prefill")
    decode_call = one(spans, "splitserve-gateway", "splitserve.v1.Decode/Decode")
    prefill = one(spans, "splitserve-prefill", "splitserve.v1.Prefill/Prefill")
    decode = one(spans, "splitserve-decode", "splitserve.v1.Decode/Decode")
    # Parents: root -> the gateway's calls -> each instance's server span -> its phases.
    for call in (prefill_call, decode_call):
        assert call.span.parent_span_id == root.span.span_id and call.span.kind == trace_pb2.Span.SPAN_KIND_CLIENT
    assert prefill.span.parent_span_id == prefill_call.span.span_id
    assert decode.span.parent_span_id == decode_call.span.span_id
    assert prefill.instance.startswith("prefill-") and decode.instance.startswith("decode-")
    queue, publish = one(spans, "splitserve-prefill", "queue"), one(spans, "splitserve-prefill", "kv publish")
    chunks = sorted((s for s in spans if s.name == "prefill chunk"), key=lambda s: s.span.start_time_unix_nano)
    decode_queue, pull, first_step = (
        one(spans, "splitserve-decode", name) for name in ("decode queue", "kv pull", "first decode step")
    )
    for child in (queue, *chunks, publish):
        assert child.span.parent_span_id == prefill.span.span_id
    for child in (decode_queue, pull, first_step):
        assert child.span.parent_span_id == decode.span.span_id
    # In order, across the processes: the request's life from the gateway's arrival on.
    in_order(
        root.span,
        prefill_call.span,
        prefill.span,
        queue.span,
        *(c.span for c in chunks),
        publish.span,
        decode_call.span,
        decode.span,
        decode_queue.span,
        pull.span,
        first_step.span,
    )
    assert sum(int(c.attribute("splitserve.chunk.num_tokens")) for c in chunks) == prefill.attribute(
        "gen_ai.usage.input_tokens"
    )
    # The pull's bytes are those the KV transfer metric counted for this request.
    assert pulled_bytes > 0 and pull.attribute("splitserve.kv.num_bytes") == pulled_bytes
    assert pull.attribute("splitserve.kv.connector") == "ucx"


def timing(response: httpx.Response) -> dict[str, float]:
    header = response.headers["x-splitserve-timing"]
    return {name: float(value) for name, value in (pair.split("=") for pair in header.split(", "))}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_each_requests_ttft_phases_add_up_to_its_ttft(
    stack: tuple[HTTPProcess, Service, Service, int], stream: bool
) -> None:
    gateway, _, _, metrics_port = stack
    for _ in range(3):
        before = scrape(gateway)
        response = httpx.post(f"{gateway.url}/v1/completions", json={**BODY, "stream": stream}, timeout=120)
        assert response.status_code == 200, response.text
        after = scrape(gateway)

        def delta(name: str, **labels: str) -> float:
            return metric(after, name, **labels) - metric(before, name, **labels)  # noqa: B023 - read at once

        ttft = delta("splitserve_time_to_first_token_seconds_sum")
        phases = {phase: delta("splitserve_ttft_phase_seconds_sum", phase=phase) for phase in TTFT_PHASES}
        assert delta("splitserve_time_to_first_token_seconds_count") == 1
        assert all(delta("splitserve_ttft_phase_seconds_count", phase=phase) == 1 for phase in TTFT_PHASES)
        assert sum(phases.values()) == pytest.approx(ttft, abs=1e-3)
        assert phases["prefill_compute"] > 0 and phases["transport"] > 0
        # The response's header says the same (to the microsecond it is written in).
        header = timing(response)
        assert header["ttft"] == pytest.approx(ttft, abs=1e-5)
        assert sum(header[phase] for phase in TTFT_PHASES) == pytest.approx(header["ttft"], abs=1e-5)
        assert all(header[phase] == pytest.approx(phases[phase], abs=1e-5) for phase in TTFT_PHASES)
        if not stream:  # the whole response waited for the last token: the hand-off is in too
            assert header["e2e"] >= header["ttft"] and all(header[phase] >= 0 for phase in HANDOFF_PHASES)
            assert header["kv_pull"] == pytest.approx(
                delta("splitserve_handoff_phase_seconds_sum", phase="kv_pull"), abs=1e-5
            )
        # The request's log line (--request-log json) has them too.
        record = next(
            json.loads(line.split(" ", 3)[-1].split(": ", 1)[1])
            for line in reversed(gateway.log_text().splitlines())
            if "gateway.request_log" in line
        )
        assert record["outcome"] == "length" and record["completion_tokens"] == BODY["max_tokens"]
        assert record["ttft_s"] == pytest.approx(header["ttft"], abs=1e-5)
        assert set(record["phases"]) == set(TTFT_PHASES + HANDOFF_PHASES)
    # P's own endpoint has its share of the phases.
    instance = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    assert re.search(
        r'splitserve_engine_phase_seconds_count\{instance="prefill-\w+",phase="prefill_compute",role="prefill"\} [1-9]',
        instance,
    )


def test_serving_goes_on_when_the_collector_is_down_and_then_answers_nothing(
    stack: tuple[HTTPProcess, Service, Service, int], collector: Collector
) -> None:
    """Last in the module: it takes the collector away (its fixture's stop is then a no-op)."""
    gateway, prefill, decode, _ = stack
    collector.server.stop(grace=None).wait()
    for stream in (False, True):  # down: nothing listens
        response = httpx.post(f"{gateway.url}/v1/completions", json={**BODY, "stream": stream}, timeout=120)
        assert response.status_code == 200 and "x-splitserve-timing" in response.headers
    # Blackholed: the port accepts connections (the kernel's backlog) and never answers.
    with socket.socket() as blackhole:
        blackhole.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        blackhole.bind(("127.0.0.1", collector.port))
        blackhole.listen(64)
        for stream in (False, True):
            response = httpx.post(f"{gateway.url}/v1/completions", json={**BODY, "stream": stream}, timeout=120)
            assert response.status_code == 200 and "x-splitserve-timing" in response.headers
        # Each process stops on SIGTERM as it would without tracing (exit status 0, not killed
        # after the test's timeout), its last export abandoned after a bounded wait.
        assert gateway.stop() == 0
        assert decode.stop() == 0
        assert prefill.stop() == 0
