"""Keeping the instance pool current: a static list polled over gRPC, or the
instances' own registrations in Redis.

With Redis, two loops run side by side, so that a registry that hangs (a Redis stopped, not
dead: its connections open, its answers never coming) never holds back the instances' own
reports. The scan loop, every ``interval_s``, in order:

1. :func:`cluster.registration.scan_registrations` reads every record and checks it
   (``cluster/registry_record.py``: signed with the cluster secret, dated within the clock
   window, every number sane); refused records are logged once per key and reason and
   counted (``splitserve_registry_records_refused_total``), never routed to.
2. Instances with a believed record join the pool and take its load report; instances
   without one leave it.
3. When the scan fails (Redis down, unreachable, or slower than a third of
   ``--stale-after``), the registry is unreachable: the pool keeps every instance it knows
   until a scan succeeds again; instances the registry no longer lists after that are kept
   for ``--stale-after`` more, while they register again in a registry that restarted
   empty. ``/status`` and ``splitserve_registry_reachable`` say so the while.

The refresh loop, every ``interval_s`` whatever the scan is doing: each instance whose latest
report (the registry's or its own) is older than half of ``--stale-after`` is polled over gRPC
for health and load, as a static list is, each on its own (at most one poll in flight per
instance). While the registry answers, heartbeats keep every report younger than that and
nothing is polled; once it stops, an instance's own answer arrives before its report goes stale.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import redis.asyncio as redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.registration import registry_client, registry_error, scan_registrations
from cluster.registry_record import RecordRefused, RefusalReason, load_report_problem
from cluster.store_urls import redact_url
from gateway.instances import ROLES, InstancePool, Role
from gateway.registry_state import RegistryState
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


class InstancePolls:
    """Health and load of instances polled over gRPC: a static list's always, Redis-found ones'
    while the registry is unreachable. Says once, not at every poll, that an instance refused
    the gateway or sent a report that makes no sense."""

    def __init__(self, pool: InstancePool) -> None:
        self.pool = pool
        self._refused_by: set[str] = set()  # instances that answered UNAUTHENTICATED
        self._bad_reports: set[str] = set()  # instances whose latest report was refused

    async def poll(self, address: str) -> None:
        state = self.pool.instances.get(address)
        if state is None:
            return
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
                self._refused_by.add(address)
                logger.error("%s instance %s refused the gateway: %s", state.role, address, error.details())
            # A slow answer is not a dead instance: its report goes stale if it stays slow.
            if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                self.pool.record_unreachable(address)
            return
        self._refused_by.discard(address)
        if report.role and report.role != state.role:
            logger.error(
                "%s was given as a %s instance but reports role %r; not using it", address, state.role, report.role
            )
            self.pool.record_unreachable(address)
            return
        problem = load_report_problem(report)
        if problem is not None:
            if address not in self._bad_reports:
                self._bad_reports.add(address)
                logger.error("%s instance %s sent a load report that %s; not using it", state.role, address, problem)
            self.pool.record_unreachable(address)
            return
        self._bad_reports.discard(address)
        self.pool.record_report(address, report, health.status == health_pb2.HealthCheckResponse.SERVING)


class StaticDiscovery:
    """Fixed addresses (``--prefill/--decode/--colocated HOST:PORT``), each polled for
    health and load every ``interval_s``."""

    def __init__(self, pool: InstancePool, addresses: dict[Role, list[str]], interval_s: float) -> None:
        self.pool = pool
        self.interval_s = interval_s
        self._polls = InstancePolls(pool)
        for role, role_addresses in addresses.items():
            for address in role_addresses:
                pool.add(address, role)

    async def run(self) -> None:
        # Each instance on its own schedule: one that stopped answering (its poll waits out the
        # timeout) must not delay the others' reports until they too look stale.
        await asyncio.gather(*(self._poll_forever(address) for address in list(self.pool.instances)))

    async def _poll_forever(self, address: str) -> None:
        while True:
            await self._polls.poll(address)
            await asyncio.sleep(self.interval_s)

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._polls.poll(address) for address in list(self.pool.instances)))


class RedisDiscovery:
    """Instances found through their registrations in Redis (``cluster.registration``), checked
    with the cluster secret's registry key (the pool's plane's)."""

    def __init__(self, pool: InstancePool, url: str, interval_s: float) -> None:
        self.pool = pool
        self.interval_s = interval_s
        self.url = url
        self.client = registry_client(url)
        secret = pool.plane.secret
        self._key = secret.registry_key if secret is not None else None
        if self._key is None:
            logger.warning(
                "no cluster secret: registry records are believed unsigned; anyone who can write to %s can point "
                "this gateway at an instance of their own (loopback development only)",
                redact_url(url),
            )
        self.state = pool.registry = RegistryState()
        self._polls = InstancePolls(pool)
        self._heartbeat_unix_s: dict[str, float] = {}  # by address: the newest heartbeat seen
        self._said_refused: set[tuple[str, RefusalReason]] = set()  # (Redis key, reason) logged already
        # After an outage: until then (monotonic), instances missing from the registry are kept.
        self._keep_missing_until = 0.0

    @property
    def scan_timeout_s(self) -> float:
        # Well below --stale-after: a registry this slow is reported unreachable while the
        # instances' reports are still fresh.
        return self.pool.stale_after_s / 3

    @property
    def refresh_after_s(self) -> float:
        # Half of --stale-after: a heartbeat (an instance's --heartbeat-seconds, a second by
        # default) and a scan apart keep a report younger; a poll started within an interval of
        # it answers with the other half to spare.
        return self.pool.stale_after_s / 2

    async def run(self) -> None:
        await asyncio.gather(self._scan_forever(), self._refresh_forever())

    async def _scan_forever(self) -> None:
        while True:
            try:
                await self.poll_once()
            except (redis.RedisError, OSError, TimeoutError) as error:
                self._unreachable(error)
            await asyncio.sleep(self.interval_s)

    async def _refresh_forever(self) -> None:
        """Poll over gRPC each instance whose report has aged past :attr:`refresh_after_s`
        (module docstring); a poll that hangs delays no other instance's."""
        polling: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                for address in [address for address, task in polling.items() if task.done()]:
                    polling.pop(address).result()  # a poll's bug ends the loop, as it ends a static list's
                now = time.monotonic()
                for address, state in list(self.pool.instances.items()):
                    if address not in polling and now - state.reported_at > self.refresh_after_s:
                        polling[address] = asyncio.create_task(self._polls.poll(address))
                await asyncio.sleep(self.interval_s)
        finally:
            for task in polling.values():
                task.cancel()
            await asyncio.gather(*polling.values(), return_exceptions=True)

    async def first_poll(self) -> None:
        """The poll before the gateway serves: raises ValueError with the fix when the registry
        refuses the gateway (a wrong or missing password)."""
        try:
            await self.poll_once()
        except (redis.RedisError, OSError, TimeoutError) as error:
            raise ValueError(registry_error(error, self.url)) from None

    async def poll_once(self) -> None:
        """One scan. Raises what Redis raised, or TimeoutError for a scan slower than :attr:`scan_timeout_s`."""
        async with asyncio.timeout(self.scan_timeout_s):
            scan = await scan_registrations(self.client, self._key)
        if not self.state.reachable:
            logger.warning(
                "the registry answers again after %.1f s; following its registrations", self.state.unreachable_for_s()
            )
            self.state.unreachable_since = None
            self._keep_missing_until = time.monotonic() + self.pool.stale_after_s
        self._count_refused(scan.refused)
        seen = set()
        for registration in scan.registrations:
            role = next((r for r in ROLES if r == registration.report.role), None)
            if role is None:
                logger.warning(
                    "ignoring a registration with role %r at %r", registration.report.role, registration.grpc_address
                )
                self.state.num_refused["invalid"] += 1
                continue
            address = registration.grpc_address
            seen.add(address)
            self.pool.add(address, role)
            # Freshness by the gateway's clock: a heartbeat counts when its timestamp moves, so
            # clock skew between nodes does not matter within the records' window
            # (cluster/registry_record.py), and a replayed record within it reports nothing new.
            if registration.unix_s > self._heartbeat_unix_s.get(address, 0.0):
                self._heartbeat_unix_s[address] = registration.unix_s
                self.pool.record_report(address, registration.report, registration.serving)
        missing = set(self.pool.instances) - seen
        if missing and time.monotonic() < self._keep_missing_until:
            # The registry came back (perhaps empty, after a restart): its instances register again within
            # a heartbeat. Until then the ones it lacks stay, on their own reports (the refresh loop's).
            return
        for address in missing:
            self._heartbeat_unix_s.pop(address, None)
            self.pool.remove(address)

    def _unreachable(self, error: Exception) -> None:
        if self.state.reachable:
            self.state.unreachable_since = time.time()
            logger.warning(
                "registry scan failed (%s); keeping the %d instances known, on their own health and load reports, "
                "until it answers again",
                registry_error(error, self.url),
                len(self.pool.instances),
            )
        else:
            logger.debug("registry scan failed again: %s", registry_error(error, self.url))

    def _count_refused(self, refused: dict[str, RecordRefused]) -> None:
        self.state.refused_now = {key: record.reason for key, record in refused.items()}
        said = self._said_refused
        self._said_refused = set()  # only what this scan refused: a flood of keys must not grow it
        for key, record in refused.items():
            self.state.num_refused[record.reason] += 1
            if (key, record.reason) not in said:
                logger.warning("ignoring the registry record under %s: %s", key, record)
            self._said_refused.add((key, record.reason))

    async def close(self) -> None:
        await self.client.aclose()
