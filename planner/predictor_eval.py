"""Which predictor predicts a trace best: each one fed the trace interval by interval, its
one-step-ahead forecasts scored against what came, as the planner would have used them.

The score is the mean absolute error over the intervals after the first, divided by the
trace's mean (so traces of different scales compare): 0 is perfect, and :class:`LastValue`'s
score is what merely repeating the last interval costs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from planner.predictors import Predictor


def forecast_error(make: Callable[[], Predictor], trace: Sequence[float]) -> float:
    """Mean absolute one-step-ahead error over ``trace``, relative to its mean."""
    if len(trace) < 2:
        raise ValueError(f"a trace to score predictors on needs at least 2 intervals; got {len(trace)}")
    predictor = make()
    errors: list[float] = []
    for value in trace:
        forecast = predictor.predict()
        if forecast is not None:
            errors.append(abs(forecast - value))
        predictor.observe(value)
    mean = sum(trace) / len(trace)
    return (sum(errors) / len(errors)) / mean if mean > 0 else sum(errors) / len(errors)


def rank_predictors(
    predictors: Mapping[str, Callable[[], Predictor]], traces: Mapping[str, Sequence[float]]
) -> list[tuple[str, float]]:
    """Predictors by their mean score over ``traces``, best first: (name, score)."""
    scored = [
        (name, sum(forecast_error(make, trace) for trace in traces.values()) / len(traces))
        for name, make in predictors.items()
    ]
    return sorted(scored, key=lambda item: item[1])
