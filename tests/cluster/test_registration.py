"""The Redis registry behind a password, with a real ``redis-server --requirepass``: an
instance registers and a gateway finds it with the password in the URL; without it (or
with a wrong one) both fail at start with the fix, and no message shows the password."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.registration import REGISTRY_CALL_TIMEOUT_S, RegistryHeartbeat, scan_registrations
from cluster.store_urls import PASSWORD_FILE_ENV, redact_url, with_password_file
from gateway.discovery import RedisDiscovery
from gateway.instances import InstancePool
from splitserve.v1 import disaggregation_pb2
from tests.stores import start_redis, stop

PASSWORD = "registry-password-8c1d2"


@pytest.fixture(scope="module")
def protected_url() -> Iterator[str]:
    process, url = start_redis(PASSWORD)
    try:
        yield url
    finally:
        stop(process)


def report() -> disaggregation_pb2.LoadReport:
    return disaggregation_pb2.LoadReport(instance_id="decode-0", role="decode", num_total_blocks=8, num_free_blocks=8)


async def register_and_discover(url: str) -> None:
    """An instance registers at ``url``; a gateway polling it finds the instance."""
    heartbeat = RegistryHeartbeat(url, "decode-0", "127.0.0.1:50071", report, interval_s=1.0, key=None)
    await heartbeat.register()
    pool = InstancePool(stale_after_s=5.0)
    discovery = RedisDiscovery(pool, url, interval_s=0.2)
    try:
        await discovery.first_poll()
        assert [s.address for s in pool.healthy("decode")] == ["127.0.0.1:50071"]
        assert [r.grpc_address for r in (await scan_registrations(discovery.client, None)).registrations] == [
            "127.0.0.1:50071"
        ]
    finally:
        await heartbeat.stop()
        await discovery.close()
        await pool.close()


def test_registration_with_the_password_is_found_by_the_gateway(
    protected_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        asyncio.run(register_and_discover(protected_url))
    assert PASSWORD not in caplog.text


@pytest.mark.parametrize("credentials", ["", ":wrong-password@", "someone:wrong-password@"])
def test_without_the_password_instance_and_gateway_fail_with_the_fix(protected_url: str, credentials: str) -> None:
    url = protected_url.replace(f":{PASSWORD}@", credentials)

    async def scenario() -> None:
        heartbeat = RegistryHeartbeat(url, "decode-0", "127.0.0.1:50071", report, interval_s=1.0, key=None)
        with pytest.raises(
            ValueError, match=r"refused us .*: put its password in the URL, redis://:PASSWORD@HOST:PORT"
        ) as instance_error:
            await heartbeat.register()
        await heartbeat.stop()
        pool = InstancePool(stale_after_s=5.0)
        discovery = RedisDiscovery(pool, url, interval_s=0.2)
        with pytest.raises(ValueError, match="refused us") as gateway_error:
            await discovery.first_poll()
        await discovery.close()
        await pool.close()
        for error in (instance_error, gateway_error):
            assert "wrong-password" not in str(error.value) and redact_url(url) in str(error.value)

    asyncio.run(scenario())


def test_urls_are_shown_without_their_password() -> None:
    assert redact_url("redis://:s3cret@10.0.0.5:6379/0") == "redis://:***@10.0.0.5:6379/0"
    assert (
        redact_url("rediss://splitserve:s3cret@redis:6380?ssl_ca_certs=/ca.pem")
        == "rediss://splitserve:***@redis:6380?ssl_ca_certs=/ca.pem"
    )
    assert redact_url("redis://redis:6379?password=s3cret&db=1") == "redis://redis:6379?password=***&db=1"
    assert redact_url("lm://cache:65432") == "lm://cache:65432"
    assert "s3cret" not in redact_url("redis://:s3cret@[::1")  # malformed: shown as its scheme only
    with pytest.raises(ValueError, match="--registry-url must be") as raised:
        RegistryHeartbeat("http://:s3cret@redis:6379", "p", "a:1", report, 1.0, key=None)
    assert "s3cret" not in str(raised.value)


def test_the_password_can_come_from_a_file(protected_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As compose hands it over: a secret file named by SPLITSERVE_REDIS_PASSWORD_FILE, the URL without it."""
    secret = tmp_path / "redis-password"
    secret.write_text(PASSWORD + "\n")
    monkeypatch.setenv(PASSWORD_FILE_ENV, str(secret))
    asyncio.run(register_and_discover(protected_url.replace(f":{PASSWORD}@", "")))


def test_a_password_file_fills_only_urls_without_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "redis-password"
    secret.write_text("p@ss/word\n")
    assert with_password_file("redis://redis:6379") == "redis://redis:6379"  # no file named: unchanged
    monkeypatch.setenv(PASSWORD_FILE_ENV, str(secret))
    assert with_password_file("redis://redis:6379/0") == "redis://:p%40ss%2Fword@redis:6379/0"
    assert (
        with_password_file("rediss://splitserve@redis:6380?ssl_ca_certs=/ca.pem")
        == "rediss://splitserve:p%40ss%2Fword@redis:6380?ssl_ca_certs=/ca.pem"
    )
    assert with_password_file("redis://:inline@redis:6379") == "redis://:inline@redis:6379"  # the URL's own wins
    assert with_password_file("lm://cache:65432") == "lm://cache:65432"
    secret.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        with_password_file("redis://redis:6379")
    monkeypatch.setenv(PASSWORD_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="cannot read the Redis password"):
        with_password_file("redis://redis:6379")


def test_registration_over_tls(tmp_path: Path) -> None:
    """``rediss://`` with the CA to trust; a registry whose certificate that CA did not sign is refused."""
    from tests.certificates import TestCA

    ca = TestCA(tmp_path)
    files = ca.issue("redis")
    process, url = start_redis(PASSWORD, tls=(files.cert, files.key, ca.ca_path))
    try:

        async def scenario() -> None:
            heartbeat = RegistryHeartbeat(url, "prefill-0", "127.0.0.1:50061", report, interval_s=1.0, key=None)
            await heartbeat.register()
            pool = InstancePool(stale_after_s=5.0)
            discovery = RedisDiscovery(pool, url, interval_s=0.2)
            await discovery.first_poll()
            assert list(pool.instances) == ["127.0.0.1:50061"]
            await heartbeat.stop()
            await discovery.close()
            await pool.close()
            untrusted = RegistryHeartbeat(
                url.replace(str(ca.ca_path), str(TestCA(tmp_path, "other CA").ca_path)),
                "p",
                "a:1",
                report,
                1.0,
                key=None,
            )
            with pytest.raises(ValueError, match="certificate verify failed"):
                await untrusted.register()
            await untrusted.stop()

        asyncio.run(scenario())
    finally:
        stop(process)


async def stop_against_a_registry_that_never_answers(caplog: pytest.LogCaptureFixture) -> None:
    """A heartbeat whose registry accepts its connection and sends not a byte (a registry
    stopping beside the instance, or a hostile one) stops at once, leaving its key to expire."""
    connected = asyncio.Event()
    held: list[asyncio.StreamWriter] = []

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        connected.set()
        await reader.read()  # reads the command, answers nothing, until the caller goes

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    heartbeat = RegistryHeartbeat(f"redis://127.0.0.1:{port}", "decode-0", "127.0.0.1:50071", report, 1.0, key=None)
    try:
        # The bound is the registry's own call timeout: the default client, retrying ten
        # times at that timeout, would hold the stop for a minute.
        await asyncio.wait_for(heartbeat.stop(), timeout=REGISTRY_CALL_TIMEOUT_S)
        assert connected.is_set()
        assert "could not deregister splitserve:instance:decode-0" in caplog.text
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


def test_a_stopping_instance_does_not_wait_on_a_registry_that_never_answers(caplog: pytest.LogCaptureFixture) -> None:
    asyncio.run(stop_against_a_registry_that_never_answers(caplog))
