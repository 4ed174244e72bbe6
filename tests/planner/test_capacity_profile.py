"""The measured capacity profile: its file round-trips, a profile of other SLOs is refused, the
planner's capacity is the measurement at the measured mix and the model scaled by the measured
ratio elsewhere; and the profiler's load search finds the largest load met within its levels."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from planner.capacity import InstanceCapacity, Slo, Workload, instance_capacity
from planner.capacity_profile import (
    CapacityProfile,
    DecodePoint,
    PrefillPoint,
    calibrated_capacity,
    check_slo,
    load_capacity_profile,
)
from planner.profiler import search
from tests.planner.factories import make_profile

SLO = Slo(ttft_s=1.0, itl_s=0.05)


def make_measured(prefill_rate: float, decode_rate: float, decode_streams: int) -> CapacityProfile:
    return CapacityProfile(
        source="a test",
        slo=SLO,
        prompt_tokens=100,
        output_tokens=50,
        capacity=InstanceCapacity(prefill_rate, decode_rate, decode_streams),
        prefill_sweep=(PrefillPoint(2.0, 20, 0, 0.4, True), PrefillPoint(4.0, 20, 1, 1.3, False)),
        decode_sweep=(DecodePoint(8, 400, 0, 0.04, 0.035, True),),
    )


def test_a_profile_round_trips_through_its_file(tmp_path: Path) -> None:
    measured = make_measured(2.0, 3.0, 8)
    measured.save(tmp_path / "capacity.json")
    assert load_capacity_profile(tmp_path / "capacity.json") == measured


def test_a_file_that_is_no_profile_is_refused_with_the_command_that_writes_one(tmp_path: Path) -> None:
    (tmp_path / "other.json").write_text('{"name": "llama"}')
    with pytest.raises(ValueError, match="splitserve profile --output"):
        load_capacity_profile(tmp_path / "other.json")


def test_a_profile_measured_at_other_slos_is_refused() -> None:
    check_slo(make_measured(2.0, 3.0, 8), SLO)
    with pytest.raises(ValueError, match="measure again"):
        check_slo(make_measured(2.0, 3.0, 8), Slo(ttft_s=1.0, itl_s=0.1))


def test_the_measured_capacity_stands_at_its_mix_and_scales_the_model_elsewhere() -> None:
    profile = make_profile(step_fixed_s=0.01)
    at_mix = instance_capacity(profile, Workload(0.0, 100, 50), SLO)
    # The instance measured half the model's prefill and a quarter of its decode rate.
    measured = make_measured(at_mix.prefill_rate / 2, at_mix.decode_rate / 4, at_mix.decode_streams // 2)
    assert calibrated_capacity(profile, Workload(5.0, 100, 50), SLO, measured) == measured.capacity
    other = Workload(5.0, 300, 20)
    modelled = instance_capacity(profile, other, SLO)
    calibrated = calibrated_capacity(profile, other, SLO, measured)
    assert calibrated.prefill_rate == pytest.approx(modelled.prefill_rate / 2)
    assert calibrated.decode_rate == pytest.approx(modelled.decode_rate / 4)
    assert calibrated_capacity(profile, other, SLO, None) == modelled


def run_search(largest_met: float, start: float, *, integer: bool, max_levels: int = 12) -> list[float]:
    loads: list[float] = []

    async def level(load: float) -> bool:
        loads.append(load)
        return load <= largest_met

    asyncio.run(search(level, start, 3, max_levels, integer=integer, high=256))
    return loads


def test_the_integer_search_doubles_then_bisects_to_the_largest_load_met() -> None:
    assert run_search(11, 1, integer=True) == [1, 2, 4, 8, 16, 12, 10, 11]
    assert run_search(1000, 1, integer=True) == [1, 2, 4, 8, 16, 32, 64, 128, 256]  # met at the bound
    assert run_search(0, 1, integer=True) == [1]  # not even one stream: capacity 0
    assert len(run_search(11, 1, integer=True, max_levels=5)) == 5


def test_the_rate_search_halves_from_a_missed_start_then_refines_three_times() -> None:
    loads = run_search(1.3, 4.0, integer=False)
    assert loads[:3] == [4.0, 2.0, 1.0]
    assert loads[3:] == [1.5, 1.25, 1.375]
    assert max(load for load in loads if load <= 1.3) == 1.25
    assert len(run_search(0.0, 4.0, integer=False)) == 7  # down to start / 64, then gives up
