"""The public gRPC ``Generation`` front serves TLS with ``--grpc-tls-cert`` / ``--grpc-tls-key``,
and mutual TLS with ``--grpc-tls-ca`` too (issue 42, item 7: its API key crossed in the clear).
A real gRPC front over a pool of fake instances (tests.gateway.test_dispatch_failover), on a
loopback port, with certificates from a throwaway CA (tests.certificates)."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

from cluster.tls import TLSFiles
from gateway.flags import add_grpc_front_tls_arguments, resolve_grpc_front_tls
from gateway.generation import GenerationService
from gateway.grpc_front import start_grpc_front
from gateway.metrics import GatewayMetrics
from gateway.tokenizer import ModelTokenizer
from splitserve.v1 import generation_pb2, generation_pb2_grpc
from tests.checkpoints import make_checkpoint
from tests.gateway.test_dispatch_failover import FakeDecode, FakePrefill, make_pool

API_KEY = "the-grpc-key"
REQUEST = generation_pb2.GenerateRequest(
    token_ids=generation_pb2.TokenIds(ids=[1, 2, 3]), sampling=generation_pb2.SamplingParams(max_tokens=4)
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("model"))


@asynccontextmanager
async def grpc_front(model: Path, tls: TLSFiles | None) -> AsyncIterator[str]:
    """The front's address, over a prefill and a decode fake."""
    pool = make_pool(prefill=[FakePrefill()], decode=[FakeDecode()])
    tokenizer = ModelTokenizer(model)
    service = GenerationService(pool, tokenizer, GatewayMetrics(pool), 4, 60.0, None, False)
    front = await start_grpc_front(service, "tiny", API_KEY, "127.0.0.1", 0, tls=tls)
    try:
        yield f"127.0.0.1:{front.port}"
    finally:
        await front.stop(grace=None)
        await service.dispatcher.drain()
        await pool.close()
        service.close()
        tokenizer.close()


async def generate(channel: grpc.aio.Channel) -> list[int]:
    stub = generation_pb2_grpc.GenerationStub(channel)
    call = stub.Generate(REQUEST, metadata=[("authorization", f"Bearer {API_KEY}")], timeout=30)
    return [token for response in [r async for r in call] for token in response.token_ids]


def test_the_grpc_front_serves_tls_and_mutual_tls(model: Path, tmp_path: Path) -> None:
    from tests.certificates import TestCA

    ca = TestCA(tmp_path)
    server_files, client_files = ca.issue("gateway"), ca.issue("client")
    roots = ca.ca_path.read_bytes()

    def parse(*argv: str) -> TLSFiles | None:
        parser = argparse.ArgumentParser()
        add_grpc_front_tls_arguments(parser)
        return resolve_grpc_front_tls(parser.parse_args(argv))

    server_tls = parse("--grpc-tls-cert", str(server_files.cert), "--grpc-tls-key", str(server_files.key))
    mutual_tls = parse(
        "--grpc-tls-cert",
        str(server_files.cert),
        "--grpc-tls-key",
        str(server_files.key),
        "--grpc-tls-ca",
        str(ca.ca_path),
    )
    with pytest.raises(ValueError, match="--grpc-tls-cert and --grpc-tls-key go together"):
        parse("--grpc-tls-key", str(server_files.key))
    with pytest.raises(ValueError, match="--grpc-tls-ca checks clients' certificates .* give --grpc-tls-cert"):
        parse("--grpc-tls-ca", str(ca.ca_path))
    assert parse() is None  # plaintext, as before

    async def scenario() -> None:
        async with grpc_front(model, server_tls) as address:
            async with grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(roots)) as channel:
                assert await generate(channel)  # tokens streamed back over TLS
            async with grpc.aio.insecure_channel(address) as plaintext:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await generate(plaintext)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        async with grpc_front(model, mutual_tls) as address:
            client_cert = grpc.ssl_channel_credentials(
                roots, client_files.key.read_bytes(), client_files.cert.read_bytes()
            )
            async with grpc.aio.secure_channel(address, client_cert) as channel:
                assert await generate(channel)
            async with grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(roots)) as no_certificate:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await generate(no_certificate)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(scenario())


def test_a_prompt_of_ids_longer_than_the_context_is_refused_before_it_is_read(model: Path) -> None:
    """Millions of ids in one message (issue 42, item 5) are refused on their count, naming the
    field, before the front turns them into a Python list on its event loop."""

    async def scenario() -> None:
        async with grpc_front(model, None) as address, grpc.aio.insecure_channel(address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1] * 4_000_000))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Generate(request, metadata=[("authorization", f"Bearer {API_KEY}")], timeout=30).read()
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "maximum context length" in (refused.value.details() or "")

    asyncio.run(scenario())
