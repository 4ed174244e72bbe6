"""The step-time formula, prefill planning, pull times, validation and the JSON form of a profile."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from simulator.timing_model import MeasuredStep, TimingProfile, step_features
from tests.simulator.factories import make_profile


def test_a_step_is_the_fixed_cost_plus_its_tokens_attended_pairs_and_context() -> None:
    # A chunk of 4 new tokens after 6 computed ones attends 7 + 8 + 9 + 10 = 34 pairs; a decode at
    # context 5 attends 5. Tokens 4 + 1, context 10 + 5.
    assert step_features([(4, 10), (1, 5)]) == (5, 39, 15)
    expected = 1.0 + 0.1 * 5 + 0.01 * 39 + 0.001 * 15
    assert make_profile().step_seconds([(4, 10), (1, 5)]) == pytest.approx(expected)


def test_a_prefill_attends_a_triangle_and_a_decode_its_context() -> None:
    assert step_features([(8, 8)]).num_attended_pairs == 8 * 9 // 2
    assert step_features([(1, 100)] * 3) == (3, 300, 300)


def test_a_step_that_runs_nothing_takes_no_time() -> None:
    assert make_profile().step_seconds([]) == 0.0


@pytest.mark.parametrize("row", [(0, 5), (6, 5), (-1, 3)])
def test_impossible_rows_are_refused(row: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="num_new_tokens >= 1"):
        make_profile().step_seconds([row])


def test_a_prefill_is_planned_chunk_by_chunk_past_its_cached_prefix() -> None:
    profile = make_profile()
    step = profile.step_seconds
    assert profile.prefill_seconds(10, chunk=4) == pytest.approx(step([(4, 4)]) + step([(4, 8)]) + step([(2, 10)]))
    assert profile.prefill_seconds(10, chunk=4, num_cached_tokens=4) == pytest.approx(step([(4, 8)]) + step([(2, 10)]))
    assert profile.prefill_seconds(10, chunk=4, num_cached_tokens=10) == 0.0
    assert profile.prefill_seconds(100) == pytest.approx(step([(64, 64)]) + step([(36, 100)]))  # the step budget


@pytest.mark.parametrize(("num_tokens", "chunk", "num_cached"), [(0, 4, 0), (10, 0, 0), (10, 4, 11), (10, 4, -1)])
def test_prefill_planning_refuses_nonsense(num_tokens: int, chunk: int, num_cached: int) -> None:
    with pytest.raises(ValueError):
        make_profile().prefill_seconds(num_tokens, chunk=chunk, num_cached_tokens=num_cached)


def test_a_pull_costs_its_fixed_part_and_its_bytes_over_the_link() -> None:
    profile = make_profile()
    assert profile.pull_seconds(2000) == pytest.approx(0.5 + 2.0)
    assert profile.pull_seconds(0) == 0.0  # nothing missing: no pull
    assert profile.block_bytes == 16 * 1000
    with pytest.raises(ValueError, match=">= 0"):
        profile.pull_seconds(-1)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("name", " ", "non-empty string"),
        ("block_size", 12, "power of two"),
        ("block_size", 0, "whole number >= 1"),
        ("num_kv_blocks", 2.5, "whole number >= 1"),
        ("max_num_seqs", True, "whole number >= 1"),
        ("token_s", -1e-6, "seconds >= 0"),
        ("attention_s", math.nan, "seconds >= 0"),
        ("pull_fixed_s", math.inf, "seconds >= 0"),
        ("link_bytes_per_s", 0, "bytes a second"),
    ],
)
def test_nonsense_values_are_refused_with_the_fix(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_profile(**{field: value})


def test_a_profile_whose_steps_take_no_time_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one of them a positive value"):
        make_profile(step_fixed_s=0.0, token_s=0.0)


def test_json_round_trips_with_and_without_measured_steps(tmp_path: Path) -> None:
    measured = (MeasuredStep(((4, 4),), 1.5), MeasuredStep(((1, 5), (1, 9)), 1.25))
    for profile in (make_profile(), make_profile(measured_steps=measured)):
        text = profile.to_json()
        assert TimingProfile.from_json(text) == profile
        path = tmp_path / "profile.json"
        path.write_text(text)
        assert TimingProfile.from_json(path) == profile
        assert TimingProfile.from_json(str(path)) == profile
    lines = make_profile(measured_steps=measured).to_json().splitlines()
    assert [line.strip() for line in lines if '"rows"' in line] == [
        '{"rows": [[4, 4]], "seconds": 1.5},',
        '{"rows": [[1, 5], [1, 9]], "seconds": 1.25}',
    ]


def test_json_with_unknown_or_missing_keys_names_them() -> None:
    text = make_profile().to_json()
    with pytest.raises(ValueError, match="unknown: token_seconds"):
        TimingProfile.from_json(text.replace('"token_s"', '"token_seconds"'))
    with pytest.raises(ValueError, match="missing: pull_fixed_s"):
        TimingProfile.from_json(text.replace('  "pull_fixed_s": 0.5\n', "").replace(",\n}", "\n}"))


def test_unreadable_profiles_say_why(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read timing profile"):
        TimingProfile.from_json(tmp_path / "absent.json")
    with pytest.raises(ValueError, match="not valid JSON"):
        TimingProfile.from_json("{not json")
    with pytest.raises(ValueError, match="seconds must be a finite number > 0"):
        TimingProfile.from_json(
            make_profile(measured_steps=(MeasuredStep(((1, 1),), 1.0),))
            .to_json()
            .replace('"seconds": 1.0', '"seconds": 0')
        )
