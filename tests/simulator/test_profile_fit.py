"""The non-negative least-squares fit of a profile's step coefficients."""

from __future__ import annotations

import pytest

from simulator.profile_fit import fit_step_coefficients
from simulator.timing_model import MeasuredStep
from tests.simulator.factories import make_profile

ROWS = [
    [(16, 16)],
    [(512, 512)],
    [(512, 2048)],
    [(1, 64)],
    [(1, 2048)] * 8,
    [(1, 128)] * 32,
    [(64, 64), (1, 300), (1, 900)],
]


def test_exact_steps_give_back_the_coefficients_they_came_from() -> None:
    truth = make_profile(step_fixed_s=2e-3, token_s=5e-5, attention_s=3e-9, context_s=4e-7)
    fit = fit_step_coefficients([MeasuredStep(tuple(rows), truth.step_seconds(rows)) for rows in ROWS])
    assert fit.coefficients == pytest.approx(
        {"step_fixed_s": 2e-3, "token_s": 5e-5, "attention_s": 3e-9, "context_s": 4e-7}, rel=1e-6
    )
    assert fit.worst_ratio == pytest.approx(1.0)


def test_a_coefficient_the_steps_argue_negative_is_held_at_zero() -> None:
    # Longer contexts made these steps faster: the unconstrained fit would give context_s < 0.
    steps = [
        MeasuredStep(((1, 10),), 1.0),
        MeasuredStep(((1, 1000),), 0.9),
        MeasuredStep(((1, 10),) * 4, 1.2),
        MeasuredStep(((1, 1000),) * 4, 1.1),
        MeasuredStep(((100, 100),), 5.0),
    ]
    fit = fit_step_coefficients(steps)
    assert min(fit.coefficients.values()) >= 0.0
    assert fit.coefficients["context_s"] == 0.0


def test_too_few_steps_are_refused() -> None:
    with pytest.raises(ValueError, match="at least as many steps"):
        fit_step_coefficients([MeasuredStep(((1, 1),), 1.0)])
