"""Arrival schedules: Poisson and gamma gaps with a fixed seed, inf rate and burstiness."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.arrivals import arrival_offsets

NUM_REQUESTS = 20_000


def _gaps(rate: float, burstiness: float, seed: int = 0) -> np.ndarray:
    offsets = arrival_offsets(NUM_REQUESTS, rate, burstiness, seed)
    assert offsets[0] == 0.0 and len(offsets) == NUM_REQUESTS
    return np.diff(offsets)


@pytest.mark.parametrize("rate", [0.5, 10.0, 250.0])
def test_poisson_arrivals_have_the_requested_rate_and_exponential_gaps(rate: float) -> None:
    gaps = _gaps(rate, burstiness=1.0)
    assert np.all(gaps >= 0)
    assert 1 / gaps.mean() == pytest.approx(rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_arrivals_keep_the_rate_and_change_the_spread(burstiness: float) -> None:
    gaps = _gaps(8.0, burstiness)
    assert 1 / gaps.mean() == pytest.approx(8.0, rel=0.03)
    # gamma with shape k: squared coefficient of variation 1 / k
    assert (gaps.std() / gaps.mean()) ** 2 == pytest.approx(1 / burstiness, rel=0.1)


def test_infinite_rate_sends_everything_at_once_and_infinite_burstiness_is_regular() -> None:
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    assert arrival_offsets(4, 2.0, burstiness=math.inf) == pytest.approx([0.0, 0.5, 1.0, 1.5])


def test_the_seed_fixes_the_schedule() -> None:
    assert arrival_offsets(50, 3.0, 1.0, seed=7) == arrival_offsets(50, 3.0, 1.0, seed=7)
    assert arrival_offsets(50, 3.0, 1.0, seed=7) != arrival_offsets(50, 3.0, 1.0, seed=8)


@pytest.mark.parametrize(("rate", "burstiness"), [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (math.nan, 1.0)])
def test_invalid_rate_or_burstiness_is_a_user_error(rate: float, burstiness: float) -> None:
    with pytest.raises(ValueError):
        arrival_offsets(3, rate, burstiness)
