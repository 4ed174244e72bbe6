"""Starting and stopping real service processes on loopback for tests."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.auth import METADATA_KEY, ClusterSecret
from launcher.processes import splitserve_command
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc
from tests.stores import free_port, stop

ROOT = Path(__file__).resolve().parents[2]
SERVICE_ENV = {"UCX_TLS": "tcp,sm,self", "UCX_WARN_UNUSED_ENV_VARS": "n", "PYTHONUNBUFFERED": "1"}


class _CallCredential(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """The test's side of the cluster secret on a synchronous channel to ``target``: a fresh call
    credential, for that instance and the call's request, on every call."""

    def __init__(self, secret: str, target: str) -> None:
        self._secret = ClusterSecret.from_text(secret)
        self._target = target

    def _details(self, details: grpc.ClientCallDetails, request: Message) -> grpc.ClientCallDetails:
        credential = self._secret.call_credential(details.method, self._target, request.SerializeToString())
        return _Details(
            details.method,
            details.timeout,
            [*(details.metadata or ()), (METADATA_KEY, credential)],
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details, request), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details, request), request)


class _Details(
    collections.namedtuple(
        "_Details", ["method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"]
    ),
    grpc.ClientCallDetails,
):
    pass


# A channel opened before its instance listens fails its first connects, and gRPC's default
# reconnect backoff (1 s growing by 1.6x) then kept the instance unseen for seconds after it was
# serving. Reconnect at once, as the gateway does (gateway/instances.py), so a wait for the
# instance ends when it listens.
_RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 100),
]


def open_channel(address: str, secret: str | None = None, tls: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    """A synchronous channel to an instance, as a member of its cluster when given its secret / TLS."""
    channel = (
        grpc.secure_channel(address, tls, options=_RECONNECT_OPTIONS)
        if tls is not None
        else grpc.insecure_channel(address, options=_RECONNECT_OPTIONS)
    )
    return grpc.intercept_channel(channel, _CallCredential(secret, address)) if secret is not None else channel


class Service:
    def __init__(
        self,
        role: str,
        model: Path,
        *extra: str,
        secret: str | None = None,
        tls: grpc.ChannelCredentials | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """``secret``: the instance's cluster secret (passed in its environment, as ``splitserve up``
        does); the test's channel carries it too. ``tls``: the test's channel credentials, for an
        instance started with TLS flags in ``extra``."""
        self.role = role
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = open(f"/tmp/splitserve-test-{role}-{self.port}.log", "w")  # noqa: SIM115 - closed in stop()
        secret_env = {"SPLITSERVE_CLUSTER_SECRET": secret} if secret is not None else {}
        self.process = subprocess.Popen(
            splitserve_command(
                role, "--model", str(model), "--port", str(self.port), "--kv-cache-memory", str(1 << 22), *extra
            ),
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **SERVICE_ENV, **secret_env, **(env or {})},
        )
        self.channel = open_channel(self.address, secret, tls)
        self._wait_until_serving()

    def _wait_until_serving(self, timeout_s: float = 90.0) -> None:
        health = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"service exited with {self.process.returncode}: {Path(self.log.name).read_text()[-3000:]}"
                )
            try:
                # wait_for_ready: the call waits for the channel's connect (tried every 100 ms)
                # and answers as soon as the instance listens; the timeout only bounds how long
                # a process that died goes unnoticed.
                if (
                    health.Check(health_pb2.HealthCheckRequest(), timeout=1.0, wait_for_ready=True).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"service on {self.address} not serving after {timeout_s} s")

    def load(self) -> disaggregation_pb2.LoadReport:
        return disaggregation_pb2_grpc.LoadStub(self.channel).GetLoadReport(
            disaggregation_pb2.LoadReportRequest(), timeout=5.0
        )

    def wait_all_free(self, timeout_s: float = 120.0) -> disaggregation_pb2.LoadReport:
        """The load report once every block is free, or at ``timeout_s`` (a safety net, far past the wait)."""
        deadline = time.monotonic() + timeout_s
        while True:
            report = self.load()
            if report.num_free_blocks == report.num_total_blocks or time.monotonic() > deadline:
                return report
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        self.channel.close()
        returncode = stop(self.process, sig, timeout_s=30)
        self.log.close()
        return returncode


@contextmanager
def running(
    role: str,
    model: Path,
    *extra: str,
    secret: str | None = None,
    tls: grpc.ChannelCredentials | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[Service]:
    service = Service(role, model, *extra, secret=secret, tls=tls, env=env)
    try:
        yield service
    finally:
        service.stop()
