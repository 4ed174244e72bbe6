"""What a gateway knows of its Redis registry, for ``/metrics`` and ``/status``: whether the
last scan reached it (and since when it has not), and the records it refused and why.
``gateway.discovery.RedisDiscovery`` keeps it on the instance pool; a gateway with a
static instance list has none."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from cluster.registry_record import RefusalReason


@dataclass(slots=True)
class RegistryState:
    # Unix seconds of the first failed scan of the outage under way; None while scans succeed.
    unreachable_since: float | None = None
    num_refused: Counter[RefusalReason] = field(default_factory=Counter)  # records ignored, every scan counting
    refused_now: dict[str, RefusalReason] = field(default_factory=dict)  # in the latest scan, by Redis key

    @property
    def reachable(self) -> bool:
        return self.unreachable_since is None

    def unreachable_for_s(self) -> float:
        return 0.0 if self.unreachable_since is None else max(0.0, time.time() - self.unreachable_since)
