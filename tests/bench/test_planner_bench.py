"""bench.planner end to end at a smoke size: a few seconds of the day, all three ways, against
simulated instances with the tests' GPU-like profile; and the planner's way against real
prefill and decode instances of the tiny random checkpoint (``--instances real``, priced by a
capacity profile the test gives: the ways differ only in their pool sizes, which the simulated
run covers). Every request completes, none is cut, no KV block is left held, and the report
holds each way's windows and instance-seconds. The real runs' commands are in
docs/benchmarks.md."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench.planner import main
from planner.capacity import InstanceCapacity, Slo
from planner.capacity_profile import CapacityProfile
from tests.simulator.cluster import write_profile

needs_redis = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="needs redis-server (.ci/run installs it)"
)


def check_ways(report: dict, modes: list[str], num_windows: int) -> dict[str, dict]:
    """Each way's figures, once every way served every request whole and leaked no block."""
    results = {result["mode"]: result for result in report["results"]}
    assert list(results) == modes
    num_requests = results["planner"]["num_requests"]
    assert num_requests > 0
    for result in results.values():
        assert (result["num_requests"], result["num_failed"], result["num_cut"]) == (num_requests, 0, 0)
        assert result["num_blocks_held"] == 0
        assert len(result["windows"]) == num_windows
        assert sum(window["num_requests"] for window in result["windows"]) == num_requests
        assert result["instance_seconds"] > 0
    return results


@needs_redis
def test_a_smoke_sized_day_replays_three_ways(tmp_path: Path) -> None:
    profile = write_profile(tmp_path)
    assert main([
        "--output-dir", str(tmp_path / "out"), "--profile", str(profile), "--time-scale", "4",
        "--ttft-slo", "1", "--itl-slo", "0.012", "--peak-rate", "16", "--chatty", "64:32", "--long", "512:16",
        "--duration-s", "6", "--window-s", "3", "--plan-interval", "1",
    ]) == 0  # fmt: skip
    report = json.loads((tmp_path / "out" / "planner.json").read_text())
    results = check_ways(report, ["static-peak", "static-mean", "planner"], num_windows=2)
    assert report["capacity_profile"] is None
    assert sorted(report["predictor_errors"]) == ["holt", "last", "moving-average"]
    for role in ("prefill", "decode"):
        assert results["static-peak"]["sizes"][role] >= results["static-mean"]["sizes"][role]


@needs_redis
@pytest.mark.slow  # a real prefill and decode instance started and stopped
def test_a_smoke_sized_day_replays_on_real_instances(tmp_path: Path, model: Path) -> None:
    # What `splitserve profile` would have measured, made up: generous, so that one instance
    # of each role is every way's pool; bounds of one per role keep the planner's there too,
    # and the run short.
    measured = CapacityProfile("the test", Slo(5.0, 1.0), 24, 6, InstanceCapacity(20.0, 20.0, 16))
    measured.save(tmp_path / "capacity.json")
    assert main([
        "--output-dir", str(tmp_path / "out"), "--instances", "real", "--model", str(model), "--kv-blocks", "64",
        "--capacity-profile", str(tmp_path / "capacity.json"), "--ttft-slo", "5", "--itl-slo", "1",
        "--peak-rate", "3", "--chatty", "16:8", "--long", "48:4", "--duration-s", "3", "--window-s", "1.5",
        "--plan-interval", "1", "--max-per-role", "1", "--max-instances", "2", "--modes", "planner",
    ]) == 0  # fmt: skip
    report = json.loads((tmp_path / "out" / "planner.json").read_text())
    results = check_ways(report, ["planner"], num_windows=2)
    assert report["capacity_profile"]["capacity"]["prefill_rate"] == 20.0
    for result in results.values():
        assert result["sizes"] == {"prefill": 1, "decode": 1}
        # Real instances of the model, one process each, the commands `splitserve up` runs.
        assert sorted(result["instance_commands"]) == ["planned-decode-0", "planned-prefill-0"]
        for instance_id, argv in result["instance_commands"].items():
            role = instance_id.split("-")[1]
            assert argv[argv.index("splitserve") + 3 : argv.index("splitserve") + 6] == [role, "--model", str(model)]
            assert argv[argv.index("--num-blocks") + 1] == "64"
    assert report["report"].startswith(f"real instances of {model}")
