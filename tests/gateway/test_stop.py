"""A gateway stopped by SIGTERM drains its REST and gRPC fronts side by side, and tells its
gRPC health watchers first: a ``Watch`` stream stays open for as long as its client likes, so
a drain that waited for it would run to the end of its grace (30 s) and cancel it, and a
container's stop timeout would kill the gateway before that."""

from __future__ import annotations

import signal
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.checkpoints import make_checkpoint
from tests.gateway.processes import running_gateway
from tests.stores import free_port

WATCH_TIMEOUT_S = 120.0  # a bound on the whole stream, so that one that never ends fails the test


def test_a_stopping_gateway_tells_its_grpc_health_watchers_and_ends_their_streams(tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path)
    nowhere = ("--colocated", f"127.0.0.1:{free_port()}")  # /health answers without an instance
    grpc_port = free_port()
    with (
        running_gateway(model, *nowhere, "--grpc-port", str(grpc_port), ready_path="/health") as gateway,
        grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
    ):
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=WATCH_TIMEOUT_S)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        gateway.process.send_signal(signal.SIGTERM)
        assert [response.status for response in watch] == [health_pb2.HealthCheckResponse.NOT_SERVING]
        assert watch.code() == grpc.StatusCode.OK
        assert gateway.process.wait(timeout=WATCH_TIMEOUT_S) == 0
