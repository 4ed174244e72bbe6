"""The phases of a request's TTFT at the gateway, in process: each measured, they add up to its
TTFT when the gateway's and the instance's intervals tile it, and not when an instance reports
more than its call took (cluster/request_phases.py), the request timer observes them as it sends the first token and
a hand-off's after it (gateway/metrics.py), the status page's breakdown, the timing header
and the finished request's log line (gateway/request_log.py)."""

from __future__ import annotations

import json
import logging
import time

import pytest

from cluster.request_phases import HANDOFF_PHASES, TTFT_PHASES, ttft_phases
from gateway.instances import InstancePool
from gateway.metrics import GatewayMetrics, RequestTimer
from gateway.request_log import FinishedRequest, log_finished, timing_header
from gateway.status import RecentLatencies
from splitserve.v1.generation_pb2 import RequestPhases

PREFILL = RequestPhases(prefill_queue_s=0.25, prefill_compute_s=0.5, kv_publish_s=0.0625, num_prefill_chunks=2)
HANDOFF = RequestPhases(decode_queue_s=0.01, kv_pull_s=0.02, first_decode_step_s=0.03)


def sum_of(phases: RequestPhases) -> float:
    return sum(getattr(phases, f"{p}_s") for p in TTFT_PHASES)


def test_the_ttft_phases_are_the_gateways_time_the_instances_and_the_hop() -> None:
    # Arrival at 10 s; the call sent at 10.125 and answered at 10.96875; the first token written at 11.
    phases = ttft_phases(arrival=10.0, call_sent_at=10.125, answered_at=10.96875, first_token_at=11.0, instance=PREFILL)
    assert phases.gateway_queue_s == 0.125 + 0.03125  # before the send, and after the answer
    assert phases.prefill_compute_s == 0.5 and phases.num_prefill_chunks == 2
    assert phases.transport_s == 0.84375 - 0.8125  # the call's round trip less P's own phases
    assert sum_of(phases) == 1.0
    # P reported more than its call took (a phase counted twice, clocks that disagree): the hop
    # is never negative, and the phases add up to more than the TTFT.
    overcounted = ttft_phases(10.0, 10.125, 10.5, 11.0, PREFILL)
    assert overcounted.transport_s == 0.0 and sum_of(overcounted) == 1.0 + 0.4375
    # An instance that reported nothing: the whole call is transport.
    assert ttft_phases(10.0, 10.125, 10.96875, 11.0, None).transport_s == 0.84375


def sample(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_the_timer_observes_the_ttft_phases_at_the_first_token_and_the_hand_off_after() -> None:
    metrics = GatewayMetrics(InstancePool(stale_after_s=1.0))
    timer = RequestTimer(metrics, arrival=time.monotonic() - 2.0)
    timer.dispatched()
    timer.dispatched_at = timer.arrival + 0.5
    # The call to P: sent at dispatch, answered a second later, 0.8125 s of it P's own phases.
    timer.call_answered(timer.arrival + 0.5, timer.arrival + 1.5)
    timer.instance_phases(PREFILL)
    timer.tokens_sent(1)
    ttft = sample(metrics, "splitserve_time_to_first_token_seconds_sum")
    phases = {p: sample(metrics, "splitserve_ttft_phase_seconds_sum", phase=p) for p in TTFT_PHASES}
    assert sum(phases.values()) == pytest.approx(ttft, abs=1e-9)
    assert phases["prefill_queue"] == 0.25 and phases["kv_publish"] == 0.0625
    assert phases["transport"] == pytest.approx(1.0 - 0.8125)
    assert phases["gateway_queue"] == pytest.approx(ttft - 1.0)  # the half second before the call, and after it
    timer.call_answered(timer.arrival + 1.75, timer.arrival + 1.875)  # D's call, after the first token
    timer.instance_phases(HANDOFF)  # D's first response
    timer.tokens_sent(3)
    assert sample(metrics, "splitserve_handoff_phase_seconds_sum", phase="kv_pull") == 0.02
    assert timer.phases is not None and timer.phases.first_decode_step_s == 0.03
    assert timer.phases.transport_s == pytest.approx(1.0 - 0.8125)  # D's call is no part of the TTFT
    (row,) = metrics.recent.ttft_phases
    assert sum(row) == pytest.approx(ttft, abs=1e-9)


def test_the_status_breakdown_is_the_mean_and_the_median_and_p90_requests_phases() -> None:
    recent = RecentLatencies()
    assert recent.phase_breakdown() is None
    for index in range(10):  # TTFT 0.1 s, except one request that queued a second on P
        queued = 1.0 if index == 9 else 0.0
        recent.add_phases(ttft_phases(0.0, 0.0, 0.1 + queued, 0.1 + queued, RequestPhases(prefill_queue_s=queued)))
    breakdown = recent.phase_breakdown()
    assert breakdown is not None and breakdown.phases == list(TTFT_PHASES) and breakdown.num_requests == 10
    queue = TTFT_PHASES.index("prefill_queue")
    assert breakdown.mean[queue] == pytest.approx(0.1) and breakdown.p50[queue] == 0.0
    assert breakdown.p90[queue] == 1.0  # the 90th percentile request of ten is the slowest


def test_the_timing_header_and_the_log_line_say_where_the_time_went(caplog: pytest.LogCaptureFixture) -> None:
    phases = ttft_phases(0.0, 0.125, 1.0, 1.0, PREFILL)
    header = dict(pair.split("=") for pair in timing_header(1.0, phases).split(", "))
    assert list(header) == ["ttft", *TTFT_PHASES] and header["prefill_compute"] == "0.500000"
    phases.kv_pull_s = 0.02
    assert dict(pair.split("=") for pair in timing_header(1.0, phases, e2e_s=2.0).split(", "))["kv_pull"] == "0.020000"
    record = FinishedRequest("cmpl-1", "ab" * 16, "length", 7, 0, 12, 1.0, 2.0, 0.02, phases)
    with caplog.at_level(logging.INFO, logger="gateway.request_log"):
        log_finished("json", record)
        log_finished("text", record)
        log_finished("off", record)
    json_line, text_line = (r.getMessage() for r in caplog.records)
    logged = json.loads(json_line)
    assert logged["request_id"] == "cmpl-1" and logged["trace_id"] == "ab" * 16 and logged["outcome"] == "length"
    assert set(logged["phases"]) == set(TTFT_PHASES + HANDOFF_PHASES) and logged["phases"]["kv_pull"] == 0.02
    assert text_line.startswith("finished request_id=cmpl-1 ") and " prefill_compute=0.5" in text_line
