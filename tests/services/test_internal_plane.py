"""The internal plane closed by a cluster secret, with real prefill and decode processes
and real UCX pulls on loopback: calls without the secret are refused and change nothing,
a KV handle P did not sign (or that was altered) is refused before D allocates anything,
so nothing a stranger serves ever enters D's prefix cache, and the same holds over
mutual TLS. After each scenario every block is free again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import LLM
from engine.kv_cache_utils import cdiv
from serving.convert import fingerprint_from_proto
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc
from tests.checkpoints import random_prompts
from tests.services.client import (
    GREEDY,
    assert_all_free,
    assert_altered_handle_refused,
    expected_tokens,
    run_decode,
    run_prefill,
)
from tests.services.processes import ROOT, SERVICE_ENV, Service, open_channel, running

pytest.importorskip("ucxx")

SECRET = "internal-plane-test-secret-0123456789"
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def prefill(model: Path) -> Iterator[Service]:
    with running("prefill", model, "--lease-seconds", "20", secret=SECRET) as service:
        yield service


@pytest.fixture(scope="module")
def decode(model: Path) -> Iterator[Service]:
    with running("decode", model, "--kv-pull-timeout", "5", secret=SECRET) as service:
        yield service


def outsider_calls(service: Service) -> dict[str, object]:
    """Every internal RPC of the service's role, made without the secret."""
    channel = open_channel(service.address)
    prefill, decode = disaggregation_pb2_grpc.PrefillStub(channel), disaggregation_pb2_grpc.DecodeStub(channel)
    ref = disaggregation_pb2.RequestRef(request_id="x")
    calls = {
        "GetLoadReport": lambda: disaggregation_pb2_grpc.LoadStub(channel).GetLoadReport(
            disaggregation_pb2.LoadReportRequest(), timeout=10
        )
    }
    if service.load().role == "prefill":
        calls |= {
            "Prefill": lambda: prefill.Prefill(
                disaggregation_pb2.PrefillRequest(request_id="x", prompt_token_ids=list(range(40)), sampling=GREEDY),
                timeout=10,
            ),
            "ReleaseKV": lambda: prefill.ReleaseKV(ref, timeout=10),
            "RenewKV": lambda: prefill.RenewKV(disaggregation_pb2.RenewKVRequest(request_ids=["x"]), timeout=10),
            "Abort": lambda: prefill.Abort(ref, timeout=10),
        }
    else:
        calls |= {
            "Decode": lambda: list(
                decode.Decode(disaggregation_pb2.DecodeRequest(request_id="x", prompt_token_ids=[1]), timeout=10)
            ),
            "Abort": lambda: decode.Abort(ref, timeout=10),
        }
    return calls


def test_calls_without_the_secret_are_unauthenticated(prefill: Service, decode: Service) -> None:
    for service in (prefill, decode):
        for name, call in outsider_calls(service).items():
            with pytest.raises(grpc.RpcError) as raised:
                call()
            assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            assert "needs the cluster secret" in raised.value.details()
        # Health stays open, for orchestrators.
        health = health_pb2_grpc.HealthStub(open_channel(service.address)).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert_all_free(prefill, decode)  # the refused Prefill pinned nothing


def test_members_of_the_cluster_serve_as_without_a_secret(prefill: Service, decode: Service, colocated: LLM) -> None:
    """D renews and releases on P with the secret: P's blocks are free as soon as the pull is
    over, long before the lease would free them."""
    prompt = random_prompts([40], seed=61)[0]
    prefilled = run_prefill(prefill, "member", prompt)
    assert len(prefilled.kv.signature) == 32 and len(prefilled.kv.pull_token) == 16
    tokens, responses = run_decode(decode, "member", prompt, prefilled)
    assert tokens == expected_tokens(colocated, prompt)
    assert responses[0].kv_transfer.num_pulled_blocks == 3
    assert_all_free(prefill, decode)


@contextmanager
def rogue_listener(decode: Service, request_id: str, num_blocks: int) -> Iterator[tuple[str, subprocess.Popen]]:
    """A UCX listener of the test's own serving garbage KV of D's geometry (tests.services.rogue_prefill)."""
    fingerprint = json.dumps(asdict(fingerprint_from_proto(decode.load().fingerprint)))
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.services.rogue_prefill", fingerprint, request_id, str(num_blocks)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **SERVICE_ENV},
    )
    try:
        yield process.stdout.readline().strip(), process
    finally:
        process.stdin.close()
        process.wait(timeout=30)
        process.stdout.close()


def pulls_served(rogue: subprocess.Popen) -> int:
    rogue.stdin.write("pulls\n")
    rogue.stdin.flush()
    return int(rogue.stdout.readline())


def forged_handle(decode: Service, address: str, prompt: list[int]) -> disaggregation_pb2.KVHandle:
    """What a stranger hands D: its own listener, D's (public) fingerprint, the prompt to poison."""
    num_blocks = cdiv(len(prompt), BLOCK_SIZE)
    return disaggregation_pb2.KVHandle(
        request_id="forged",
        connector="ucx",
        connector_address=address,
        block_ids=list(range(num_blocks)),
        num_tokens=len(prompt),
        fingerprint=decode.load().fingerprint,
        lease_s=30.0,
    )


def decode_with(
    decode: Service, request_id: str, prompt: list[int], handle: disaggregation_pb2.KVHandle
) -> list[disaggregation_pb2.DecodeResponse]:
    stub = disaggregation_pb2_grpc.DecodeStub(decode.channel)
    return list(
        stub.Decode(
            disaggregation_pb2.DecodeRequest(
                request_id=request_id, prompt_token_ids=prompt, first_token_id=1, sampling=GREEDY, kv=handle
            ),
            timeout=60,
        )
    )


def prefix_hits_of(prefill: Service, decode: Service, request_id: str, prompt: list[int]) -> int:
    """Blocks of ``prompt`` D's prefix cache already held, per a genuine hand-off of it."""
    prefilled = run_prefill(prefill, request_id, prompt)
    _, responses = run_decode(decode, request_id, prompt, prefilled)
    return responses[0].kv_transfer.num_local_hit_blocks


def test_a_forged_handle_is_refused_and_nothing_enters_the_prefix_cache(
    model: Path, prefill: Service, decode: Service
) -> None:
    prompt = random_prompts([40], seed=62)[0]  # two full blocks, the ones a prefix cache keeps
    with rogue_listener(decode, "forged", 3) as (address, rogue):
        # The attack is real: a decode instance without a secret pulls the stranger's KV and caches it.
        with running("decode", model, "--kv-pull-timeout", "5") as open_decode:
            decode_with(open_decode, "forged", prompt, forged_handle(open_decode, address, prompt))
            assert pulls_served(rogue) == 1
            assert prefix_hits_of(prefill, open_decode, "after-open", prompt) == 2, (
                "the open instance reuses the poisoned blocks"
            )
            assert_all_free(open_decode)
        # Its release to P was refused (it has no secret): release P's blocks here.
        disaggregation_pb2_grpc.PrefillStub(prefill.channel).ReleaseKV(
            disaggregation_pb2.RequestRef(request_id="after-open"), timeout=10
        )
        # With the secret, D refuses the handle before allocating anything, and never pulls.
        refused_before = decode.load().counters.num_kv_handles_refused
        with pytest.raises(grpc.RpcError) as raised:
            decode_with(decode, "forged", prompt, forged_handle(decode, address, prompt))
        assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "the KV handle is not signed" in raised.value.details() and "--cluster-secret" in raised.value.details()
        assert decode.load().counters.num_kv_handles_refused == refused_before + 1
        assert pulls_served(rogue) == 1, "the secured instance never reached the listener"
        assert_all_free(decode)
    assert prefix_hits_of(prefill, decode, "after-forged", prompt) == 0, "nothing the stranger had was cached"
    assert_all_free(prefill, decode)


@pytest.mark.parametrize(
    ("field", "alter"),
    [
        ("block_ids", lambda handle: handle.block_ids.__setitem__(0, handle.block_ids[0] + 1)),
        ("connector_address", lambda handle: setattr(handle, "connector_address", "127.0.0.1:9")),
        ("pull_token", lambda handle: setattr(handle, "pull_token", bytes(16))),
    ],
)
def test_an_altered_handle_is_refused(prefill: Service, decode: Service, colocated: LLM, field: str, alter) -> None:
    prompt = random_prompts([40], seed=63)[0]
    assert_altered_handle_refused(
        prefill,
        decode,
        colocated,
        f"altered-{field}",
        prompt,
        alter,
        grpc.StatusCode.PERMISSION_DENIED,
        "signature does not match",
    )


def test_a_handle_is_good_only_for_its_own_prompt(prefill: Service, decode: Service) -> None:
    """A genuine handle replayed with another prompt would cache one prompt's KV under the other's
    hashes: P signed it over its own prompt, so D's check against the call's prompt fails."""
    prompt, other = random_prompts([40, 40], seed=64)
    prefilled = run_prefill(prefill, "replayed", prompt)
    with pytest.raises(grpc.RpcError) as raised:
        decode_with(decode, "replayed", other, prefilled.kv)
    assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "KV of another prompt than the call's prompt_token_ids" in raised.value.details()
    assert_all_free(decode)
    disaggregation_pb2_grpc.PrefillStub(prefill.channel).ReleaseKV(
        disaggregation_pb2.RequestRef(request_id="replayed"), timeout=10
    )
    assert_all_free(prefill)


def test_the_gateway_routes_only_with_the_secret(model: Path, prefill: Service, decode: Service) -> None:
    from tests.gateway.processes import running_gateway

    routes = ["--prefill", prefill.address, "--decode", decode.address]
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    with running_gateway(model, *routes, env={"SPLITSERVE_CLUSTER_SECRET": SECRET}) as member:
        response = httpx.post(f"{member.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    with running_gateway(model, *routes, ready_path="/health") as outsider:
        assert httpx.get(f"{outsider.url}/ready", timeout=10).status_code == 503
        assert httpx.post(f"{outsider.url}/v1/completions", json=body, timeout=60).status_code == 503
        log = outsider.log_text()
        assert "NO CLUSTER SECRET" in log and "refused the gateway" in log and "needs the cluster secret" in log
    assert_all_free(prefill, decode)


def test_mutual_tls_between_members(model: Path, tmp_path: Path, colocated: LLM) -> None:
    """Instances serving mutual TLS: a member (the cluster's CA, a certificate it signed, the
    secret) gets the same tokens; D's lease calls to P go over TLS too (P's blocks are free at
    once); a plaintext client gets nowhere."""
    from tests.certificates import TestCA

    ca = TestCA(tmp_path)
    files = {name: ca.issue(name) for name in ("prefill", "decode", "client")}

    def flags(name: str) -> list[str]:
        return ["--tls-cert", str(files[name].cert), "--tls-key", str(files[name].key), "--tls-ca", str(ca.ca_path)]

    client = grpc.ssl_channel_credentials(
        ca.ca_path.read_bytes(), files["client"].key.read_bytes(), files["client"].cert.read_bytes()
    )
    with (
        running("prefill", model, *flags("prefill"), secret=SECRET, tls=client) as tls_prefill,
        running("decode", model, *flags("decode"), secret=SECRET, tls=client) as tls_decode,
    ):
        prompt = random_prompts([40], seed=65)[0]
        prefilled = run_prefill(tls_prefill, "tls", prompt)
        tokens, _ = run_decode(tls_decode, "tls", prompt, prefilled)
        assert tokens == expected_tokens(colocated, prompt)
        assert_all_free(tls_prefill, tls_decode)
        plaintext = health_pb2_grpc.HealthStub(open_channel(tls_prefill.address, SECRET))
        with pytest.raises(grpc.RpcError) as raised:
            plaintext.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
