"""Load predictors on series whose forecasts are worked out by hand, and the ranking."""

from __future__ import annotations

import pytest

from bench.day_trace import day_trace, windows_of
from planner.predictor_eval import forecast_error, rank_predictors
from planner.predictors import PREDICTORS, HoltLinear, LastValue, MovingAverage, make_predictor


def test_moving_average_is_the_mean_of_its_window() -> None:
    average = MovingAverage(window=3)
    assert average.predict() is None
    for value in (1.0, 2.0, 3.0, 10.0):
        average.observe(value)
    assert average.predict() == pytest.approx(5.0)  # (2 + 3 + 10) / 3


def test_holt_follows_a_ramp() -> None:
    holt = HoltLinear(alpha=0.5, beta=0.5)
    for value in (0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0, 18.0, 20.0, 22.0):
        holt.observe(value)
    assert holt.predict() == pytest.approx(24.0, abs=0.5)
    assert holt.predict(steps_ahead=2) == pytest.approx(26.0, abs=0.8)
    # First update by hand: level = 0.5 * 2 + 0.5 * (0 + 0) = 1, trend = 0.5 * (1 - 0) = 0.5.
    first = HoltLinear(alpha=0.5, beta=0.5)
    first.observe(0.0)
    first.observe(2.0)
    assert first.predict() == pytest.approx(1.5)


def test_holt_never_predicts_a_negative_rate() -> None:
    holt = HoltLinear(alpha=1.0, beta=1.0)
    for value in (10.0, 5.0, 0.0):
        holt.observe(value)
    assert holt.predict(steps_ahead=3) == 0.0


def test_forecast_error_scores_one_step_ahead() -> None:
    # Last value on 1, 2, 3, 4: forecasts 1, 2, 3 for 2, 3, 4: each off by 1; the mean is 2.5.
    assert forecast_error(LastValue, [1.0, 2.0, 3.0, 4.0]) == pytest.approx(1 / 2.5)
    with pytest.raises(ValueError):
        forecast_error(LastValue, [1.0])


def test_on_a_ramp_holt_beats_the_moving_average_and_on_noise_the_average_wins() -> None:
    ramp = [float(i) for i in range(1, 40)]
    noise = [10.0 + (3.0 if i % 2 else -3.0) for i in range(40)]  # flat, alternating
    assert rank_predictors(PREDICTORS, {"ramp": ramp})[0][0] == "holt"
    assert rank_predictors(PREDICTORS, {"noise": noise})[0][0] == "moving-average"


def test_make_predictor_names_the_choices() -> None:
    assert isinstance(make_predictor("holt"), HoltLinear)
    with pytest.raises(ValueError, match="moving-average"):
        make_predictor("prophet")


def day_rates(interval_s: float, seed: int) -> list[float]:
    """bench.planner's default day (1,200 s, 3 requests a second at noon), as rates per interval."""
    trace = day_trace(duration_s=1200.0, peak_rate=3.0, seed=seed)
    return [len(window) / interval_s for window in windows_of(trace, 1200.0, interval_s)]


def test_on_the_benchmarks_day_noise_favours_the_average_and_longer_intervals_holt() -> None:
    # At 5 s a noon interval holds about 15 requests: Poisson noise outweighs the trend.
    short = rank_predictors(PREDICTORS, {f"seed {s}": day_rates(5.0, s) for s in range(5)})
    assert short[0][0] == "moving-average", short
    # At 30 s the trend shows through, and following it pays.
    long = rank_predictors(PREDICTORS, {f"seed {s}": day_rates(30.0, s) for s in range(5)})
    assert long[0][0] == "holt", long
