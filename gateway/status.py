"""The live status page: ``GET /status`` serves one HTML file from this package (no build
step, no external assets) whose script polls ``GET /status.json`` every second and draws
the instances the gateway knows and its recent TTFT and ITL.

Recent latencies are kept here, apart from the Prometheus histograms, because a page needs
points in time and a histogram keeps only counts: each request adds its TTFT when its first
token goes out and its mean inter-token gap when it finishes (``gateway.metrics.RequestTimer``).
"""

from __future__ import annotations

import time
from collections import deque
from importlib import resources
from typing import Literal

from pydantic import BaseModel

from gateway.instances import ROLES, InstancePool
from splitserve.v1 import disaggregation_pb2

RECENT_POINTS = 300  # per series: a few minutes of traffic on a small deployment


class RecentLatencies:
    """The latest TTFTs and mean ITLs, as (unix seconds, seconds) points, oldest first."""

    __slots__ = ("ttft", "itl")

    def __init__(self, max_points: int = RECENT_POINTS) -> None:
        self.ttft: deque[tuple[float, float]] = deque(maxlen=max_points)
        self.itl: deque[tuple[float, float]] = deque(maxlen=max_points)

    def add_ttft(self, seconds: float) -> None:
        self.ttft.append((time.time(), seconds))

    def add_itl(self, seconds: float) -> None:
        self.itl.append((time.time(), seconds))


class InstanceStatus(BaseModel):
    instance_id: str
    role: Literal["prefill", "decode", "colocated"]
    address: str
    healthy: bool
    num_waiting: int | None
    num_running: int | None
    num_free_blocks: int | None
    num_total_blocks: int | None
    kv_usage: float | None  # share of KV blocks in use, 0..1
    fingerprint: str | None
    engine_error: str
    report_age_s: float | None  # seconds since the latest load report


class StatusResponse(BaseModel):
    object: Literal["status"] = "status"
    model: str
    ready: bool
    time: float  # unix seconds, the server's clock (the points below use it too)
    instances: list[InstanceStatus]
    ttft: list[tuple[float, float]]  # (unix seconds, seconds)
    itl: list[tuple[float, float]]


def describe_fingerprint(fingerprint: disaggregation_pb2.Fingerprint) -> str:
    return (
        f"{fingerprint.model} {fingerprint.dtype} block {fingerprint.block_size}, {fingerprint.num_layers} layers, "
        f"{fingerprint.num_kv_heads} KV heads x {fingerprint.head_dim}, TP {max(fingerprint.tensor_parallel_size, 1)}"
    )


def status_snapshot(pool: InstancePool, recent: RecentLatencies, model_name: str, ready: bool) -> StatusResponse:
    now = time.monotonic()
    healthy = {id(state) for role in ROLES for state in pool.healthy(role)}
    instances = []
    for state in sorted(pool.instances.values(), key=lambda s: (ROLES.index(s.role), s.address)):
        report = state.report
        used = report.num_total_blocks - report.num_free_blocks if report is not None else None
        instances.append(
            InstanceStatus(
                instance_id=state.instance_id,
                role=state.role,
                address=state.address,
                healthy=id(state) in healthy,
                num_waiting=report.num_waiting if report is not None else None,
                num_running=report.num_running if report is not None else None,
                num_free_blocks=report.num_free_blocks if report is not None else None,
                num_total_blocks=report.num_total_blocks if report is not None else None,
                kv_usage=used / report.num_total_blocks if report is not None and report.num_total_blocks else None,
                fingerprint=describe_fingerprint(report.fingerprint)
                if report is not None and report.HasField("fingerprint")
                else None,
                engine_error=report.engine_error if report is not None else "",
                report_age_s=round(now - state.reported_at, 3) if report is not None else None,
            )
        )
    return StatusResponse(
        model=model_name,
        ready=ready,
        time=time.time(),
        instances=instances,
        ttft=list(recent.ttft),
        itl=list(recent.itl),
    )


def status_page() -> str:
    return resources.files("gateway").joinpath("static/status.html").read_text(encoding="utf-8")
