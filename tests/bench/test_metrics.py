"""Metric arithmetic on synthetic timings, and the result JSON's keys."""

from __future__ import annotations

import json
import math

import pytest

from bench.metrics import RunInfo, compute_metrics, parse_goodput, percentile_key, result_json, tpot
from tests.bench.factories import make_record

# The keys of vLLM's `vllm bench serve` result (vllm/benchmarks/serve.py) that a
# splitserve result must carry, spelled the same, for percentiles 90 and 99.
VLLM_RESULT_KEYS = {
    "date",
    "endpoint_type",
    "backend",
    "label",
    "model_id",
    "tokenizer_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "latencies",
    "start_times",
    "generated_texts",
    "errors",
    *(
        f"{stat}_{metric}_ms"
        for metric in ("ttft", "tpot", "itl", "e2el")
        for stat in ("mean", "median", "std", "p90", "p99")
    ),
}


def _records():
    return [
        make_record(ttft=0.1, itl=[0.02, 0.04], output_tokens=3, prompt_len=10, start_time=0.0),
        make_record(ttft=0.2, itl=[0.01] * 4, output_tokens=5, prompt_len=20, start_time=0.5),
        make_record(ttft=0.3, itl=[], output_tokens=1, prompt_len=30, start_time=1.0),
        make_record(ttft=0.4, itl=[0.03], output_tokens=5, prompt_len=40, start_time=1.2),  # 2 chunks, 5 tokens
        make_record(ttft=0.05, itl=[0.01], prompt_len=50, error="HTTP 500: overloaded"),
    ]


def test_counts_totals_and_throughputs_leave_failed_requests_out() -> None:
    metrics = compute_metrics(_records(), duration_s=2.0)
    assert (metrics.completed, metrics.failed) == (4, 1)
    assert (metrics.total_input, metrics.total_output) == (100, 14)
    assert metrics.request_throughput == pytest.approx(2.0)
    assert metrics.output_throughput == pytest.approx(7.0)
    assert metrics.total_token_throughput == pytest.approx(57.0)
    assert metrics.request_goodput is None


def test_ttft_distribution_mean_median_std_percentiles_max() -> None:
    ttft = compute_metrics(_records(), duration_s=2.0, percentiles=(90.0, 99.0)).latency["ttft"]
    # 100, 200, 300, 400 ms; linear interpolation between order statistics.
    assert ttft.mean == pytest.approx(250.0)
    assert ttft.median == pytest.approx(250.0)
    assert ttft.std == pytest.approx(math.sqrt((150**2 + 50**2 + 50**2 + 150**2) / 4))
    assert ttft.percentiles[90.0] == pytest.approx(370.0)
    assert ttft.percentiles[99.0] == pytest.approx(397.0)
    assert ttft.max == pytest.approx(400.0)


def test_itl_pools_every_gap_and_tpot_divides_by_output_tokens_minus_one() -> None:
    records = _records()
    metrics = compute_metrics(records, duration_s=2.0)
    # gaps of the successful requests: 20, 40, 10, 10, 10, 10, 30 ms
    assert metrics.latency["itl"].mean == pytest.approx(130 / 7)
    assert metrics.latency["itl"].median == pytest.approx(10.0)
    assert metrics.latency["itl"].max == pytest.approx(40.0)
    # TPOT = (E2E - TTFT) / (tokens - 1): 60/2, 40/4, none for one token, 30/4 (chunks bundle tokens)
    assert [tpot(r) for r in records[:4]] == pytest.approx([0.030, 0.010, None, 0.0075])
    assert metrics.latency["tpot"].mean == pytest.approx((30 + 10 + 7.5) / 3)
    assert metrics.latency["e2el"].max == pytest.approx(430.0)


@pytest.mark.parametrize(
    ("slos", "good"),
    [
        ({"ttft": 250}, 2),  # 100 and 200 ms
        ({"ttft": 1000, "tpot": 20}, 3),  # 30 ms TPOT fails; the one-token request has TPOT 0
        ({"ttft": 250, "tpot": 20}, 1),
        ({"e2el": 300}, 3),  # E2E 160, 240, 300 (on the limit counts), 430
        ({"e2el": 299.9}, 2),
        ({"ttft": 0}, 0),
    ],
)
def test_goodput_counts_requests_meeting_every_slo(slos: dict[str, float], good: int) -> None:
    metrics = compute_metrics(_records(), duration_s=2.0, goodput_slos_ms=slos)
    assert metrics.request_goodput == pytest.approx(good / 2.0)


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft"], ["ttft:fast"], ["e2el:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_peak_concurrency_and_peak_chunks_per_second() -> None:
    records = [
        make_record(ttft=0.05, itl=[0.1] * 9, start_time=0.0),  # chunks 0.05 .. 0.95, in flight until 0.95
        make_record(ttft=0.05, itl=[0.1] * 2, start_time=0.5),  # chunks 0.55, 0.65, 0.75
        make_record(ttft=0.5, itl=[0.1], start_time=0.6),  # chunks 1.1, 1.2
        make_record(ttft=0.05, itl=[], start_time=1.3),  # alone
    ]
    metrics = compute_metrics(records, duration_s=1.4)
    assert metrics.max_concurrent_requests == 3  # at 0.6 - 0.75
    assert metrics.max_output_tokens_per_s == 13.0  # second 0: 10 + 3


def test_result_json_has_vllm_keys_and_per_request_lists_in_send_order() -> None:
    records = _records()
    info = RunInfo(
        date="20250101-000000",
        backend="openai",
        label="t",
        model_id="m",
        tokenizer_id="tok",
        num_prompts=5,
        request_rate=math.inf,
        burstiness=1.0,
        max_concurrency=None,
        base_url="http://x",
        endpoint="/v1/completions",
        dataset="random",
        seed=0,
        num_warmups=0,
        goodput_slos_ms={},
    )
    result = result_json(info, records, compute_metrics(records, 2.0), 2.0)
    assert set(result) >= VLLM_RESULT_KEYS
    assert result["request_rate"] == "inf"
    assert result["input_lens"] == [10, 20, 30, 40, 50]
    assert result["output_lens"] == [3, 5, 1, 5, 0]
    assert result["ttfts"] == [0.1, 0.2, 0.3, 0.4, 0.0]  # a failed request: 0.0, as vLLM writes it
    assert result["errors"] == ["", "", "", "", "HTTP 500: overloaded"]
    assert result["start_times"] == [0.0, 0.5, 1.0, 1.2, 0.0]
    assert result["p99_ttft_ms"] == pytest.approx(397.0) and result["max_ttft_ms"] == pytest.approx(400.0)
    json.dumps(result, allow_nan=False)


def test_all_failed_run_reports_none_not_nan() -> None:
    records = [make_record(error="refused"), make_record(error="refused")]
    metrics = compute_metrics(records, duration_s=1.0, goodput_slos_ms={"ttft": 100})
    assert (metrics.completed, metrics.failed, metrics.request_goodput) == (0, 2, 0.0)
    assert metrics.latency["ttft"].mean is None and metrics.latency["itl"].percentiles == {90.0: None, 99.0: None}


def test_percentile_key_matches_vllm_spelling() -> None:
    assert [percentile_key(p) for p in (90.0, 99.0, 99.9, 50)] == ["p90", "p99", "p99.9", "p50"]
