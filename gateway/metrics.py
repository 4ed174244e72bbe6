"""The gateway's Prometheus metrics (``GET /metrics``): request latencies as the
client sees them, request and token counts, KV hand-off volume, each
instance's latest load report, the state of the Redis registry, and the KV-event traffic
(``gateway/kv_event_traffic.py``)."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cluster.instance_counters import INSTANCE_COUNTERS, metric_family, values
from cluster.registry_record import REFUSAL_REASONS
from cluster.request_phases import HANDOFF_PHASES, PHASE_BUCKETS, TTFT_PHASES, add_handoff, phase_seconds, ttft_phases
from gateway.instances import ROLES, InstancePool
from gateway.kv_event_traffic import KVEventTraffic, KVEventTrafficCollector
from gateway.status import RecentLatencies
from splitserve.v1 import disaggregation_pb2
from splitserve.v1.generation_pb2 import RequestPhases

# Latency buckets (seconds) spanning a CPU-served small model to a fast GPU.
_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
# Output tokens of a request: from a one-word answer to a long generation.
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class GatewayMetrics:
    def __init__(self, pool: InstancePool, kv_event_traffic: KVEventTraffic | None = None) -> None:
        """``kv_event_traffic``: what the KV-event followers count (gateway/kv_events.py); zeros without."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "splitserve_time_to_first_token_seconds",
            "Arrival to the first token sent",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "splitserve_inter_token_latency_seconds",
            "Gap between successive output tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "splitserve_e2e_request_latency_seconds", "Arrival to the last token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue = Histogram(
            "splitserve_request_queue_time_seconds",
            "Arrival to the request's dispatch to an instance (tokenizing, templating, admission)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft_phases = Histogram(
            "splitserve_ttft_phase_seconds",
            "Time to first token by phase; a request's phases add up to its TTFT (gateway_queue, prefill_queue, "
            "prefill_compute, kv_publish, transport: docs/observability.md)",
            ["phase"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.handoff_phases = Histogram(
            "splitserve_handoff_phase_seconds",
            "The hand-off to decode after the first token, by phase (decode_queue, kv_pull, first_decode_step), as "
            "decode instances report them",
            ["phase"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.requests = Counter("splitserve_requests", "Finished requests by outcome", ["status"], registry=r)
        self.prompt_tokens = Counter("splitserve_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.cached_prompt_tokens = Counter(
            "splitserve_cached_prompt_tokens", "Prompt tokens served by a prefix cache", registry=r
        )
        self.routed_prefix_tokens = Counter(
            "splitserve_routed_prefix_tokens",
            "Prompt tokens kv routing expected cached on the prefill instance it chose: served from that cache "
            "(outcome=served) or computed there after all (outcome=missed); and those another instance held "
            "beyond what the chosen one did (outcome=passed_over)",
            ["outcome"],
            registry=r,
        )
        self.generation_tokens = Counter("splitserve_generation_tokens", "Output tokens sent", registry=r)
        # Per request, at its end: the mean output length of the requests that ended in an
        # interval (the planner sizes decode by it), which tokens sent over requests ended is
        # not while streams start faster than they end.
        self.request_generation_tokens = Histogram(
            "splitserve_request_generation_tokens",
            "Output tokens of each request that finished (stop or length)",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.kv_transfer_bytes = Counter(
            "splitserve_kv_transfer_bytes", "KV bytes moved from prefill to decode", registry=r
        )
        self.kv_transfer_seconds = Histogram(
            "splitserve_kv_transfer_seconds", "Duration of one request's KV pull", buckets=_TRANSFER_BUCKETS, registry=r
        )
        self.kv_recomputes = Counter(
            "splitserve_kv_recomputes", "Hand-offs where decode recomputed the prompt", registry=r
        )
        self.kv_reprefills = Counter(
            "splitserve_kv_reprefills",
            "Hand-offs whose KV a decode instance could not pull, prefilled again",
            registry=r,
        )
        self.pd_decisions = Counter(
            "splitserve_pd_decision",
            "Where requests were prefilled (path: disaggregated on a P, or decode: on the D itself) and why "
            "(--disagg-min-prompt-tokens: short_prompt, cached_on_decode, uncached_prompt; always when it is 0)",
            ["path", "reason"],
            registry=r,
        )
        self.migrations = Counter(
            "splitserve_migrations",
            "Requests whose decode instance failed mid-stream: resumed on another one, or failed (exhausted: "
            "--max-migrations spent; unsupported: a structured output); handed_over: its draining decode "
            "instance handed it back and it resumed on another one",
            ["outcome"],
            registry=r,
        )
        self.rejected = Counter(
            "splitserve_requests_rejected",
            "Requests refused with 429 by the instance limits (queue delay, in-flight cap)",
            registry=r,
        )
        r.register(_InstanceCollector(pool))
        r.register(_RegistryCollector(pool))
        r.register(KVEventTrafficCollector(kv_event_traffic or KVEventTraffic()))
        self.recent = RecentLatencies()  # points in time for the status page (gateway/status.py)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Client-visible timings of one request, fed to the histograms as tokens go out, and the
    phases of its time to first token (``cluster/request_phases.py``), added up at that token."""

    __slots__ = (
        "metrics",
        "arrival",
        "dispatched_at",
        "call_sent_at",
        "answered_at",
        "first_token_at",
        "last_token_at",
        "num_gaps",
        "num_tokens",
        "phases",
        "_prefill_phases",
    )

    def __init__(self, metrics: GatewayMetrics, arrival: float | None = None) -> None:
        """``arrival``: when the request passed the gate (monotonic); default now."""
        self.metrics = metrics
        self.arrival = time.monotonic() if arrival is None else arrival
        self.dispatched_at: float | None = None
        # The call that brought the first token: sent, answered (cluster/request_phases.py).
        self.call_sent_at: float | None = None
        self.answered_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.num_gaps = 0  # inter-token gaps observed so far
        self.num_tokens = 0  # output tokens sent so far
        self.phases: RequestPhases | None = None  # from the first token on
        self._prefill_phases: RequestPhases | None = None  # the prefilling instance's, until then

    def dispatched(self) -> None:
        """The request leaves the gateway for its first instance."""
        self.dispatched_at = time.monotonic()
        self.metrics.queue.observe(self.dispatched_at - self.arrival)

    def call_answered(self, sent_at: float, answered_at: float) -> None:
        """A call to an instance first answered: before the first token, the call that brings it."""
        if self.first_token_at is None:
            self.call_sent_at, self.answered_at = sent_at, answered_at

    def instance_phases(self, phases: RequestPhases) -> None:
        """An instance's phases of its call: before the first token, the prefilling instance's;
        after it, the decode instance's hand-off (a migration's hand-off counts too)."""
        if self.first_token_at is None:
            self._prefill_phases = phases
            return
        for phase in HANDOFF_PHASES:
            self.metrics.handoff_phases.labels(phase=phase).observe(phase_seconds(phases, phase))
        if self.phases is not None:
            add_handoff(self.phases, phases)

    def tokens_sent(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.monotonic()
        if self.last_token_at is None:
            self.metrics.ttft.observe(now - self.arrival)
            self.metrics.recent.add_ttft(now - self.arrival)
            self.first_token_at = now
            # A first token no timed call brought (a dispatcher that times none): all after dispatch is transport.
            sent_at = self.call_sent_at if self.call_sent_at is not None else self.dispatched_at or self.arrival
            answered_at = self.answered_at if self.answered_at is not None else now
            self.phases = ttft_phases(self.arrival, sent_at, answered_at, now, self._prefill_phases)
            for phase in TTFT_PHASES:
                self.metrics.ttft_phases.labels(phase=phase).observe(phase_seconds(self.phases, phase))
            self.metrics.recent.add_phases(self.phases)
            num_gaps = num_tokens - 1
            gap = 0.0
        else:
            num_gaps, gap = num_tokens, (now - self.last_token_at) / num_tokens
        for _ in range(num_gaps):  # tokens that arrived together split the gap evenly
            self.metrics.itl.observe(gap)
        self.metrics.generation_tokens.inc(num_tokens)
        self.num_tokens += num_tokens
        self.last_token_at = now
        self.num_gaps += num_gaps

    def finished(self, status: str) -> None:
        self.metrics.requests.labels(status=status).inc()
        if status in ("stop", "length"):
            self.metrics.e2e.observe(time.monotonic() - self.arrival)
            self.metrics.request_generation_tokens.observe(self.num_tokens)
            if self.num_gaps and self.first_token_at is not None and self.last_token_at is not None:
                self.metrics.recent.add_itl((self.last_token_at - self.first_token_at) / self.num_gaps)

    def kv_transfer(self, transfer: disaggregation_pb2.KVTransfer) -> None:
        if transfer.recomputed:
            self.metrics.kv_recomputes.inc()
        else:
            self.metrics.kv_transfer_bytes.inc(transfer.num_bytes)
            self.metrics.kv_transfer_seconds.observe(transfer.seconds)


class _InstanceCollector(Collector):
    """Each known instance's latest load report, read at scrape time: every entry of
    cluster/instance_counters.py as ``splitserve_instance_<name>``, and what only this gateway
    knows of the instance (health as it routes, calls outstanding, requests routed, blocks indexed)."""

    def __init__(self, pool: InstancePool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["instance", "role", "address"]
        healthy_gauge = GaugeMetricFamily(
            "splitserve_instance_healthy", "1 if the gateway routes to this instance", labels=labels
        )
        inflight = GaugeMetricFamily(
            "splitserve_instance_inflight_calls", "Calls from this gateway outstanding on the instance", labels=labels
        )
        indexed = GaugeMetricFamily(
            "splitserve_instance_indexed_kv_blocks",
            "Prefix-cache blocks the gateway's index holds for the instance (kv routing)",
            labels=labels,
        )
        picked = CounterMetricFamily(
            "splitserve_instance_routed_requests", "Requests this gateway routed to the instance", labels=labels
        )
        # The instance's own counters reset when it restarts; Prometheus's rate() handles that.
        reported = [(counter, metric_family(counter, "splitserve_instance_", labels)) for counter in INSTANCE_COUNTERS]
        healthy = {id(s) for role in ROLES for s in self.pool.healthy(role)}
        for state in list(self.pool.instances.values()):
            instance = [state.instance_id, state.role, state.address]
            healthy_gauge.add_metric(instance, 1.0 if id(state) in healthy else 0.0)
            inflight.add_metric(instance, state.num_inflight)
            picked.add_metric(instance, state.num_picked)
            indexed.add_metric(instance, self.pool.index.num_cached_blocks(state.address))
            report = state.report
            if report is None:
                continue
            for counter, family in reported:
                for label_values, value in values(counter, report):
                    family.add_metric([*instance, *label_values], value)
        yield from (healthy_gauge, inflight, indexed, picked)
        yield from (family for _, family in reported)


class _RegistryCollector(Collector):
    """The Redis registry as the gateway sees it (nothing with a static instance list)."""

    def __init__(self, pool: InstancePool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        registry = self.pool.registry
        if registry is None:
            return
        yield GaugeMetricFamily(
            "splitserve_registry_reachable",
            "1 while the registry's scans succeed; 0 during an outage, when the gateway keeps the instances it "
            "knows on their own gRPC health and load reports",
            value=1.0 if registry.reachable else 0.0,
        )
        yield GaugeMetricFamily(
            "splitserve_registry_unreachable_seconds",
            "Seconds since the registry's outage under way began (0 while it answers)",
            value=registry.unreachable_for_s(),
        )
        refused = CounterMetricFamily(
            "splitserve_registry_records_refused",
            "Registry records ignored, by reason (unsigned, bad_signature, malformed, stale, future, invalid); "
            "counted at every scan that finds them",
            labels=["reason"],
        )
        for reason in REFUSAL_REASONS:
            refused.add_metric([reason], registry.num_refused[reason])
        yield refused
