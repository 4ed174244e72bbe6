"""The compressed day: its rate rises tenfold to noon and falls back, its mix moves from chatty
to long prompts and back, and a seed gives the same day twice."""

from __future__ import annotations

import pytest

from bench.day_trace import day_trace, long_share_at, rate_at, windows_of


def test_the_rate_curve_spans_the_trough_to_the_peak() -> None:
    assert rate_at(0.0, 10.0, 1.0) == pytest.approx(1.0)
    assert rate_at(0.5, 10.0, 1.0) == pytest.approx(10.0)
    assert rate_at(1.0, 10.0, 1.0) == pytest.approx(1.0)
    assert long_share_at(0.0, 0.7) == pytest.approx(0.0)
    assert long_share_at(0.5, 0.7) == pytest.approx(0.7)


def test_a_day_is_ten_times_busier_at_noon_and_long_prompted_there() -> None:
    trace = day_trace(duration_s=5000.0, peak_rate=20.0, seed=1)
    windows = windows_of(trace, 5000.0, 50.0)  # 100 windows: the first and last at the trough
    counts = [len(window) for window in windows]
    night = (counts[0] + counts[-1]) / 2  # about 2 a second (the trough) x 50 s, Poisson
    noon = (counts[49] + counts[50]) / 2  # about 20 a second x 50 s
    assert 7 < noon / night < 14, counts
    long_share = [sum(a.long_prompt for a in window) / len(window) for window in windows]
    assert long_share[0] < 0.1 and long_share[-1] < 0.1 and long_share[50] > 0.5, long_share
    assert all(b.offset_s >= a.offset_s for a, b in zip(trace, trace[1:]))
    assert day_trace(duration_s=5000.0, peak_rate=20.0, seed=1) == trace
    assert day_trace(duration_s=5000.0, peak_rate=20.0, seed=2) != trace


def test_a_day_refuses_impossible_shapes() -> None:
    with pytest.raises(ValueError, match="trough_ratio"):
        day_trace(duration_s=10.0, peak_rate=1.0, trough_ratio=0.0)
