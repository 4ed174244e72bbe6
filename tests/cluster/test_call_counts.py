"""An instance's server counts every call it receives, by method, refused ones too
(``cluster/call_counts.py``), and its Prometheus endpoint exports the counts, with what its
cluster-secret check refused and remembers."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster.auth import ClusterSecret
from cluster.internal_grpc import InternalPlane
from serving.metrics import CallCountCollector
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc
from tests.cluster.test_internal_grpc import ABORT, SECRET, EchoDecode, health_status, with_server

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
DECODE = "/splitserve.v1.Decode/Decode"


def test_each_plane_counts_the_calls_its_server_received_by_method_refused_ones_too() -> None:
    plane = InternalPlane(secret=ClusterSecret.from_text(SECRET))
    assert InternalPlane().call_counts is not InternalPlane().call_counts, "one count per instance's plane"

    async def test(address: str, servicer: EchoDecode) -> None:
        async with plane.channel(address) as member:
            stub = disaggregation_pb2_grpc.DecodeStub(member)
            for _ in range(3):
                await stub.Abort(disaggregation_pb2.RequestRef(request_id="r"), timeout=5)
            assert [r.token_ids async for r in stub.Decode(disaggregation_pb2.DecodeRequest(request_id="r"))]
            await health_status(member)
        async with grpc.aio.insecure_channel(address) as outsider:
            with pytest.raises(grpc.aio.AioRpcError):
                await disaggregation_pb2_grpc.DecodeStub(outsider).Abort(
                    disaggregation_pb2.RequestRef(request_id="r"), timeout=5
                )
        assert servicer.num_calls == 4
        assert plane.call_counts.snapshot() == {ABORT: 4, DECODE: 1, HEALTH_CHECK: 1}
        # Four accepted calls, each nonce remembered; the outsider's refused; health is open.
        assert exported(plane)["splitserve_engine_grpc_calls_refused"] == {
            "splitserve_engine_grpc_calls_refused_total": 1
        }
        assert exported(plane)["splitserve_engine_call_nonces_remembered"] == {
            "splitserve_engine_call_nonces_remembered": 4
        }

    asyncio.run(with_server(plane, test))


def exported(plane: InternalPlane) -> dict[str, dict[str, float]]:
    """The collector's families as Prometheus parses them: family -> sample name -> value (of
    the one instance's series)."""
    registry = CollectorRegistry()
    registry.register(CallCountCollector(plane, "decode-0", "decode"))
    families = text_string_to_metric_families(generate_latest(registry).decode())
    return {family.name: {s.name: s.value for s in family.samples if "method" not in s.labels} for family in families}


def test_the_collector_exports_one_counter_series_per_method() -> None:
    plane = InternalPlane()
    plane.call_counts._num_calls.update({HEALTH_CHECK: 2, ABORT: 5})
    registry = CollectorRegistry()
    registry.register(CallCountCollector(plane, "decode-0", "decode"))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    samples = {
        s.labels["method"]: (s.name, s.labels["instance"], s.value)
        for s in families["splitserve_engine_grpc_calls"].samples
    }
    assert samples == {
        HEALTH_CHECK: ("splitserve_engine_grpc_calls_total", "decode-0", 2.0),
        ABORT: ("splitserve_engine_grpc_calls_total", "decode-0", 5.0),
    }
    # Without a cluster secret nothing is checked: no refusal or replay series at all.
    assert set(families) == {"splitserve_engine_grpc_calls"}
