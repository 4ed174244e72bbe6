"""bench.planner end to end at a smoke size: a few seconds of the day against simulated
instances with the tests' GPU-like profile, all three ways; every request completes, none is
cut, and the report holds each way's windows and instance-seconds. The real run's command is in
docs/benchmarks.md."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench.planner import main
from tests.simulator.cluster import write_profile


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server (.ci/run installs it)")
def test_a_smoke_sized_day_replays_three_ways(tmp_path: Path) -> None:
    profile = write_profile(tmp_path)
    assert main([
        "--output-dir", str(tmp_path / "out"), "--profile", str(profile), "--time-scale", "4",
        "--ttft-slo", "1", "--itl-slo", "0.012", "--peak-rate", "16", "--chatty", "64:32", "--long", "512:16",
        "--duration-s", "6", "--window-s", "3", "--plan-interval", "1",
    ]) == 0  # fmt: skip
    report = json.loads((tmp_path / "out" / "planner.json").read_text())
    results = {result["mode"]: result for result in report["results"]}
    assert list(results) == ["static-peak", "static-mean", "planner"]
    num_requests = results["planner"]["num_requests"]
    assert num_requests > 0
    for result in results.values():
        assert (result["num_requests"], result["num_failed"], result["num_cut"]) == (num_requests, 0, 0)
        assert len(result["windows"]) == 2
        assert sum(window["num_requests"] for window in result["windows"]) == num_requests
        assert result["instance_seconds"] > 0
    assert sorted(report["predictor_errors"]) == ["holt", "last", "moving-average"]
    for role in ("prefill", "decode"):
        assert results["static-peak"]["sizes"][role] >= results["static-mean"]["sizes"][role]
