"""Fitting a timing profile's step coefficients to measured steps (numpy; no torch).

The coefficients must be non-negative (a negative one would make some step faster for doing more
work), and steps span three orders of magnitude (a decode of one row against a prefill of
thousands of tokens), so the fit minimizes the *relative* error: each step's equation is divided
by its measured time. With four coefficients, non-negative least squares is solved exactly by
trying every subset of them held at zero and keeping the best fit whose free coefficients are
all non-negative.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from simulator.timing_model import MeasuredStep, step_features

COEFFICIENT_NAMES = ("step_fixed_s", "token_s", "attention_s", "context_s")


@dataclass(frozen=True, slots=True)
class StepFit:
    """Fitted coefficients (named as in :class:`~simulator.timing_model.TimingProfile`) and, per
    measured step in order, predicted / measured time."""

    coefficients: dict[str, float]
    ratios: tuple[float, ...]

    @property
    def worst_ratio(self) -> float:
        """The largest factor by which a prediction misses its step, either way (1.0: exact)."""
        return max(max(r, 1 / r) for r in self.ratios)


def design_matrix(steps: Sequence[MeasuredStep]) -> np.ndarray:
    """One row per step: [1, tokens, attended pairs, context tokens], the formula's columns."""
    return np.array([[1.0, *step_features(step.rows)] for step in steps], dtype=np.float64)


def fit_step_coefficients(steps: Sequence[MeasuredStep]) -> StepFit:
    """Non-negative coefficients that minimize the steps' squared relative errors."""
    if len(steps) < len(COEFFICIENT_NAMES):
        raise ValueError(
            f"fitting {len(COEFFICIENT_NAMES)} coefficients needs at least as many steps; got {len(steps)}"
        )
    seconds = np.array([step.seconds for step in steps], dtype=np.float64)
    weighted = design_matrix(steps) / seconds[:, None]
    target = np.ones(len(steps))
    # Columns differ by orders of magnitude (1 against pairs in the millions): scale them to unit
    # norm so that lstsq's rank cut does not drop the small-valued ones.
    scale = np.linalg.norm(weighted, axis=0)
    scale[scale == 0] = 1.0
    weighted /= scale
    best: tuple[float, np.ndarray] | None = None
    num_columns = len(COEFFICIENT_NAMES)
    for size in range(1, num_columns + 1):
        for free in itertools.combinations(range(num_columns), size):
            solution, *_ = np.linalg.lstsq(weighted[:, free], target, rcond=None)
            if np.any(solution < 0):
                continue
            coefficients = np.zeros(num_columns)
            coefficients[list(free)] = solution
            error = float(np.sum((weighted @ coefficients - target) ** 2))
            if best is None or error < best[0]:
                best = (error, coefficients)
    if best is None:  # the fixed term alone always fits with a positive value
        raise RuntimeError("bug: no non-negative fit, not even the fixed term alone")
    coefficients = best[1] / scale
    predicted = design_matrix(steps) @ coefficients
    return StepFit(
        coefficients=dict(zip(COEFFICIENT_NAMES, (float(c) for c in coefficients))),
        ratios=tuple(float(r) for r in predicted / seconds),
    )
