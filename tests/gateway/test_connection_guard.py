"""Connections nobody needs a key to open cannot take the gateway down (gateway/connection_guard.py):
raw sockets from one loopback address (127.0.0.2) that never send a request, or drip its headers
or its body a byte at a time, against a real gateway process in front of a colocated instance,
while another client (127.0.0.1) is served:

- past ``--max-connections-per-client`` a socket is answered 503 and closed as it comes;
- the others are closed at ``--timeout-request-headers`` / ``--timeout-request-body``, dripping
  or not (uvicorn alone keeps them for as long as they like);
- past ``--max-connections`` in all, ``/health`` and ``/ready`` still answer, the API a 503 in
  OpenAI's error shape (uvicorn's own limit answered the probes 503 too)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx
import pytest

from gateway.connection_guard import ConnectionLimits, client_address
from tests.gateway.inprocess import make_chat_checkpoint
from tests.gateway.processes import running_gateway
from tests.services.processes import Service, running

ATTACKER = "127.0.0.2"  # any 127.0.0.0/8 address reaches the gateway on 127.0.0.1
OTHER_ATTACKER = "127.0.0.3"
DRIP_EVERY_S = 0.2  # the attacker's pace: a byte per drip, well inside any deadline
CLOSED_WITHIN_S = 60.0  # the test's bound on a socket's end: generous, it fails a gateway that never closes it

Kind = Literal["idle", "drip_headers", "drip_body"]
KINDS: tuple[Kind, ...] = ("idle", "drip_headers", "drip_body")
_BODY_HEADERS = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\ncontent-type: application/json\r\n"
    b"content-length: 100000\r\n\r\n"
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_checkpoint(tmp_path_factory.mktemp("chat"), slow_loops=False)


@pytest.fixture(scope="module")
def colocated(model: Path) -> Iterator[Service]:
    with running("colocated", model) as service:
        yield service


@dataclass(slots=True)
class Ending:
    kind: Kind
    received: bytes  # what the gateway sent before it closed the connection


async def hold(port: int, source: str, kind: Kind) -> asyncio.Task[Ending]:
    """Open a connection from ``source`` (once this returns, the kernel has queued it for the
    gateway to accept) and hold it the ``kind`` way until the gateway closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))

    async def until_closed() -> Ending:
        drip = {"idle": b"", "drip_headers": b"GET /v1/models HTTP/1.1\r\nX-Drip: ", "drip_body": b"{"}[kind]
        if kind == "drip_body":
            writer.write(_BODY_HEADERS)
        received = b""
        try:
            while True:
                try:
                    # Waiting on the gateway's answer or close; the timeout is the attacker's pace only.
                    chunk = await asyncio.wait_for(reader.read(4096), DRIP_EVERY_S if drip else None)
                except TimeoutError:
                    writer.write(drip[:1])
                    drip = drip[1:] or b"a"
                    continue
                if not chunk:
                    return Ending(kind, received)
                received += chunk
        except ConnectionError:  # closed with our bytes unread: a reset
            return Ending(kind, received)
        finally:
            writer.close()

    return asyncio.ensure_future(until_closed())


async def endings(tasks: list[asyncio.Task[Ending]]) -> list[Ending]:
    async with asyncio.timeout(CLOSED_WITHIN_S):
        return await asyncio.gather(*tasks)


def test_idle_and_dripping_sockets_from_one_address_are_capped_and_closed_while_others_are_served(
    model: Path, colocated: Service
) -> None:
    """300 sockets from one address, a third each idle, dripping headers, dripping a body; the
    gateway allows 192 connections (--max-pending-requests 64), 96 from one address."""
    flags = ["--max-pending-requests", "64", "--timeout-request-headers", "2", "--timeout-request-body", "2"]
    with running_gateway(model, "--colocated", colocated.address, *flags) as gateway:

        async def scenario() -> list[Ending]:
            tasks = [await hold(gateway.port, ATTACKER, KINDS[index % 3]) for index in range(300)]
            async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as client:
                chat = await client.post(
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4},
                )
                assert chat.status_code == 200, chat.text
                assert chat.json()["choices"][0]["message"]["content"] is not None
                assert (await client.get("/health")).status_code == 200
            return await endings(tasks)

        ended = asyncio.run(scenario())
        refused = [e for e in ended if e.received.startswith(b"HTTP/1.1 503")]
        assert all(b'"code":"too_many_connections"' in e.received for e in refused)
        timed_out = [e for e in ended if not e.received]
        assert len(refused) == 300 - 96 and len(timed_out) == 96, [e.received[:20] for e in ended]
        assert {e.kind for e in timed_out} == set(KINDS)  # each closed at its deadline, dripping or not
        assert httpx.get(f"{gateway.url}/health", timeout=10).status_code == 200


def test_past_the_connection_limit_the_probes_answer_and_the_api_says_503(model: Path, colocated: Service) -> None:
    """72 connections allowed (--max-pending-requests 4), 36 from one address: 36 idle sockets
    from each of two addresses fill them, a 37th from each is refused (once it is, the gateway
    has accepted the 36 before it). A probe over one more connection is answered."""
    flags = ["--max-pending-requests", "4", "--timeout-request-headers", "600"]  # no deadline within the test
    with running_gateway(model, "--colocated", colocated.address, *flags) as gateway:

        async def scenario() -> None:
            held = []
            for source in (ATTACKER, OTHER_ATTACKER):
                held += [await hold(gateway.port, source, "idle") for _ in range(36)]
                (refused,) = await endings([await hold(gateway.port, source, "idle")])
                assert refused.received.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), refused
            async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
                assert (await client.get("/health")).status_code == 200
                ready = await client.get("/ready")
                assert ready.status_code == 200 and ready.json()["ready"]
                models = await client.get("/v1/models")
                assert models.status_code == 503 and models.headers["retry-after"] == "1"
                assert models.json()["error"]["code"] == "too_many_connections"
                for task in held:
                    task.cancel()  # the attacker lets go: its sockets close
                await asyncio.gather(*held, return_exceptions=True)
                await until(lambda: client.get("/v1/models"), 200)

        asyncio.run(scenario())


async def until(request: Callable[[], Awaitable[httpx.Response]], status: int, timeout_s: float = 30.0) -> None:
    """Until ``request`` answers ``status`` (bounded, so that a gateway that never does fails the test)."""
    async with asyncio.timeout(timeout_s):
        while (await request()).status_code != status:
            await asyncio.sleep(0.05)


def test_the_per_client_cap_counts_an_ipv6_slash_64_as_one_client() -> None:
    assert client_address(("10.1.2.3", 5000)) == "10.1.2.3"
    assert client_address(("::ffff:10.1.2.3", 5000)) == "10.1.2.3"
    assert client_address(("2001:db8:1:2:aaaa::1", 5000)) == client_address(("2001:db8:1:2:bbbb::9", 6000))
    assert client_address(("2001:db8:1:2:aaaa::1", 5000)) == "2001:db8:1:2::/64"
    assert client_address(("2001:db8:1:3::1", 5000)) != client_address(("2001:db8:1:2::1", 5000))
    assert client_address(None) == "unknown"
    with pytest.raises(ValueError, match="--timeout-request-body must be a positive number"):
        ConnectionLimits(max_connections=8, max_per_client=4, headers_timeout_s=1.0, body_timeout_s=0.0)
