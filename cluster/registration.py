"""Instance discovery through Redis: each instance writes a ``Registration``
(its address, load report and serving state) under its own key with a TTL on
every heartbeat; gateways scan the keys. An instance that dies simply stops
renewing its key, which Redis expires after three missed heartbeats.

The gateway imports this module, so it must stay free of engine (torch) imports.
Values are protobuf bytes, signed with the cluster secret's registry key and checked before
they are parsed, never unpickled (``cluster/registry_record.py``).

The URL may carry credentials and ask for TLS: ``redis://:PASSWORD@HOST:PORT``, an ACL
user ``redis://USER:PASSWORD@HOST:PORT``, ``rediss://`` (TLS; redis-py's query options such
as ``ssl_ca_certs=/path/ca.pem`` apply). It is shown only as :func:`redact_url` makes it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import AuthenticationError, NoPermissionError

from cluster.registry_record import RecordRefused, decode_record, encode_record
from cluster.store_urls import redact_url, with_password_file
from splitserve.v1 import disaggregation_pb2

logger = logging.getLogger(__name__)

REGISTRY_KEY_PREFIX = "splitserve:instance:"
MISSED_HEARTBEATS_BEFORE_EXPIRY = 3


def registry_key(instance_id: str) -> str:
    return REGISTRY_KEY_PREFIX + instance_id


REGISTRY_CALL_TIMEOUT_S = 5.0
# redis-py retries a failed call ten times by default: at the timeout above, a registry that
# went away would hold a call for minutes. Two quick retries ride out a dropped connection.
REGISTRY_CALL_RETRIES = 2
# A stopping instance deregisters within this, or leaves its key to expire: its stop grace
# (a container's is 10 s) is for its streams, and the registry may be stopping beside it.
DEREGISTRATION_TIMEOUT_S = 1.0


def registry_client(url: str) -> redis.Redis:
    """A client for the registry at ``url`` (its password may come from a file:
    :func:`with_password_file`); raises ValueError for a URL that is not Redis."""
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(
            f"--registry-url must be redis://[USER:PASSWORD@]HOST:PORT or rediss://..., got {redact_url(url)!r}"
        )
    # A registry that accepts a connection and then answers nothing must not hold a heartbeat,
    # a deregistration or a scan forever.
    return redis.from_url(
        with_password_file(url),
        socket_timeout=REGISTRY_CALL_TIMEOUT_S,
        socket_connect_timeout=REGISTRY_CALL_TIMEOUT_S,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), REGISTRY_CALL_RETRIES),
    )


def registry_error(error: Exception, url: str) -> str:
    """What went wrong talking to the registry, and for a refused password, the fix."""
    if isinstance(error, AuthenticationError | NoPermissionError):
        return (
            f"the registry at {redact_url(url)} refused us ({error}): put its password in the URL, "
            "redis://:PASSWORD@HOST:PORT, or an ACL user's, redis://USER:PASSWORD@HOST:PORT, allowed "
            "+@connection +get +set +del +scan +mget on splitserve:instance:*"
        )
    return f"the registry at {redact_url(url)} failed: {type(error).__name__}: {error}"


class RegistryHeartbeat:
    """Keeps one instance's registration alive in Redis until ``stop``."""

    def __init__(
        self,
        url: str,
        instance_id: str,
        grpc_address: str,
        load_report: Callable[[], disaggregation_pb2.LoadReport],  # answers at once: called from the event loop
        interval_s: float,
        key: bytes | None,  # the cluster secret's registry key; None: records go unsigned
    ) -> None:
        self._client = registry_client(url)
        self._url = url
        self._key = registry_key(instance_id)
        self._grpc_address = grpc_address
        self._load_report = load_report
        self._interval_s = interval_s
        self._signing_key = key
        self._serving = True
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def register(self) -> None:
        """The first heartbeat, before the instance says it is up. Raises ValueError with the
        fix when the registry refuses us (a wrong or missing password)."""
        if self._signing_key is None:
            logger.warning(
                "registering %s unsigned (no cluster secret): only gateways without a secret will believe it; "
                "anyone who can write the registry can register instances too",
                self._key,
            )
        try:
            await self.beat()
        except (redis.RedisError, OSError) as error:
            raise ValueError(registry_error(error, self._url)) from None

    def set_serving(self, serving: bool) -> None:
        """From the next heartbeat on, tell gateways whether to route here (false: the engine died)."""
        self._serving = serving

    async def _run(self) -> None:
        while True:
            try:
                await self.beat()
            except (redis.RedisError, OSError) as error:
                # Keep serving: a registry outage only hides this instance from new gateways.
                logger.warning("registry heartbeat of %s failed: %s", self._key, registry_error(error, self._url))
            await asyncio.sleep(self._interval_s)

    async def beat(self) -> None:
        registration = disaggregation_pb2.Registration(
            grpc_address=self._grpc_address,
            report=self._load_report(),
            unix_s=time.time(),
            serving=self._serving,
        )
        ttl_ms = int(self._interval_s * MISSED_HEARTBEATS_BEFORE_EXPIRY * 1000)
        await self._client.set(self._key, encode_record(registration, self._key, self._signing_key), px=ttl_ms)

    async def stop(self) -> None:
        """Deregister: gateways stop sending new requests here at their next scan."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            async with asyncio.timeout(DEREGISTRATION_TIMEOUT_S):
                await self._client.delete(self._key)
        except (redis.RedisError, OSError, TimeoutError) as error:
            logger.warning(
                "could not deregister %s (its key expires by itself): %s", self._key, registry_error(error, self._url)
            )
        await self._client.aclose()


@dataclass(slots=True)
class RegistryScan:
    """One scan of the registry: the records to believe, and those refused, by Redis key."""

    registrations: list[disaggregation_pb2.Registration] = field(default_factory=list)
    refused: dict[str, RecordRefused] = field(default_factory=dict)


async def scan_registrations(client: redis.Redis, key: bytes | None) -> RegistryScan:
    """Every live registration, checked (``cluster/registry_record.py``) with ``key``, the
    cluster secret's registry key (None: no signature is checked)."""
    keys = [key async for key in client.scan_iter(match=REGISTRY_KEY_PREFIX + "*", count=500)]
    scan = RegistryScan()
    if not keys:
        return scan
    now = time.time()
    for redis_key, value in zip(keys, await client.mget(keys), strict=True):
        if value is None:
            continue  # expired between SCAN and MGET
        name = redis_key.decode(errors="replace") if isinstance(redis_key, bytes) else str(redis_key)
        try:
            # The client is made without decode_responses: values come back as bytes.
            scan.registrations.append(
                decode_record(value if isinstance(value, bytes) else value.encode(), name, key, now)
            )
        except RecordRefused as refused:
            scan.refused[name] = refused
    return scan
