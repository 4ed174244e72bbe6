"""Chi-square tests for the sampling tests (torch only: scipy is not a dependency)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

import torch


def _p_value(statistic: float, degrees_of_freedom: int) -> float:
    """P(X >= statistic) for X ~ chi-square(df): the regularized upper incomplete gamma."""
    return float(
        torch.special.gammaincc(
            torch.tensor(degrees_of_freedom / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)
        )
    )


def goodness_of_fit(observed: Sequence[int], expected_probs: Sequence[float], min_expected: float = 5.0) -> float:
    """p-value of ``observed`` counts against the distribution ``expected_probs``; categories with
    fewer than ``min_expected`` expected counts are pooled into one."""
    total = sum(observed)
    cells: list[tuple[float, float]] = []
    pooled_o = pooled_e = 0.0
    for o, p in zip(observed, expected_probs):
        if p * total < min_expected:
            pooled_o, pooled_e = pooled_o + o, pooled_e + p * total
        else:
            cells.append((o, p * total))
    if pooled_e > 0:
        cells.append((pooled_o, pooled_e))
    statistic = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    return _p_value(statistic, len(cells) - 1)


def two_sample(a: Sequence[Hashable], b: Sequence[Hashable], min_count: int = 5) -> float:
    """p-value that samples ``a`` and ``b`` come from the same distribution (a 2 x C contingency
    table); outcomes seen fewer than ``min_count`` times in both together are pooled."""
    count_a, count_b = Counter(a), Counter(b)
    cells: list[tuple[int, int]] = []
    rare_a = rare_b = 0
    for outcome in set(count_a) | set(count_b):
        x, y = count_a[outcome], count_b[outcome]
        if x + y < min_count:
            rare_a, rare_b = rare_a + x, rare_b + y
        else:
            cells.append((x, y))
    if rare_a + rare_b:
        cells.append((rare_a, rare_b))
    n_a, n_b = len(a), len(b)
    statistic = 0.0
    for x, y in cells:
        column = x + y
        for observed, row_total in ((x, n_a), (y, n_b)):
            expected = column * row_total / (n_a + n_b)
            statistic += (observed - expected) ** 2 / expected
    return _p_value(statistic, len(cells) - 1)
