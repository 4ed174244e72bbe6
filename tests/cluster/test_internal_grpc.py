"""The internal plane's gRPC on real servers in the test's event loop: calls without a
credential made with the cluster secret get UNAUTHENTICATED (unary and streaming alike, the
servicer never runs), a credential is good once, for its method, at the instance it was made
for, with the request it was made over, strictly within the clock window, also after the
clock steps back (one sniffed off a member's call is worth nothing, another instance refuses
it, a request altered in flight is refused), health checks stay open, a secret given
but empty or missing where it is required stops the process at start, and TLS / mutual TLS
refuse peers without the right certificates."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cluster.auth import (
    CALL_WINDOW_S,
    METADATA_KEY,
    ClusterCallCheck,
    ClusterSecret,
    cluster_call_interceptors,
)
from cluster.internal_grpc import InternalPlane, add_internal_plane_arguments, is_loopback
from cluster.tls import TLSFiles
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc

SECRET = "the-cluster-secret-of-these-tests"


ABORT = "/splitserve.v1.Decode/Abort"
TARGET = "10.0.0.7:50061"  # the instance the unit tests' credentials are made for
BODY = disaggregation_pb2.RequestRef(request_id="r").SerializeToString()


def make_check(clock: Callable[[], float] | None = None, max_remembered: int = 1 << 20) -> ClusterCallCheck:
    check = ClusterCallCheck(
        ClusterSecret.from_text(SECRET), clock=clock or (lambda: 0.0), max_remembered=max_remembered
    )
    check.answer_to(TARGET)
    return check


def credential(unix_s: float, method: str = ABORT, target: str = TARGET, body: bytes = BODY) -> str:
    return ClusterSecret.from_text(SECRET).call_credential(method, target, body, unix_s=unix_s)


class EchoDecode(disaggregation_pb2_grpc.DecodeServicer):
    """Counts the calls that reach it, and keeps the credential each came with (what someone
    reading the wire would see)."""

    def __init__(self) -> None:
        self.num_calls = 0
        self.credentials: list[str] = []

    def _served(self, context: grpc.aio.ServicerContext) -> None:
        self.num_calls += 1
        self.credentials += [value for key, value in context.invocation_metadata() or () if key == METADATA_KEY]

    async def Decode(self, request, context):  # noqa: N802
        self._served(context)
        yield disaggregation_pb2.DecodeResponse(request_id=request.request_id, token_ids=[1, 2])

    async def Abort(self, request, context):  # noqa: N802
        self._served(context)
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
    keys = (secret.call_key, secret.handle_key, secret.registry_key)
    assert SECRET not in repr(secret) and not any(key.hex() in repr(secret) for key in keys)
    # No derived key is the secret, and each differs: a key used for one purpose serves no other.
    assert len(set(keys)) == 3 and SECRET.encode() not in keys
    # What goes on the wire is a MAC, never a key.
    made = secret.call_credential(ABORT, TARGET, BODY)
    assert not any(key.hex() in made for key in keys) and SECRET not in made


def test_a_credential_is_good_once_for_its_method_within_the_window() -> None:
    secret = ClusterSecret.from_text(SECRET)
    check = make_check()
    now = 1_700_000_000.0
    accepted = credential(now)
    assert check.check(ABORT, accepted, BODY, now) is None
    assert "used before" in (check.check(ABORT, accepted, BODY, now + 1) or "")
    # Made for Abort: worth nothing for Decode, however fresh.
    assert "for another method" in (check.check("/splitserve.v1.Decode/Decode", credential(now), BODY, now) or "")
    # Dated outside the window either way: refused, and the clock is named.
    for skew_s in (-CALL_WINDOW_S - 1, CALL_WINDOW_S + 1):
        problem = check.check(ABORT, credential(now + skew_s), BODY, now)
        assert problem is not None and "clock" in problem
    # Just inside the window's edges, accepted once.
    for skew_s in (-CALL_WINDOW_S + 1, CALL_WINDOW_S - 1):
        assert check.check(ABORT, credential(now + skew_s), BODY, now) is None
    # A nonce is forgotten only once its credential is out of the window anyway: memory stays
    # bounded by the calls of one window.
    assert check.num_remembered == 3
    later = now + 2 * CALL_WINDOW_S + 1
    assert "clock" in (check.check(ABORT, accepted, BODY, later) or "")
    assert check.check(ABORT, credential(later), BODY, later) is None
    assert check.num_remembered == 1
    other = ClusterSecret.from_text("not-the-cluster-secret-at-all")
    for presented in (None, "", "v2.x.y.z", "v2.1.n.m", other.call_credential(ABORT, TARGET, BODY, now), SECRET):
        assert check.check(ABORT, presented, BODY, now) is not None, presented
    assert secret.call_credential(ABORT, TARGET, BODY).startswith("v2.")


def test_a_replay_at_exactly_the_windows_end_is_refused() -> None:
    """The window is open at both ends. On today's main a credential dated exactly one window
    ahead was accepted, its nonce forgotten two windows after it arrived, and then, at exactly
    its timestamp's window's end, accepted again."""
    check = make_check()
    now = 1_700_000_000.0
    edge = credential(now + CALL_WINDOW_S)
    assert "clock" in (check.check(ABORT, edge, BODY, now) or "")
    assert check.check(ABORT, edge, BODY, now + 2 * CALL_WINDOW_S) is not None
    # One accepted inside the window is refused at exactly its window's end.
    accepted = credential(now)
    assert check.check(ABORT, accepted, BODY, now) is None
    assert "clock" in (check.check(ABORT, accepted, BODY, now + CALL_WINDOW_S) or "")
    assert "clock" in (check.check(ABORT, credential(now - CALL_WINDOW_S), BODY, now) or "")


def test_after_the_clock_steps_back_a_credential_seen_before_is_refused() -> None:
    """The clock (injected) runs on past a credential's window, so its nonce is forgotten, then
    steps back to where the credential is dated inside the window again: it is still refused,
    because it is dated at or before the horizon of forgotten credentials. Fresh calls at the
    stepped-back time are accepted (the step was shorter than the window)."""
    clock = [1_700_000_000.0]
    check = make_check(clock=lambda: clock[0])
    sniffed = credential(clock[0])
    assert check.check(ABORT, sniffed, BODY) is None
    clock[0] += 2 * CALL_WINDOW_S  # any call now forgets the sniffed one's nonce
    assert check.check(ABORT, credential(clock[0]), BODY) is None
    assert check.num_remembered == 1
    clock[0] -= 2 * CALL_WINDOW_S - 1  # NTP steps the clock back: the sniffed one is in the window again
    problem = check.check(ABORT, sniffed, BODY)
    assert problem is not None and "stepped back" in problem
    assert check.check(ABORT, credential(clock[0] + CALL_WINDOW_S - 2), BODY) is None


def test_the_nonce_cache_is_bounded_and_what_it_drops_is_refused() -> None:
    check = make_check(max_remembered=4)
    now = 1_700_000_000.0
    credentials = [credential(now + i) for i in range(6)]
    for presented in credentials:
        assert check.check(ABORT, presented, BODY, now) is None
    assert check.num_remembered == 4
    # The two oldest were dropped to make room: replayed, they are refused all the same.
    assert all(check.check(ABORT, presented, BODY, now) is not None for presented in credentials)


def test_a_credential_binds_the_instance_and_the_request_and_names_its_version() -> None:
    check = make_check()
    now = 1_700_000_000.0
    other_target = credential(now, target="10.0.0.8:50061")
    assert "made for 10.0.0.8:50061, but this instance answers to 10.0.0.7:50061" in (
        check.check(ABORT, other_target, BODY, now) or ""
    )
    assert "made for another request" in (check.check(ABORT, credential(now), b"\n\x05other", now) or "")
    # The channel target's resolver scheme and the host's case do not matter.
    assert check.check(ABORT, credential(now, target="dns:///10.0.0.7:50061"), BODY, now) is None
    # A caller on the credential format before this one is told why, not just refused.
    v1 = "v1.1700000000000.00112233445566778899aabbccddeeff." + "0" * 64
    assert "format v1, and this instance takes v2" in (check.check(ABORT, v1, BODY, now) or "")


def test_calls_without_the_secret_are_unauthenticated_and_never_reach_the_servicer() -> None:
    plane = InternalPlane(secret=ClusterSecret.from_text(SECRET))

    async def test(address: str, servicer: EchoDecode) -> None:
        async with plane.channel(address) as member:
            assert await decode_and_abort(member) == ([1, 2], True)
        assert servicer.num_calls == 2
        stranger = ClusterSecret.from_text("not-the-cluster-secret-at-all").call_credential(ABORT, address, BODY)
        for metadata in ((), ((METADATA_KEY, stranger),), ((METADATA_KEY, SECRET),)):
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


def test_a_credential_read_off_a_members_call_is_refused_when_replayed() -> None:
    """What someone reading plaintext traffic gets: each credential a member sent. Replayed, for
    the same method or another, it is refused, and the servicer never runs again."""
    plane = InternalPlane(secret=ClusterSecret.from_text(SECRET))

    async def test(address: str, servicer: EchoDecode) -> None:
        async with plane.channel(address) as member:
            assert await decode_and_abort(member) == ([1, 2], True)
            assert await decode_and_abort(member) == ([1, 2], True)  # each call its own credential
        assert servicer.num_calls == 4 and len(set(servicer.credentials)) == 4
        sniffed = servicer.credentials[1]  # the first Abort's
        async with grpc.aio.insecure_channel(address) as eavesdropper:
            stub = disaggregation_pb2_grpc.DecodeStub(eavesdropper)
            for request_id, problem in (("r", "used before (a replay)"), ("other", "made for another request")):
                with pytest.raises(grpc.aio.AioRpcError) as replayed:
                    await stub.Abort(
                        disaggregation_pb2.RequestRef(request_id=request_id),
                        timeout=5,
                        metadata=((METADATA_KEY, sniffed),),
                    )
                assert replayed.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert problem in replayed.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as other_method:
                async for _ in stub.Decode(
                    disaggregation_pb2.DecodeRequest(request_id="r"), timeout=5, metadata=((METADATA_KEY, sniffed),)
                ):
                    pass
            assert other_method.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert servicer.num_calls == 4, "no replayed call reached the servicer"

    asyncio.run(with_server(plane, test))


def test_a_credential_read_off_a_call_to_one_instance_is_refused_by_another() -> None:
    """Two instances of one cluster: what a member sent to A, replayed to B for the same method
    and the same request, is refused by B before its servicer runs (on today's main B took it:
    its nonce was new there)."""
    plane_a = InternalPlane(secret=ClusterSecret.from_text(SECRET))
    plane_b = InternalPlane(secret=ClusterSecret.from_text(SECRET))

    async def test_a(address_a: str, servicer_a: EchoDecode) -> None:
        async def test_b(address_b: str, servicer_b: EchoDecode) -> None:
            async with plane_a.channel(address_a) as member:
                assert await decode_and_abort(member) == ([1, 2], True)
            sniffed_decode, sniffed_abort = servicer_a.credentials
            async with grpc.aio.insecure_channel(address_b) as eavesdropper:
                stub = disaggregation_pb2_grpc.DecodeStub(eavesdropper)
                with pytest.raises(grpc.aio.AioRpcError) as replayed:
                    await stub.Abort(
                        disaggregation_pb2.RequestRef(request_id="r"),
                        timeout=5,
                        metadata=((METADATA_KEY, sniffed_abort),),
                    )
                assert replayed.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert f"made for {address_a}, but this instance answers to {address_b}" in replayed.value.details()
                with pytest.raises(grpc.aio.AioRpcError) as streaming:
                    async for _ in stub.Decode(
                        disaggregation_pb2.DecodeRequest(request_id="r"),
                        timeout=5,
                        metadata=((METADATA_KEY, sniffed_decode),),
                    ):
                        pass
                assert streaming.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert servicer_b.num_calls == 0, "no replayed call reached B's servicer"
            async with plane_b.channel(address_b) as member:
                assert await decode_and_abort(member) == ([1, 2], True)

        await with_server(plane_b, test_b)

    asyncio.run(with_server(plane_a, test_a))


def someone_elses(request: Any) -> Any:
    return type(request)(request_id="someone-elses")


class AlterUnary(grpc.aio.UnaryUnaryClientInterceptor):
    """Someone changing traffic in flight: after the member's credential is made, the request is
    swapped for another one (another request id)."""

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(client_call_details, someone_elses(request))


class AlterStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(client_call_details, someone_elses(request))


def test_a_request_altered_in_flight_is_refused_before_it_is_used() -> None:
    """The credential covers the request's bytes: a member's Abort or Decode whose request was
    changed on the way (same instance, same method, unused credential) is refused before the
    servicer sees it; on today's main the servicer aborted someone else's request."""
    secret = ClusterSecret.from_text(SECRET)
    plane = InternalPlane(secret=secret)

    async def test(address: str, servicer: EchoDecode) -> None:
        interceptors = [*cluster_call_interceptors(secret, address), AlterUnary(), AlterStream()]
        async with grpc.aio.insecure_channel(address, interceptors=interceptors) as tampered:
            stub = disaggregation_pb2_grpc.DecodeStub(tampered)
            with pytest.raises(grpc.aio.AioRpcError) as unary:
                await stub.Abort(disaggregation_pb2.RequestRef(request_id="r"), timeout=5)
            assert unary.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "made for another request (altered in flight" in unary.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as streaming:
                async for _ in stub.Decode(disaggregation_pb2.DecodeRequest(request_id="r"), timeout=5):
                    pass
            assert streaming.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert servicer.num_calls == 0, "no altered request reached the servicer"
        async with plane.channel(address) as member:
            assert await decode_and_abort(member) == ([1, 2], True)

    asyncio.run(with_server(plane, test))


def test_a_strangers_call_is_refused_before_its_request_is_hashed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The credential's header (method, instance, time, nonce) has a MAC of its own, checked when
    the headers arrive: a stranger's call, however large its request, costs no hash of it."""
    import cluster.auth

    plane = InternalPlane(secret=ClusterSecret.from_text(SECRET))
    stranger = ClusterSecret.from_text("not-the-cluster-secret-at-all")
    large = disaggregation_pb2.RequestRef(request_id="x" * (1 << 20))
    num_hashed = [0]
    digest = cluster.auth.request_digest

    def counted(request_bytes: bytes) -> bytes:
        num_hashed[0] += 1
        return digest(request_bytes)

    async def test(address: str, servicer: EchoDecode) -> None:
        forged = stranger.call_credential(ABORT, address, large.SerializeToString())
        monkeypatch.setattr(cluster.auth, "request_digest", counted)
        async with grpc.aio.insecure_channel(address) as outsider:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await disaggregation_pb2_grpc.DecodeStub(outsider).Abort(
                    large, timeout=5, metadata=((METADATA_KEY, forged),)
                )
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert num_hashed[0] == 0 and servicer.num_calls == 0
        async with plane.channel(address) as member:
            assert await decode_and_abort(member) == ([1, 2], True)
        assert num_hashed[0] == 4, "a member's two calls: hashed by the client, then by the server"

    asyncio.run(with_server(plane, test))


def test_without_a_secret_the_plane_is_open() -> None:
    async def test(address: str, servicer: EchoDecode) -> None:
        async with grpc.aio.insecure_channel(address) as anyone:
            assert await decode_and_abort(anyone) == ([1, 2], True)

    asyncio.run(with_server(InternalPlane(), test))


def test_flags_and_environment_configure_the_plane(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def parse(*argv: str, host: str = "127.0.0.1") -> InternalPlane:
        parser = argparse.ArgumentParser()
        add_internal_plane_arguments(parser)
        return InternalPlane.from_args(parser.parse_args(argv), host)

    assert parse() == InternalPlane()
    secret_file = tmp_path / "cluster_secret"
    secret_file.write_text(SECRET + "\n")  # as `echo` writes it
    from_file = parse("--cluster-secret-file", str(secret_file)).secret
    assert from_file is not None and from_file == ClusterSecret.from_text(SECRET)
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


def test_a_secret_given_empty_or_missing_where_required_stops_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An empty Kubernetes Secret key, a ``touch``ed file or an empty variable used to leave the
    plane open with only a log line; now each is an error naming the fix, and so is a process
    without a secret that listens beyond loopback (unless told it is fine) or is told to require one."""
    monkeypatch.delenv("SPLITSERVE_CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("SPLITSERVE_CLUSTER_SECRET_FILE", raising=False)
    monkeypatch.delenv("SPLITSERVE_REQUIRE_CLUSTER_SECRET", raising=False)

    def parse(*argv: str, host: str = "127.0.0.1") -> InternalPlane:
        parser = argparse.ArgumentParser()
        add_internal_plane_arguments(parser)
        return InternalPlane.from_args(parser.parse_args(argv), host)

    empty = tmp_path / "empty"
    empty.touch()
    blank = tmp_path / "blank"
    blank.write_text(" \n")
    for path in (empty, blank):
        with pytest.raises(ValueError, match=f"--cluster-secret-file {path} is empty: write the secret into it"):
            parse("--cluster-secret-file", str(path))
    with pytest.raises(ValueError, match="given but empty"):
        parse("--cluster-secret", "")
    monkeypatch.setenv("SPLITSERVE_CLUSTER_SECRET", "")
    with pytest.raises(ValueError, match="given but empty .* or unset the variable"):
        parse()
    monkeypatch.delenv("SPLITSERVE_CLUSTER_SECRET")
    assert parse().secret is None  # not given at all: loopback development, as before

    with pytest.raises(ValueError, match="--require-cluster-secret is set but no cluster secret"):
        parse("--require-cluster-secret")
    monkeypatch.setenv("SPLITSERVE_REQUIRE_CLUSTER_SECRET", "1")
    with pytest.raises(ValueError, match="--require-cluster-secret is set"):
        parse()
    assert parse("--cluster-secret", SECRET).secret is not None
    monkeypatch.delenv("SPLITSERVE_REQUIRE_CLUSTER_SECRET")

    for host in ("0.0.0.0", "10.1.2.3", "::", "splitserve-prefill.invalid"):
        with pytest.raises(ValueError, match=f"--host {host} listens beyond loopback, but no cluster secret"):
            parse(host=host)
        assert parse("--insecure-internal-plane", host=host).secret is None
        assert parse("--cluster-secret", SECRET, host=host).secret is not None
    assert all(is_loopback(host) for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"))


def test_a_secret_file_path_given_empty_stops_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """``SPLITSERVE_CLUSTER_SECRET_FILE=`` (a manifest whose value did not expand) used to mean
    "no secret": an open plane on loopback, with a log line (issue 42, item 7)."""
    monkeypatch.delenv("SPLITSERVE_CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("SPLITSERVE_REQUIRE_CLUSTER_SECRET", raising=False)

    def parse(*argv: str) -> InternalPlane:
        parser = argparse.ArgumentParser()
        add_internal_plane_arguments(parser)
        return InternalPlane.from_args(parser.parse_args(argv), "127.0.0.1")

    monkeypatch.setenv("SPLITSERVE_CLUSTER_SECRET_FILE", "")
    with pytest.raises(ValueError, match="--cluster-secret-file is given but names no file"):
        parse()
    monkeypatch.delenv("SPLITSERVE_CLUSTER_SECRET_FILE")
    with pytest.raises(ValueError, match="--cluster-secret-file is given but names no file"):
        parse("--cluster-secret-file", " ")
    assert parse().secret is None


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


def test_a_gateway_or_instance_without_its_secret_refuses_to_start(tmp_path: Path) -> None:
    """The checks above at the command line: each process exits at once, before loading
    anything, with the fix in its error."""
    import os
    import subprocess

    from launcher.processes import splitserve_command

    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSERVE_")}
    empty = tmp_path / "cluster_secret"
    empty.touch()
    cases = {
        ("gateway", "--registry-url", "redis://127.0.0.1:1", "--host", "0.0.0.0"): "listens beyond loopback",
        ("decode", "--cluster-secret-file", str(empty)): "is empty: write the secret into it",
    }
    for argv, message in cases.items():
        done = subprocess.run(splitserve_command(*argv), env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr, (argv, done.stderr[-2000:])
