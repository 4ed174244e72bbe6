"""What the gateway tells clients about its insides: nothing a client could use against the
cluster. A request that fails on the instances gets a generic error naming its request id,
on REST and gRPC alike, and the instance, its address and its error go to the log under that
id; with ``--api-key``, ``/status`` and ``/status.json`` (internal addresses, engine errors)
need the key, as a bearer token or as a browser's Basic authentication."""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import httpx
import pytest

from gateway.app import create_app
from gateway.generation import GenerationService
from gateway.grpc_front import start_grpc_front
from gateway.instances import InstancePool
from gateway.metrics import GatewayMetrics
from gateway.tokenizer import ModelTokenizer
from splitserve.v1 import generation_pb2, generation_pb2_grpc
from tests.checkpoints import make_checkpoint
from tests.gateway.processes import running_gateway
from tests.gateway.test_dispatch_failover import DETAILS, FakeDecode, FakePrefill, make_pool, rpc_error
from tests.stores import free_port

API_KEY = "the-api-key-of-these-tests"
SECRET_LOOKING = "10.9.8.7:50061 engine says"  # what an instance's own error could carry


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("model"))


@asynccontextmanager
async def gateway(model: Path, pool: InstancePool, api_key: str | None) -> AsyncIterator[tuple[httpx.AsyncClient, str]]:
    """The REST app (httpx client) and the gRPC front (its address) over ``pool``."""
    tokenizer = ModelTokenizer(model)
    service = GenerationService(pool, tokenizer, GatewayMetrics(pool), 4, 60.0, None, False)
    grpc_front = await start_grpc_front(service, "tiny", api_key, "127.0.0.1", 0)
    app = create_app(service, "tiny", api_key)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
            yield client, f"127.0.0.1:{grpc_front.port}"
    finally:
        await grpc_front.stop(grace=None)
        await service.dispatcher.drain()
        await pool.close()
        tokenizer.close()


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.PERMISSION_DENIED, 503),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    ],
)
def test_a_request_failing_on_an_instance_gets_a_generic_error_and_the_log_the_details(
    model: Path, caplog: pytest.LogCaptureFixture, code: grpc.StatusCode, status: int
) -> None:
    def failing_pool() -> InstancePool:
        failing = [FakePrefill(rpc_error(code, f"{DETAILS} {SECRET_LOOKING}")) for _ in range(2)]
        return make_pool(prefill=failing, decode=[FakeDecode()])

    def logged_under(request_id: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if request_id in r.getMessage()]

    async def scenario() -> None:
        async with gateway(model, failing_pool(), None) as (client, _):
            reply = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
        assert reply.status_code == status, reply.text
        error = reply.json()["error"]
        assert error["code"] == ("overloaded" if status == 429 else "instance_failed")
        for leak in (DETAILS, SECRET_LOOKING, "prefill-0", "prefill-1", code.name):
            assert leak not in reply.text, leak
        request_id = error["message"].split("(request ", 1)[1].split(";", 1)[0]
        assert request_id.startswith("cmpl-")
        assert any(DETAILS in line and "prefill-0" in line for line in logged_under(request_id)), caplog.text

        request = generation_pb2.GenerateRequest(text="hello", sampling=generation_pb2.SamplingParams(max_tokens=4))
        async with (
            gateway(model, failing_pool(), None) as (_, grpc_address),
            grpc.aio.insecure_channel(grpc_address) as channel,
        ):
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                async for _ in generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30):
                    pass
        details = raised.value.details() or ""
        assert not any(leak in details for leak in (DETAILS, SECRET_LOOKING, "prefill-0", "prefill-1")), details
        request_id = details.split("(request ", 1)[1].split(";", 1)[0]
        assert any(DETAILS in line and "prefill-0" in line for line in logged_under(request_id)), caplog.text

    with caplog.at_level(logging.WARNING):
        asyncio.run(scenario())


def test_the_status_page_needs_the_api_key_when_one_is_set(model: Path) -> None:
    async def scenario() -> None:
        pool = make_pool(prefill=[FakePrefill()], decode=[FakeDecode()])
        async with gateway(model, pool, API_KEY) as (client, _):
            for path in ("/status", "/status.json"):
                refused = await client.get(path)
                assert refused.status_code == 401, path
                assert refused.headers["www-authenticate"].startswith("Basic "), "a browser asks for the key"
                assert "prefill-0" not in refused.text
                for wrong in ("Bearer nope", "Basic " + base64.b64encode(b"admin:nope").decode(), "Basic %%%"):
                    assert (await client.get(path, headers={"Authorization": wrong})).status_code == 401
                bearer = await client.get(path, headers={"Authorization": f"Bearer {API_KEY}"})
                basic = await client.get(path, auth=("anyone", API_KEY))  # what a browser sends once asked
                assert bearer.status_code == basic.status_code == 200, path
            shown = (await client.get("/status.json", auth=("", API_KEY))).json()
            assert {i["address"] for i in shown["instances"]} == {"prefill-0:1", "decode-0:1"}
            # Probes and scrapes stay open.
            assert (await client.get("/health")).status_code == 200
            assert (await client.get("/metrics")).status_code == 200

        async with gateway(model, make_pool(decode=[FakeDecode()]), None) as (client, _):
            assert (await client.get("/status.json")).status_code == 200, "no key set: open, as before"

    asyncio.run(scenario())


def test_the_model_list_names_the_served_model_not_its_path(model: Path) -> None:
    """``/v1/models`` showed the folder the gateway loaded the model from as ``root``: how the
    host is laid out, to anyone with the key (issue 42, item 7). Now the served name."""
    nowhere = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    flags = ["--prefill", nowhere[0], "--decode", nowhere[1], "--served-model-name", "tiny"]
    with running_gateway(model, *flags, ready_path="/health") as served:
        listed = httpx.get(f"{served.url}/v1/models", timeout=30)
    assert listed.status_code == 200, listed.text
    (card,) = listed.json()["data"]
    assert card["id"] == card["root"] == "tiny"
    assert str(model) not in listed.text
