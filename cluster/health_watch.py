"""``grpc.health.v1.Health`` with its ``Watch`` streams bounded. Health checks are open to
anyone on purpose (orchestrators probe without the cluster secret), and grpcio-health-checking's
servicer keeps every ``Watch`` stream open for as long as its client likes, as many as it likes:
each an open HTTP/2 stream, a task and a waiter on the server (issue 42, item 7). Here:

- at most ``max_watchers`` streams at once; one more gets ``RESOURCE_EXHAUSTED``;
- each stream ends (OK) after ``lifetime_s``: a client watching for longer calls ``Watch``
  again, as gRPC's health-checking clients do when a stream ends;
- a service name longer than :data:`MAX_SERVICE_NAME_CHARS` is refused (``INVALID_ARGUMENT``);
- once the server enters its graceful shutdown, each stream sends the status it has come to
  (NOT_SERVING) and ends (OK): a stream stays open for as long as its client likes, so the
  server's drain, which waits for every open call, would otherwise wait on watchers that
  request nothing, up to its grace, and a container's stop timeout would kill it first.

``Check`` is the library's own. The library's ``Watch`` also forgets a service's waiters
whenever one of its streams ends, so that the others miss later changes; this one keeps a
version number of the statuses instead, which every stream compares with the one it last sent.
Instances (``serving/instance.py``) and the gateway's gRPC front (``gateway/grpc_front.py``)
serve it.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2

DEFAULT_MAX_WATCHERS = 64  # an orchestrator or a mesh watches with a few; strangers share the rest
DEFAULT_LIFETIME_S = 300.0
MAX_SERVICE_NAME_CHARS = 256


class BoundedHealthServicer(health.aio.HealthServicer):
    def __init__(self, max_watchers: int = DEFAULT_MAX_WATCHERS, lifetime_s: float = DEFAULT_LIFETIME_S) -> None:
        super().__init__()
        self.max_watchers = max_watchers
        self.lifetime_s = lifetime_s
        self.num_watchers = 0
        self._version = 0  # moves on with every status set: what a stream waits for
        self._changed = asyncio.Condition()

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:  # noqa: N802 - gRPC's name
        if len(request.service) > MAX_SERVICE_NAME_CHARS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"a service name has at most {MAX_SERVICE_NAME_CHARS} characters"
            )
        if self.num_watchers >= self.max_watchers:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this server serves {self.max_watchers} health Watch streams at once; use Check, or watch again later",
            )
        self.num_watchers += 1
        try:
            async with asyncio.timeout(self.lifetime_s):
                sent = None
                while True:
                    version = self._version
                    status = self._server_status.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                    if status != sent:
                        await context.write(health_pb2.HealthCheckResponse(status=status))  # not under the lock
                        sent = status
                    if self._gracefully_shutting_down:
                        return
                    await self._next_change(version)
        except TimeoutError:
            return  # the stream's lifetime: it ends OK, and the client watches again
        finally:
            self.num_watchers -= 1

    async def _next_change(self, seen_version: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self._version != seen_version)

    async def _set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        self._server_status[service] = status
        async with self._changed:
            self._version += 1
            self._changed.notify_all()
