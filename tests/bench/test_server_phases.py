"""The benchmark reads where the server says each request's TTFT went (splitserve's
``x-splitserve-timing`` header): each phase's distribution, the breakdown at TTFT
percentiles (the tail's phases are the tail requests'), the report's table and the plot."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench.client import parse_server_timing
from bench.metrics import RunInfo, compute_metrics, phase_breakdown, result_json
from bench.plot import Run, plot_runs
from bench.report import format_result
from tests.bench.factories import make_record


def timing(ttft: float, queue: float) -> dict[str, float]:
    """A request whose TTFT is ``queue`` in P's queue and the rest computing."""
    return {"ttft": ttft, "gateway_queue": 0.0, "prefill_queue": queue, "prefill_compute": ttft - queue}


def test_the_header_parses_into_seconds_by_name_and_a_bad_one_into_nothing() -> None:
    assert parse_server_timing("ttft=0.250000, gateway_queue=0.001000, prefill_queue=0.1") == {
        "ttft": 0.25,
        "gateway_queue": 0.001,
        "prefill_queue": 0.1,
    }
    assert parse_server_timing(None) is None and parse_server_timing("") is None
    assert parse_server_timing("ttft=fast") is None


def test_the_tail_breakdown_is_the_tail_requests_phases() -> None:
    # 99 requests that compute for 100 ms, and one that queued 2 s before its 100 ms.
    timings = [timing(0.1, 0.0)] * 99 + [timing(2.1, 2.0)]
    breakdown = phase_breakdown(timings, (50.0, 99.0), band=0.5)
    assert breakdown[50.0] == pytest.approx(
        {"ttft": 100.0, "gateway_queue": 0.0, "prefill_queue": 0.0, "prefill_compute": 100.0}
    )
    # The p99 band: the queued request and the two just below it.
    assert breakdown[99.0]["prefill_queue"] == pytest.approx(2000.0 / 3)
    assert phase_breakdown([], (50.0,)) == {}


def test_a_run_reports_each_phase_and_the_breakdown_and_plots_it(tmp_path: Path) -> None:
    records = [make_record(ttft=0.1 + i / 100) for i in range(20)]
    for i, record in enumerate(records):
        record.server_timing = timing(0.09 + i / 100, i / 200)
    records.append(make_record(ttft=0.2))  # a server without the header: not in the phases
    metrics = compute_metrics(records, 10.0)
    assert list(metrics.server_phases) == ["ttft", "gateway_queue", "prefill_queue", "prefill_compute"]
    assert metrics.server_phases["prefill_queue"].max == pytest.approx(95.0)
    info = RunInfo(
        "d", "openai", "pd", "m", "m", 21, math.inf, 1.0, None, "http://x", "/v1/completions", "random", 0, 0, {}
    )
    result = result_json(info, records, metrics, 10.0)
    assert result["p99_phase_prefill_queue_ms"] == pytest.approx(94.05)
    assert set(result["ttft_phase_breakdown_ms"]) == {"p50", "p90", "p99"}
    assert result["server_timings"][-1] is None
    text = format_result(result)
    assert "TTFT by Phase (server, ms)" in text and "prefill_queue" in text
    written = plot_runs([Run("pd", result)], tmp_path)
    assert tmp_path / "ttft_phases.png" in written
