"""How many gRPC calls an instance's server received, by method: the polls gateways make
(``Load/GetLoadReport``, ``grpc.health.v1.Health/Check``; ``Load/GetKVEvents`` when a KV-event
subscription resynchronises), their subscriptions (``Load/WatchKVEvents``, one call per stream
however many batches it carries), the requests they send (``Prefill``, ``Decode``) and the
calls between instances (leases, releases).
A cluster's own traffic is counted where it lands, not inferred from its senders' intervals.

In call order: :meth:`cluster.internal_grpc.InternalPlane.server` puts the plane's
:class:`CallCounts` first among the server's interceptors, so every call is counted when it
arrives, before the cluster-secret check (a refused call is still traffic); the instance's
Prometheus endpoint (``serving/metrics.py``) exports the counts as
``splitserve_engine_grpc_calls_total{method=...}``. Counting is a dict increment on the
server's event loop: no lock, and the scrape thread reads a copy.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable

import grpc


class CallCounts(grpc.aio.ServerInterceptor):
    """Calls received since start, by full method name (``/package.Service/Method``)."""

    def __init__(self) -> None:
        self._num_calls: Counter[str] = Counter()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        self._num_calls[handler_call_details.method] += 1
        return await continuation(handler_call_details)

    def count(self, method: str) -> None:
        """Count a call that arrived inside another one: a multiplexed call (serving/call_mux.py)
        is counted under its own method, as it would be on a call of its own."""
        self._num_calls[method] += 1

    def snapshot(self) -> dict[str, int]:
        """The counts so far; safe from another thread (a copy, taken in one step)."""
        return dict(self._num_calls)
