"""Instance limits: refuse a request at once (429 with ``Retry-After``) rather than let
it queue for minutes, and never bury one slow instance under requests.

Each prefilling instance (prefill or colocated) reports the prompt tokens it still has to
compute and the rate it computed them at recently. A new prompt would wait about

    wait_s = (num_pending_prefill_tokens + prompt tokens sent since that report) / prefill_tokens_per_s

before its own prefill starts. With ``--max-queue-delay`` set, an instance whose wait
exceeds it takes no new request; with ``--max-inflight-per-instance``, neither does one
that already has that many calls from this gateway outstanding. When no instance of the
role qualifies, the request is refused with a hint of when to retry. An instance that has
not measured its rate yet (no prefill since start) is assumed to have no wait.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from splitserve.v1 import disaggregation_pb2


@dataclass(frozen=True, slots=True)
class InstanceLimits:
    max_queue_delay_s: float | None = None  # None: no limit
    max_inflight_per_instance: int | None = None  # None: no limit

    def __post_init__(self) -> None:
        if self.max_queue_delay_s is not None and self.max_queue_delay_s <= 0:
            raise ValueError(f"--max-queue-delay must be > 0 seconds, got {self.max_queue_delay_s}")
        if self.max_inflight_per_instance is not None and self.max_inflight_per_instance < 1:
            raise ValueError(f"--max-inflight-per-instance must be >= 1, got {self.max_inflight_per_instance}")


class Overloaded(Exception):
    """Every instance that could take the request is over a limit."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def estimated_wait_s(report: disaggregation_pb2.LoadReport | None, num_dispatched_tokens: int) -> float:
    """Seconds a new prompt would queue on an instance before its own prefill starts."""
    if report is None or report.prefill_tokens_per_s <= 0:
        return 0.0
    return (report.num_pending_prefill_tokens + num_dispatched_tokens) / report.prefill_tokens_per_s


def retry_after_s(excess_wait_s: float) -> int:
    """Whole seconds for ``Retry-After``: when the shortest queue should be short enough."""
    return max(1, math.ceil(excess_wait_s))
