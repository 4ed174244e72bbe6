"""Starting and stopping real service processes on loopback for tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from splitserve.v1 import disaggregation_pb2, disaggregation_pb2_grpc

from tests.stores import free_port, stop

ROOT = Path(__file__).resolve().parents[2]
SERVICE_ENV = {"UCX_TLS": "tcp,sm,self", "UCX_WARN_UNUSED_ENV_VARS": "n", "PYTHONUNBUFFERED": "1"}


class Service:
    def __init__(self, role: str, model: Path, *extra: str) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = open(f"/tmp/splitserve-test-{role}-{self.port}.log", "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engine.cli", role, "--model", str(model), "--port", str(self.port),
             "--kv-cache-memory", str(1 << 22), *extra],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **SERVICE_ENV},
        )
        self.channel = grpc.insecure_channel(self.address)
        self._wait_until_serving()

    def _wait_until_serving(self, timeout_s: float = 90.0) -> None:
        health = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"service exited with {self.process.returncode}: {Path(self.log.name).read_text()[-3000:]}")
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"service on {self.address} not serving after {timeout_s} s")

    def load(self) -> disaggregation_pb2.LoadReport:
        return disaggregation_pb2_grpc.LoadStub(self.channel).GetLoadReport(disaggregation_pb2.LoadReportRequest(), timeout=5.0)

    def wait_all_free(self, timeout_s: float = 3.0) -> disaggregation_pb2.LoadReport:
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
def running(role: str, model: Path, *extra: str) -> Iterator[Service]:
    service = Service(role, model, *extra)
    try:
        yield service
    finally:
        service.stop()
