"""The live status page: ``GET /status`` serves one HTML file from this package (no build
step, no external assets) whose script polls ``GET /status.json`` every second and draws
the instances the gateway knows and its recent TTFT and ITL. Of each instance's counters the
page shows those ``cluster/instance_counters.py`` gives a status label, one column each, in
the table's order: ``status.json`` sends the columns with the values.

Recent latencies are kept here, apart from the Prometheus histograms, because a page needs
points in time and a histogram keeps only counts: each request adds its TTFT when its first
token goes out and its mean inter-token gap when it finishes (``gateway.metrics.RequestTimer``).

With ``--planner-url`` the page also shows the planner's latest decision and its reasons
(:class:`PlannerReader`): the gateway reads the planner's own metrics endpoint, at most once a
second whoever asks, off the event loop; a planner that does not answer shows as such, and the
rest of the page is unaffected.

Both show internal addresses and engine errors, so with ``--api-key`` they need the key
(:func:`status_authorized`): as a bearer token like the API, or as the password of HTTP
Basic authentication (any user name), which a browser asks for itself when the page answers
401 with :data:`STATUS_AUTH_CHALLENGE`; the page's own fetches then carry it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import time
import urllib.request
from collections import deque
from importlib import resources
from typing import Literal

from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

from cluster.instance_counters import STATUS_PAGE_COUNTERS, read
from cluster.request_phases import TTFT_PHASES, phase_seconds
from gateway.errors import bearer_matches
from gateway.instances import ROLES, InstancePool
from planner import metrics as planner_series
from splitserve.v1 import disaggregation_pb2
from splitserve.v1.generation_pb2 import RequestPhases

RECENT_POINTS = 300  # per series: a few minutes of traffic on a small deployment
STATUS_PATHS = frozenset({"/status", "/status.json"})
PLANNER_READ_TIMEOUT_S = 2.0
PLANNER_MAX_AGE_S = 1.0  # the page polls every second: one read a second serves every viewer
STATUS_AUTH_CHALLENGE = {"WWW-Authenticate": 'Basic realm="splitserve status", charset="UTF-8"'}


def status_authorized(authorization: str, api_key: str) -> bool:
    """``Authorization: Bearer KEY``, or ``Basic`` with KEY as the password; constant time."""
    if bearer_matches(authorization, api_key):
        return True
    scheme, _, encoded = authorization.partition(" ")
    if scheme.lower() != "basic":
        return False
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        return False
    _, _, password = decoded.partition(b":")
    return hmac.compare_digest(password, api_key.encode())


class RecentLatencies:
    """The latest TTFTs and mean ITLs, as (unix seconds, seconds) points, oldest first; and the
    latest TTFTs' phases (``cluster/request_phases.py``), one row per request, in
    :data:`TTFT_PHASES` order."""

    __slots__ = ("ttft", "itl", "ttft_phases")

    def __init__(self, max_points: int = RECENT_POINTS) -> None:
        self.ttft: deque[tuple[float, float]] = deque(maxlen=max_points)
        self.itl: deque[tuple[float, float]] = deque(maxlen=max_points)
        self.ttft_phases: deque[list[float]] = deque(maxlen=max_points)

    def add_ttft(self, seconds: float) -> None:
        self.ttft.append((time.time(), seconds))

    def add_itl(self, seconds: float) -> None:
        self.itl.append((time.time(), seconds))

    def add_phases(self, phases: RequestPhases) -> None:
        self.ttft_phases.append([phase_seconds(phases, phase) for phase in TTFT_PHASES])

    def phase_breakdown(self) -> PhaseBreakdown | None:
        """The recent requests' TTFT phases: each phase's mean, and its share at the median and
        the 90th-percentile TTFT (the requests nearest to each); None before any request."""
        rows = sorted(self.ttft_phases, key=sum)
        if not rows:
            return None

        def at(quantile: float) -> list[float]:
            return rows[min(len(rows) - 1, int(quantile * len(rows)))]

        return PhaseBreakdown(
            phases=list(TTFT_PHASES),
            num_requests=len(rows),
            mean=[sum(column) / len(rows) for column in zip(*rows)],
            p50=at(0.5),
            p90=at(0.9),
        )


class PhaseBreakdown(BaseModel):
    """Where recent requests' time to first token went, seconds per phase (in ``phases``' order)."""

    phases: list[str]
    num_requests: int
    mean: list[float]
    p50: list[float]  # the phases of the request at the median TTFT
    p90: list[float]  # ... and at the 90th percentile


class StatusColumn(BaseModel):
    """One instance counter the page shows: its key in ``InstanceStatus.counters``, the column's
    header, its unit (a ratio is drawn as a bar) and its help text (the header's tooltip)."""

    name: str
    label: str
    unit: str
    help: str


class InstanceStatus(BaseModel):
    instance_id: str
    role: Literal["prefill", "decode", "colocated"]
    address: str
    healthy: bool
    counters: dict[str, float] | None  # the columns' values by name; None until the first load report
    fingerprint: str | None
    engine_error: str
    report_age_s: float | None  # seconds since the latest load report


class RegistryStatus(BaseModel):
    """The Redis registry, for a gateway that discovers instances there."""

    reachable: bool  # false: the gateway keeps the instances it knew, on their gRPC health and load reports
    unreachable_for_s: float  # since the outage under way began; 0 while reachable
    records_refused: int  # records the latest scan ignored (unsigned, stale, ...: see /metrics)


class PlannerRole(BaseModel):
    """One role as the planner last decided it."""

    role: str
    desired: int | None  # instances it wants
    needed: int | None  # what the predicted rate needs, before bounds, cooldowns and the budget
    reason: str | None  # why desired is what it is (planner/decision.py's reasons)
    capacity_rps: float | None  # requests a second one instance sustains within the SLOs
    instances: dict[str, int]  # by state: starting, ready, draining


class PlannerStatus(BaseModel):
    """The planner's latest decision, from its metrics (planner/metrics.py); ``reachable`` false
    with ``error`` when it did not answer."""

    url: str
    reachable: bool
    error: str = ""
    observed_rps: float | None = None
    predicted_rps: float | None = None
    mean_tokens: dict[str, float] = {}  # prompt, output
    slo_s: dict[str, float] = {}  # ttft, itl: the p90s it holds
    observed_p90_s: dict[str, float] = {}  # ttft, itl: last interval's
    slo_headroom: dict[str, float] = {}  # 1 - observed / SLO: above 0 within it, below 0 missed
    roles: list[PlannerRole] = []


def planner_status(url: str, metrics_text: str) -> PlannerStatus:
    """The figures of the planner's ``/metrics`` text."""
    series: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            series.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value

    def by(name: str, label: str) -> dict[str, float]:
        return {dict(labels)[label]: value for labels, value in series.get(name, {}).items() if label in dict(labels)}

    def one(name: str) -> float | None:
        return series.get(name, {}).get(())

    def whole(value: float | None) -> int | None:
        return None if value is None else round(value)

    desired, needed = by(planner_series.DESIRED, "role"), by(planner_series.NEEDED, "role")
    capacity = by(planner_series.CAPACITY, "role")
    roles = []
    for role in ("prefill", "decode"):
        states = {
            dict(labels)["state"]: round(value)
            for labels, value in series.get(planner_series.INSTANCES, {}).items()
            if dict(labels).get("role") == role
        }
        reasons = [
            dict(labels)["reason"]
            for labels, value in series.get(planner_series.REASON, {}).items()
            if dict(labels).get("role") == role and value == 1
        ]
        roles.append(
            PlannerRole(
                role=role,
                desired=whole(desired.get(role)),
                needed=whole(needed.get(role)),
                reason=reasons[0] if reasons else None,
                capacity_rps=capacity.get(role),
                instances={state: states.get(state, 0) for state in planner_series.STATES},
            )
        )
    slo, observed = by(planner_series.SLO_SECONDS, "metric"), by(planner_series.OBSERVED_P90, "metric")
    return PlannerStatus(
        url=url,
        reachable=True,
        observed_rps=one(planner_series.OBSERVED_RATE),
        predicted_rps=one(planner_series.PREDICTED_RATE),
        mean_tokens=by(planner_series.MEAN_TOKENS, "kind"),
        slo_s=slo,
        observed_p90_s=observed,
        slo_headroom={metric: 1 - observed[metric] / slo[metric] for metric in observed if slo.get(metric)},
        roles=roles,
    )


class PlannerReader:
    """Reads the planner's metrics for the status page: at most once a ``max_age_s``, in a
    thread (urllib blocks), with the latest answer kept for the requests in between."""

    def __init__(
        self, url: str, timeout_s: float = PLANNER_READ_TIMEOUT_S, max_age_s: float = PLANNER_MAX_AGE_S
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_age_s = max_age_s
        self._latest: PlannerStatus | None = None
        self._read_at = -float("inf")

    async def read(self) -> PlannerStatus:
        if self._latest is not None and time.monotonic() - self._read_at < self.max_age_s:
            return self._latest
        self._read_at = time.monotonic()
        try:
            text = await asyncio.to_thread(self._fetch)
            self._latest = planner_status(self.url, text)
        except (OSError, ValueError) as error:  # urllib's errors are OSErrors; a body that is no metrics text
            self._latest = PlannerStatus(url=self.url, reachable=False, error=str(error))
        return self._latest

    def _fetch(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=self.timeout_s) as response:
            return response.read().decode()


class StatusResponse(BaseModel):
    object: Literal["status"] = "status"
    model: str
    ready: bool
    time: float  # unix seconds, the server's clock (the points below use it too)
    registry: RegistryStatus | None  # None with a static instance list
    instances: list[InstanceStatus]
    columns: list[StatusColumn]  # the instance counters shown, in order
    ttft: list[tuple[float, float]]  # (unix seconds, seconds)
    itl: list[tuple[float, float]]
    ttft_phases: PhaseBreakdown | None  # None before the first request
    planner: PlannerStatus | None = None  # None without --planner-url


def describe_fingerprint(fingerprint: disaggregation_pb2.Fingerprint) -> str:
    # A report from before the fields leaves them unset: one rank, one stage.
    parallel = f"TP {max(fingerprint.tensor_parallel_size, 1)}"
    if len(fingerprint.stage_first_layers) > 1:
        parallel += f" x PP {len(fingerprint.stage_first_layers)}"
    # The drafter decides pairing too (cluster/draft_pairing.py): shown where there is one.
    draft = f", drafts by {fingerprint.draft}" if fingerprint.draft else ""
    return (
        f"{fingerprint.model} {fingerprint.dtype} block {fingerprint.block_size}, {fingerprint.num_layers} layers, "
        f"{fingerprint.num_kv_heads} KV heads x {fingerprint.head_dim}, {parallel}{draft}"
    )


def status_snapshot(
    pool: InstancePool,
    recent: RecentLatencies,
    model_name: str,
    ready: bool,
    planner: PlannerStatus | None = None,
) -> StatusResponse:
    now = time.monotonic()
    healthy = {id(state) for role in ROLES for state in pool.healthy(role)}
    instances = []
    for state in sorted(pool.instances.values(), key=lambda s: (ROLES.index(s.role), s.address)):
        report = state.report
        instances.append(
            InstanceStatus(
                instance_id=state.instance_id,
                role=state.role,
                address=state.address,
                healthy=id(state) in healthy,
                counters={counter.name: read(counter, report) for counter in STATUS_PAGE_COUNTERS}
                if report is not None
                else None,
                fingerprint=describe_fingerprint(report.fingerprint)
                if report is not None and report.HasField("fingerprint")
                else None,
                engine_error=report.engine_error if report is not None else "",
                report_age_s=round(now - state.reported_at, 3) if report is not None else None,
            )
        )
    registry = pool.registry
    return StatusResponse(
        model=model_name,
        ready=ready,
        time=time.time(),
        registry=RegistryStatus(
            reachable=registry.reachable,
            unreachable_for_s=round(registry.unreachable_for_s(), 1),
            records_refused=len(registry.refused_now),
        )
        if registry is not None
        else None,
        instances=instances,
        columns=[
            StatusColumn(
                name=counter.name, label=counter.status_label or counter.name, unit=counter.unit, help=counter.help
            )
            for counter in STATUS_PAGE_COUNTERS
        ],
        ttft=list(recent.ttft),
        itl=list(recent.itl),
        ttft_phases=recent.phase_breakdown(),
        planner=planner,
    )


def status_page() -> str:
    return resources.files("gateway").joinpath("static/status.html").read_text(encoding="utf-8")
