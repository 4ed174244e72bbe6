"""Keeping the instance pool current: a static list polled over gRPC, or the
instances' own registrations in Redis."""

from __future__ import annotations

import asyncio
import logging

import grpc
import redis.asyncio as redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.registration import registry_client, registry_error, scan_registrations
from gateway.instances import ROLES, InstancePool, Role
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc

logger = logging.getLogger(__name__)


class DiscoveryLoop:
    """A discovery's poll loop as a task. It runs until shutdown; one that ended before (a bug)
    leaves the gateway routing on reports that only age, so :attr:`alive` turns false and
    ``/health`` answers 503."""

    def __init__(self, discovery: StaticDiscovery | RedisDiscovery) -> None:
        self.task = asyncio.create_task(discovery.run())
        self.task.add_done_callback(self._ended)

    @property
    def alive(self) -> bool:
        return not self.task.done()

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    @staticmethod
    def _ended(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error(
                "instance discovery stopped: the gateway no longer learns of instances; /health answers 503",
                exc_info=task.exception(),
            )


class StaticDiscovery:
    """Fixed addresses (``--prefill/--decode/--colocated HOST:PORT``), each polled for
    health and load every ``interval_s``."""

    def __init__(self, pool: InstancePool, addresses: dict[Role, list[str]], interval_s: float) -> None:
        self.pool = pool
        self.interval_s = interval_s
        self._refused_by: set[str] = set()  # instances that answered UNAUTHENTICATED
        for role, role_addresses in addresses.items():
            for address in role_addresses:
                pool.add(address, role)

    async def run(self) -> None:
        # Each instance on its own schedule: one that stopped answering (its poll waits out the
        # timeout) must not delay the others' reports until they too look stale.
        await asyncio.gather(*(self._poll_forever(address) for address in list(self.pool.instances)))

    async def _poll_forever(self, address: str) -> None:
        while True:
            await self._poll(address)
            await asyncio.sleep(self.interval_s)

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(address) for address in list(self.pool.instances)))

    async def _poll(self, address: str) -> None:
        state = self.pool.instances[address]
        timeout = self.pool.stale_after_s
        try:
            health, report = await asyncio.gather(
                health_pb2_grpc.HealthStub(state.channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout),
                disaggregation_pb2_grpc.LoadStub(state.channel).GetLoadReport(
                    disaggregation_pb2.LoadReportRequest(), timeout=timeout
                ),
            )
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNAUTHENTICATED and address not in self._refused_by:
                self._refused_by.add(address)  # said once, not at every poll
                logger.error("%s instance %s refused the gateway: %s", state.role, address, error.details())
            # A slow answer is not a dead instance: its report goes stale if it stays slow.
            if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                self.pool.record_unreachable(address)
            return
        if report.role and report.role != state.role:
            logger.error(
                "%s was given as a %s instance but reports role %r; not using it", address, state.role, report.role
            )
            self.pool.record_unreachable(address)
            return
        self._refused_by.discard(address)
        self.pool.record_report(address, report, health.status == health_pb2.HealthCheckResponse.SERVING)


class RedisDiscovery:
    """Instances found through their registrations in Redis (``cluster.registration``)."""

    def __init__(self, pool: InstancePool, url: str, interval_s: float) -> None:
        self.pool = pool
        self.interval_s = interval_s
        self.url = url
        self.client = registry_client(url)
        self._heartbeat_unix_s: dict[str, float] = {}  # by address: the newest heartbeat seen

    async def run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except (redis.RedisError, OSError) as error:
                # Keep routing on what we know; reports go stale if the outage lasts.
                logger.warning("registry scan failed: %s", registry_error(error, self.url))
            await asyncio.sleep(self.interval_s)

    async def first_poll(self) -> None:
        """The poll before the gateway serves: raises ValueError with the fix when the registry
        refuses the gateway (a wrong or missing password)."""
        try:
            await self.poll_once()
        except (redis.RedisError, OSError) as error:
            raise ValueError(registry_error(error, self.url)) from None

    async def poll_once(self) -> None:
        seen = set()
        for registration in await scan_registrations(self.client):
            role = next((r for r in ROLES if r == registration.report.role), None)
            if role is None or not registration.grpc_address:
                logger.warning(
                    "ignoring a registration with role %r at %r", registration.report.role, registration.grpc_address
                )
                continue
            address = registration.grpc_address
            seen.add(address)
            self.pool.add(address, role)
            # Freshness by the gateway's clock: a heartbeat counts when its timestamp moves,
            # so clock skew between nodes does not matter.
            if registration.unix_s > self._heartbeat_unix_s.get(address, 0.0):
                self._heartbeat_unix_s[address] = registration.unix_s
                self.pool.record_report(address, registration.report, registration.serving)
        for address in set(self.pool.instances) - seen:
            self._heartbeat_unix_s.pop(address, None)
            self.pool.remove(address)

    async def close(self) -> None:
        await self.client.aclose()
