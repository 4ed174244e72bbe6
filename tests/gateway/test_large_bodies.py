"""Large bodies do not hold the gateway's event loop, and one client cannot take every pending
slot (issue 42, item 5): a real gateway process in front of a colocated instance, raw sockets
from one loopback address (127.0.0.2, the attacker) and httpx from another (127.0.0.1).

- Bodies over 8 KiB are checked in a worker process (``gateway/body_check.py``): while the
  attacker's 8 MiB bodies (240,000 chat messages; 4,000,000 prompt token ids) are in the
  gateway, another client's ``/health`` is answered before any of them, and its chat completion
  succeeds; each of them gets a 400 naming the limit. Before, the loop parsed each body itself
  (about a second), and answered ``/health`` only after the first.
- One client address holds at most ``--max-pending-requests-per-client`` slots (here 6 of 8):
  its 7th request gets 429 ``client_queue_full`` while another client's is served.
- A large body within the limits is served as before; one over them gets a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.flags import DEFAULT_MAX_JSON_VALUES
from gateway.protocol import MAX_MESSAGES
from tests.gateway.inprocess import make_chat_checkpoint
from tests.gateway.processes import HTTPProcess, running_gateway
from tests.services.client import assert_all_free
from tests.services.processes import Service, running

ATTACKER = "127.0.0.2"  # any 127.0.0.0/8 address reaches the gateway on 127.0.0.1
MAX_PENDING, MAX_PENDING_PER_CLIENT = 8, 6  # the per-client default: three quarters
HANG_GUARD_S = 120.0  # the test's bound on a wait that should end; it fails a gateway that hangs
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_checkpoint(tmp_path_factory.mktemp("chat"), slow_loops=False)


@pytest.fixture(scope="module")
def colocated(model: Path) -> Iterator[Service]:
    with running("colocated", model) as service:
        yield service


@pytest.fixture(scope="module")
def gateway(model: Path, colocated: Service) -> Iterator[HTTPProcess]:
    flags = ["--max-pending-requests", str(MAX_PENDING), "--timeout-request-body", "600"]
    with running_gateway(model, "--colocated", colocated.address, *flags) as gateway:
        yield gateway
    assert_all_free(colocated)


def request_bytes(path: str, body: bytes | None, content_length: int | None = None) -> bytes:
    """A POST's head (and body): ``body`` None sends the head alone, announcing ``content_length``."""
    length = len(body) if body is not None else content_length
    head = (
        f"POST {path} HTTP/1.1\r\nHost: gateway\r\ncontent-type: application/json\r\ncontent-length: {length}\r\n"
        "connection: close\r\n\r\n"
    ).encode()
    return head + (body or b"")


async def send_from_attacker(port: int, request: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(ATTACKER, 0))
    writer.write(request)
    await writer.drain()  # in the kernel's buffers, or read by the gateway already
    return reader, writer


async def answer(reader: asyncio.StreamReader, answered: asyncio.Event | None = None) -> tuple[int, bytes]:
    """The status and the body of the response to a ``connection: close`` request."""
    status_line = await reader.readline()
    if answered is not None:
        answered.set()
    rest = await reader.read()
    return int(status_line.split(b" ", 2)[1]), rest.partition(b"\r\n\r\n")[2]


def pending_requests(client: httpx.Client) -> float:
    metrics = client.get("/metrics").text
    return float(re.search(r"^splitserve_num_pending_requests (\S+)$", metrics, re.M).group(1))  # type: ignore[union-attr]


def test_large_bodies_are_checked_off_the_loop_while_another_client_is_served(gateway: HTTPProcess) -> None:
    many_messages = json.dumps({"messages": [{"role": "user", "content": "x"}] * 240_000}).encode()
    many_ids = json.dumps({"prompt": [1] * 4_000_000}, separators=(",", ":")).encode()
    assert len(many_messages) < 8 << 20 and len(many_ids) < 8 << 20  # under --max-request-body-bytes: parsed

    async def scenario() -> None:
        attacker_answered = asyncio.Event()
        sent = [
            await send_from_attacker(gateway.port, request_bytes(path, body))
            for path, body in [("/v1/chat/completions", many_messages), ("/v1/completions", many_ids)] * 3
        ]
        answers = [asyncio.ensure_future(answer(reader, attacker_answered)) for reader, _ in sent]
        async with httpx.AsyncClient(base_url=gateway.url, timeout=HANG_GUARD_S) as client:
            health = await client.get("/health")
            # The loop answered while it had the attacker's bodies: not one of them is answered yet.
            assert health.status_code == 200 and not attacker_answered.is_set()
            chat = await client.post("/v1/chat/completions", json=CHAT)
            assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] is not None, chat.text
        async with asyncio.timeout(HANG_GUARD_S):
            refused = await asyncio.gather(*answers)
        for _, writer in sent:
            writer.close()
        for status, body in refused:
            error = json.loads(body)["error"]
            assert status == 400 and error["code"] == "request_too_complex", body[:300]
            assert str(DEFAULT_MAX_JSON_VALUES) in error["message"]

    asyncio.run(scenario())


def test_one_client_holds_at_most_its_share_of_the_pending_slots(gateway: HTTPProcess) -> None:
    async def scenario() -> None:
        # Each holder announces a body it never sends: it holds a slot from its headers on.
        head_only = request_bytes("/v1/chat/completions", None, content_length=100)
        holders = [await send_from_attacker(gateway.port, head_only) for _ in range(MAX_PENDING_PER_CLIENT)]
        with httpx.Client(base_url=gateway.url, timeout=HANG_GUARD_S) as client:
            async with asyncio.timeout(HANG_GUARD_S):
                while pending_requests(client) < MAX_PENDING_PER_CLIENT:
                    await asyncio.sleep(0.05)
            reader, writer = await send_from_attacker(gateway.port, request_bytes("/v1/chat/completions", b"{}"))
            status, body = await answer(reader)
            writer.close()
            assert status == 429 and json.loads(body)["error"]["code"] == "client_queue_full", body
            # Two slots are still free for everyone else.
            chat = client.post("/v1/chat/completions", json=CHAT)
            assert chat.status_code == 200, chat.text
            for _, holder in holders:
                holder.close()
            async with asyncio.timeout(HANG_GUARD_S):
                while pending_requests(client) > 0:
                    await asyncio.sleep(0.05)

    asyncio.run(scenario())


def test_a_large_body_within_the_limits_is_served_and_one_beyond_them_refused(gateway: HTTPProcess) -> None:
    with httpx.Client(base_url=gateway.url, timeout=HANG_GUARD_S) as client:
        # Over 8 KiB (its "user" field: OpenAI's end-user id, which this server logs no more than it reads).
        large = {"prompt": [1, 2, 3, 4], "max_tokens": 2, "temperature": 0, "user": "x" * (20 << 10)}
        served = client.post("/v1/completions", json=large)
        assert served.status_code == 200 and served.json()["usage"]["prompt_tokens"] == 4, served.text

        conversation = {"messages": [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)}
        refused = client.post("/v1/chat/completions", json=conversation)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages", refused.text
        assert str(MAX_MESSAGES) in refused.json()["error"]["message"]

        # Wrong in every element: pydantic's errors for each union member stay in the worker process.
        nulls = client.post("/v1/completions", json={"prompt": [None] * 20_000})
        assert nulls.status_code == 400 and nulls.json()["error"]["param"] == "prompt", nulls.text
