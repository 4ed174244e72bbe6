"""When each request is sent: a Poisson process, or a gamma renewal process for
burstier or smoother traffic.

Gaps between requests are gamma-distributed with shape ``burstiness`` and mean
``1 / request_rate``: shape 1 is the exponential (Poisson arrivals), under 1 gives
bursts and lulls (squared coefficient of variation ``1 / burstiness``), over 1 gives
evenly spaced arrivals, and ``inf`` a fixed gap. A rate of ``inf`` sends everything
at once. Unlike vLLM, the gaps are not rescaled to make the last arrival land at
exactly ``num_requests / request_rate``: the process is what its name says.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times in seconds from the start of the run, non-decreasing; the first is 0."""
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0 (1 = Poisson), got {burstiness}")
    if num_requests <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if math.isinf(burstiness):
        gaps = np.full(num_requests - 1, 1.0 / request_rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
