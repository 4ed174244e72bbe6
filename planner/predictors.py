"""Load predictors: each interval the planner feeds one the rate it observed and asks for the
rate of the next interval, the one its decision must carry (an instance started now is ready
about then).

- :class:`LastValue`: tomorrow is today; the baseline the others must beat.
- :class:`MovingAverage`: the mean of the last ``window`` intervals; smooth, and late by half a
  window on a trend.
- :class:`HoltLinear`: Holt's linear (double exponential) smoothing, a level and a trend each
  updated with its own weight: ARIMA(0,2,2)'s forecast, it follows a ramp without lag.

``planner/predictor_eval.py`` measures which predicts a trace best; docs/planner.md has the
figures.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol


class Predictor(Protocol):
    def observe(self, value: float) -> None:
        """Called once an interval, with the value measured over it."""

    def predict(self, steps_ahead: int = 1) -> float | None:
        """The value ``steps_ahead`` intervals on; None before the first observation."""


class LastValue:
    def __init__(self) -> None:
        self._last: float | None = None

    def observe(self, value: float) -> None:
        self._last = value

    def predict(self, steps_ahead: int = 1) -> float | None:
        return self._last


class MovingAverage:
    def __init__(self, window: int = 5) -> None:
        if window < 1:
            raise ValueError(f"a moving average's window must be >= 1 interval; got {window}")
        self._values: deque[float] = deque(maxlen=window)

    def observe(self, value: float) -> None:
        self._values.append(value)

    def predict(self, steps_ahead: int = 1) -> float | None:
        return sum(self._values) / len(self._values) if self._values else None


class HoltLinear:
    """``level = a * x + (1 - a) * (level + trend)``; ``trend = b * (level - previous level) +
    (1 - b) * trend``; forecast ``level + h * trend``, never below 0 (a rate)."""

    def __init__(self, alpha: float = 0.5, beta: float = 0.3) -> None:
        if not (0 < alpha <= 1 and 0 <= beta <= 1):
            raise ValueError(f"Holt's weights need 0 < alpha <= 1 and 0 <= beta <= 1; got {alpha}, {beta}")
        self.alpha, self.beta = alpha, beta
        self._level: float | None = None
        self._trend = 0.0

    def observe(self, value: float) -> None:
        if self._level is None:
            self._level = value
            return
        previous = self._level
        self._level = self.alpha * value + (1 - self.alpha) * (previous + self._trend)
        self._trend = self.beta * (self._level - previous) + (1 - self.beta) * self._trend

    def predict(self, steps_ahead: int = 1) -> float | None:
        if self._level is None:
            return None
        return max(0.0, self._level + steps_ahead * self._trend)


PREDICTORS: dict[str, Callable[[], Predictor]] = {
    "last": LastValue,
    "moving-average": MovingAverage,
    "holt": HoltLinear,
}


def make_predictor(name: str) -> Predictor:
    """A fresh predictor by its ``--predictor`` name."""
    if name not in PREDICTORS:
        raise ValueError(f"--predictor must be one of {', '.join(PREDICTORS)}; got {name!r}")
    return PREDICTORS[name]()
