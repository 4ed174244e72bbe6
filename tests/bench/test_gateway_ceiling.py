"""bench.gateway_ceiling end to end on a tiny simulated cluster (2 colocated instances, one
gateway, Redis): every request completes with exactly the tokens it asked for, the gateway's
CPU is read, the chunk write times give the gateway's gaps, and the two runs' equations are
solved; and the solve itself, on figures made from known costs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench.gateway_ceiling import RunResult, costs, main


def run(max_tokens: int, num_requests: int, cpu_s: float, seconds: float = 1.0) -> RunResult:
    return RunResult(1, max_tokens, num_requests, num_requests * max_tokens, 0, 0, seconds, cpu_s, 0, 0, {}, {}, {})


def test_the_costs_are_solved_from_two_runs_of_different_lengths() -> None:
    per_request_s, per_token_s = 0.003, 0.00015
    short = run(8, 100, 100 * (per_request_s + 8 * per_token_s))
    long = run(128, 50, 50 * (per_request_s + 128 * per_token_s))
    per_token_us, per_request_ms = costs(short, long)
    assert per_token_us == pytest.approx(150.0) and per_request_ms == pytest.approx(3.0)


def test_the_gateways_idle_cpu_is_taken_off_each_run_by_its_length() -> None:
    per_request_s, per_token_s, idle_cpu_per_s = 0.003, 0.00015, 0.05
    short = run(8, 100, 100 * (per_request_s + 8 * per_token_s) + idle_cpu_per_s * 2.0, seconds=2.0)
    long = run(128, 50, 50 * (per_request_s + 128 * per_token_s) + idle_cpu_per_s * 30.0, seconds=30.0)
    per_token_us, per_request_ms = costs(short, long, idle_cpu_per_s)
    assert per_token_us == pytest.approx(150.0) and per_request_ms == pytest.approx(3.0)
    assert costs(short, long)[0] > 150.0  # left in, the idle time of the longer run falls on its tokens


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server (.ci/run installs it)")
def test_a_tiny_ceiling_run_measures_every_request(tmp_path: Path) -> None:
    assert main([
        "--output-dir", str(tmp_path), "--concurrency", "2", "--num-instances", "2", "--step-ms", "20",
        "--short-tokens", "2", "--long-tokens", "12", "--requests-per-stream", "2", "--min-requests", "4",
        "--idle-seconds", "0.5",
    ]) == 0  # fmt: skip
    (row,) = json.loads((tmp_path / "gateway_ceiling.json").read_text())["rows"]
    for name, max_tokens in (("short", 2), ("long", 12)):
        result = row[name]
        assert (result["num_requests"], result["num_failed"]) == (4, 0)
        assert result["num_tokens"] == 4 * max_tokens
        assert result["gateway_cpu_s"] > 0
        assert result["gateway_gap_ms"] and result["client_gap_ms"] and result["ttft_ms"]
    # The gaps are the gateway's chunk times, in milliseconds. A request's 12 tokens leave the
    # instance at least a 20 ms step apart, so its chunks span 11 steps less however late its
    # first chunk was written (a gateway busy elsewhere writes it late and the next one on
    # time: one gap alone may be shorter than a step). Of its at most 12 gaps (the last, to the
    # chunk with held-back text, may be near 0) one is then at least a twelfth of that span:
    # half a step, unless the first chunk of every request was written over 100 ms late.
    assert row["long"]["gateway_gap_ms"]["max"] >= 20 / 2
