"""How long cached prefix blocks go unused before a request uses them again, as the gateway
sees it at dispatch, and what that says about a block of a given age.

Cache-aware routing prices a prompt sent where it would evict cached blocks by what those
blocks are still worth. A block unused for longer than almost every reuse seen lately is
very likely dead (a previous workload's prefix, a one-off suffix), and pushing it out costs
nothing; a block just used costs its whole recompute. In between, its worth falls linearly
with its age, to nothing at the reuse horizon: 1.5 times the 95th percentile of the recent
reuse ages. With every eviction priced in full instead, two full instances looked equally
costly for every new prefix, and whichever ranked first took them all until it evicted its
own live prefixes while the other held only dead ones; with the share of reuses later than
a block's age as its worth, live blocks were priced too low and an instance that measured a
faster prefill still took new prefixes it had no room for (tests/gateway/test_routing_replay.py
replays both).
"""

from __future__ import annotations

import bisect
from collections import deque

MAX_SAMPLES = 1024  # the recent reuses kept: enough for a stable quantile, few enough to follow a changing workload
HORIZON_QUANTILE = 0.95
HORIZON_MARGIN = 1.5  # a reuse a little later than most still happens


class ReuseAges:
    def __init__(self, max_samples: int = MAX_SAMPLES) -> None:
        self._arrival: deque[float] = deque()  # in the order observed, to drop the oldest sample
        self._sorted: list[float] = []
        self._max_samples = max_samples

    def __len__(self) -> int:
        return len(self._sorted)

    def observe(self, age_s: float) -> None:
        """A cached block was used again ``age_s`` seconds after its previous use."""
        if len(self._arrival) >= self._max_samples:
            oldest = self._arrival.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
        self._arrival.append(age_s)
        bisect.insort(self._sorted, age_s)

    def horizon_s(self) -> float:
        """The age past which a cached block counts as dead; infinite while nothing was observed."""
        if not self._sorted:
            return float("inf")
        index = min(len(self._sorted) - 1, int(HORIZON_QUANTILE * len(self._sorted)))
        return HORIZON_MARGIN * self._sorted[index]

    def value(self, age_s: float) -> float:
        """What keeping a block unused for ``age_s`` is worth, from 1 (just used) to 0 (at the
        horizon or past it). 1 at any age while nothing was observed: every cached block
        counts in full, as if it will be used again."""
        horizon = self.horizon_s()
        if horizon == float("inf"):
            return 1.0
        if horizon <= 0:
            return 0.0
        return max(0.0, 1.0 - age_s / horizon)
