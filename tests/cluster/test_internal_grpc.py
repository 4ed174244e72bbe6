"""The internal plane's gRPC on real servers in the test's event loop: calls without the
cluster secret's token get UNAUTHENTICATED (unary and streaming alike, the servicer never
runs), health checks stay open, and TLS / mutual TLS refuse peers without the right
certificates."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cluster.auth import METADATA_KEY, ClusterSecret
from cluster.internal_grpc import InternalPlane, add_internal_plane_arguments
from cluster.tls import TLSFiles
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc

SECRET = "the-cluster-secret-of-these-tests"


class EchoDecode(disaggregation_pb2_grpc.DecodeServicer):
    """Counts the calls that reach it."""

    def __init__(self) -> None:
        self.num_calls = 0

    async def Decode(self, request, context):  # noqa: N802
        self.num_calls += 1
        yield disaggregation_pb2.DecodeResponse(request_id=request.request_id, token_ids=[1, 2])

    async def Abort(self, request, context):  # noqa: N802
        self.num_calls += 1
        return disaggregation_pb2.AbortResponse(found=True)


async def with_server(plane: InternalPlane, test: Callable[[str, EchoDecode], Awaitable[None]]) -> None:
    server = plane.server()
    servicer = EchoDecode()
    disaggregation_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = plane.add_port(server, "127.0.0.1:0")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    try:
        await test(f"127.0.0.1:{port}", servicer)
    finally:
        await server.stop(grace=None)


async def decode_and_abort(channel: grpc.aio.Channel) -> tuple[list[int], bool]:
    stub = disaggregation_pb2_grpc.DecodeStub(channel)
    tokens = [
        t
        async for response in stub.Decode(disaggregation_pb2.DecodeRequest(request_id="r"), timeout=5)
        for t in response.token_ids
    ]
    found = (await stub.Abort(disaggregation_pb2.RequestRef(request_id="r"), timeout=5)).found
    return tokens, found


async def health_status(channel: grpc.aio.Channel) -> int:
    return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)).status


def test_secret_must_be_long_enough_and_is_never_shown() -> None:
    with pytest.raises(ValueError, match="at least 16 random"):
        ClusterSecret.from_text("short")
    secret = ClusterSecret.from_text(SECRET)
    assert SECRET not in repr(secret) and secret.call_token not in repr(secret)
    # Neither derived key is the secret, and they differ: the token on the wire does not sign handles.
    assert secret.call_token.encode() != secret.handle_key and SECRET.encode() not in (
        secret.call_token.encode(),
        secret.handle_key,
    )
    assert secret.accepts(secret.call_token) and not secret.accepts(SECRET) and not secret.accepts(None)


def test_calls_without_the_secret_are_unauthenticated_and_never_reach_the_servicer() -> None:
    plane = InternalPlane(secret=ClusterSecret.from_text(SECRET))

    async def test(address: str, servicer: EchoDecode) -> None:
        async with plane.channel(address) as member:
            assert await decode_and_abort(member) == ([1, 2], True)
        assert servicer.num_calls == 2
        stranger_token = ClusterSecret.from_text("not-the-cluster-secret-at-all").call_token
        for metadata in ((), ((METADATA_KEY, stranger_token),), ((METADATA_KEY, SECRET),)):
            async with grpc.aio.insecure_channel(address) as outsider:
                stub = disaggregation_pb2_grpc.DecodeStub(outsider)
                with pytest.raises(grpc.aio.AioRpcError) as unary:
                    await stub.Abort(disaggregation_pb2.RequestRef(request_id="r"), timeout=5, metadata=metadata)
                assert unary.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "needs the cluster secret" in unary.value.details()
                with pytest.raises(grpc.aio.AioRpcError) as streaming:
                    async for _ in stub.Decode(
                        disaggregation_pb2.DecodeRequest(request_id="r"), timeout=5, metadata=metadata
                    ):
                        pass
                assert streaming.value.code() == grpc.StatusCode.UNAUTHENTICATED
                # Health checks stay open for orchestrators.
                assert await health_status(outsider) == health_pb2.HealthCheckResponse.SERVING
        assert servicer.num_calls == 2, "no refused call reached the servicer"

    asyncio.run(with_server(plane, test))


def test_without_a_secret_the_plane_is_open() -> None:
    async def test(address: str, servicer: EchoDecode) -> None:
        async with grpc.aio.insecure_channel(address) as anyone:
            assert await decode_and_abort(anyone) == ([1, 2], True)

    asyncio.run(with_server(InternalPlane(), test))


def test_flags_and_environment_configure_the_plane(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def parse(*argv: str) -> InternalPlane:
        parser = argparse.ArgumentParser()
        add_internal_plane_arguments(parser)
        return InternalPlane.from_args(parser.parse_args(argv))

    assert parse() == InternalPlane()
    secret_file = tmp_path / "cluster_secret"
    secret_file.write_text(SECRET + "\n")  # as `echo` writes it
    from_file = parse("--cluster-secret-file", str(secret_file)).secret
    assert from_file is not None and from_file.call_token == ClusterSecret.from_text(SECRET).call_token
    monkeypatch.setenv("SPLITSERVE_CLUSTER_SECRET", SECRET)
    assert parse().secret == from_file
    with pytest.raises(ValueError, match="either --cluster-secret or --cluster-secret-file"):
        parse("--cluster-secret-file", str(secret_file))
    monkeypatch.delenv("SPLITSERVE_CLUSTER_SECRET")
    with pytest.raises(ValueError, match="cannot read the cluster secret"):
        parse("--cluster-secret-file", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        parse("--tls-cert", str(secret_file))
    with pytest.raises(ValueError, match="needs its own certificate"):
        parse("--tls-ca", str(secret_file)).tls.server_credentials()


def test_mutual_tls_refuses_peers_without_a_certificate_from_the_cluster_ca(tmp_path: Path) -> None:
    from tests.certificates import TestCA

    ca = TestCA(tmp_path)
    server_files, member_files = ca.issue("instance"), ca.issue("gateway")
    rogue_ca = TestCA(tmp_path, "rogue CA")
    rogue_files = rogue_ca.issue("rogue")
    secret = ClusterSecret.from_text(SECRET)
    server_plane = InternalPlane(secret, TLSFiles.load(str(server_files.cert), str(server_files.key), str(ca.ca_path)))

    async def test(address: str, servicer: EchoDecode) -> None:
        member = InternalPlane(secret, TLSFiles.load(str(member_files.cert), str(member_files.key), str(ca.ca_path)))
        async with member.channel(address) as channel:
            assert await decode_and_abort(channel) == ([1, 2], True)
        refused = {
            "plaintext": InternalPlane(secret),
            "no client certificate": InternalPlane(secret, TLSFiles.load(None, None, str(ca.ca_path))),
            "a certificate from another CA": InternalPlane(
                secret, TLSFiles.load(str(rogue_files.cert), str(rogue_files.key), str(ca.ca_path))
            ),
            "a server it does not trust": InternalPlane(
                secret, TLSFiles.load(str(member_files.cert), str(member_files.key), str(rogue_ca.ca_path))
            ),
        }
        for what, plane in refused.items():
            async with plane.channel(address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await health_status(channel)
                assert raised.value.code() == grpc.StatusCode.UNAVAILABLE, what
        assert servicer.num_calls == 2

    asyncio.run(with_server(server_plane, test))
