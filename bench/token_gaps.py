"""The server's token gaps beside the client's, and whether the client kept up.

A benchmark client times each chunk when it reads it. On a host it shares with the server,
a client starved of CPU reads late: its gaps grow while the server's writes stay on time,
and an ITL figure then measures the client, not the server. splitserve's gateway says when
it wrote each chunk of a stream, when asked (gateway/chunk_times.py): the request header
``x-splitserve-chunk-times: 1``, answered by one SSE comment before ``data: [DONE]``::

    : splitserve-chunk-times-ms=0.000,0.412,25.873,...

one offset (ms from the first chunk) per ``data:`` event written before it, in order. The
client (bench/client.py) pairs them by position with the events it read, so each of its
token gaps has the server's gap between the same two content chunks (:func:`server_gaps`).

Both sides' gaps, pooled over the requests that carried the server's times, are summarised
at p50, p99, p99.9 and max (linear interpolation, as ``numpy.percentile``). The client
*lagged* at a statistic where its gap exceeds the server's by more than ``CLIENT_LAG_MS``
(a client's gap may also come out shorter: two chunks read at once); a run whose client
lagged at any of them is flagged, and its client-side ITL figures there measure the client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

CHUNK_TIMES_HEADER = "x-splitserve-chunk-times"  # gateway/chunk_times.py reads it
CHUNK_TIMES_COMMENT = "splitserve-chunk-times-ms"  # and writes this comment
_PERCENTILES = {"p50": 50.0, "p99": 99.0, "p99.9": 99.9}
GAP_STATS = (*_PERCENTILES, "max")
CLIENT_LAG_MS = 20.0
CLIENT_LAG_RULE = (
    f"client gap > server gap + {CLIENT_LAG_MS:g} ms at p50, p99, p99.9 or max (both over the same pairs of chunks)"
)


def parse_chunk_times(comment: str) -> list[float] | None:
    """The offsets (ms) of a ``splitserve-chunk-times-ms=...`` comment's text; None for any
    other comment, or a malformed one."""
    name, sep, values = comment.partition("=")
    if name.strip() != CHUNK_TIMES_COMMENT or not sep:
        return None
    try:
        return [float(value) for value in values.split(",")] if values.strip() else []
    except ValueError:
        return None


def server_gaps(chunk_times_ms: list[float], content_events: list[int]) -> list[float]:
    """The server's gap (seconds) before each content chunk after the first: ``content_events``
    are the positions, among the stream's ``data:`` events, of those that carried tokens."""
    return [(chunk_times_ms[b] - chunk_times_ms[a]) / 1000.0 for a, b in zip(content_events, content_events[1:])]


@dataclass(frozen=True, slots=True)
class TokenGaps:
    """Client and server token gaps of one run, at ``GAP_STATS``, in milliseconds."""

    num_requests: int  # requests that carried the server's chunk times
    num_gaps: int
    client_ms: dict[str, float]
    server_ms: dict[str, float]
    lagged_at: tuple[str, ...]  # the statistics at which the client lagged (CLIENT_LAG_RULE)

    @property
    def client_lagged(self) -> bool:
        return bool(self.lagged_at)

    def as_json(self) -> dict[str, Any]:
        return {
            "num_requests": self.num_requests,
            "num_gaps": self.num_gaps,
            "client_ms": dict(self.client_ms),
            "server_ms": dict(self.server_ms),
            "client_lagged": self.client_lagged,
            "lagged_at": list(self.lagged_at),
            "client_lag_rule": CLIENT_LAG_RULE,
        }


def compare_gaps(pairs: list[tuple[list[float], list[float]]]) -> TokenGaps | None:
    """``pairs``: each request's client gaps and the server's gaps between the same chunks
    (seconds, equal lengths). None when no request carried the server's times."""
    if not pairs:
        return None
    for client, server in pairs:
        if len(client) != len(server):
            raise RuntimeError(f"{len(client)} client gaps paired with {len(server)} server gaps; this is a bug")
    client_s = [gap for client, _ in pairs for gap in client]
    server_s = [gap for _, server in pairs for gap in server]
    client_ms, server_ms = gap_stats(client_s), gap_stats(server_s)
    lagged_at = tuple(name for name in client_ms if client_ms[name] > server_ms[name] + CLIENT_LAG_MS)
    return TokenGaps(len(pairs), len(client_s), client_ms, server_ms, lagged_at)


def gap_stats(gaps_s: list[float]) -> dict[str, float]:
    """``GAP_STATS`` of gaps given in seconds, in milliseconds; empty without gaps."""
    if not gaps_s:
        return {}
    ms = np.asarray(gaps_s, dtype=np.float64) * 1000.0
    stats = {name: float(np.percentile(ms, p)) for name, p in _PERCENTILES.items()}
    return stats | {"max": float(ms.max())}
