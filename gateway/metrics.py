"""The gateway's Prometheus metrics (``GET /metrics``): request latencies as the
client sees them, request and token counts, KV hand-off volume, and each
instance's latest load report."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.instances import ROLES, InstancePool
from gateway.status import RecentLatencies
from splitserve.v1 import disaggregation_pb2

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
_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class GatewayMetrics:
    def __init__(self, pool: InstancePool) -> None:
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
        self.requests = Counter("splitserve_requests", "Finished requests by outcome", ["status"], registry=r)
        self.prompt_tokens = Counter("splitserve_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.cached_prompt_tokens = Counter(
            "splitserve_cached_prompt_tokens", "Prompt tokens served by a prefix cache", registry=r
        )
        self.generation_tokens = Counter("splitserve_generation_tokens", "Output tokens sent", registry=r)
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
            "--max-migrations spent; "
            "unsupported: a structured output)",
            ["outcome"],
            registry=r,
        )
        self.rejected = Counter(
            "splitserve_requests_rejected",
            "Requests refused with 429 by admission control (queue delay, in-flight cap)",
            registry=r,
        )
        r.register(_InstanceCollector(pool))
        self.recent = RecentLatencies()  # points in time for the status page (gateway/status.py)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Client-visible timings of one request, fed to the histograms as tokens go out."""

    __slots__ = ("metrics", "arrival", "first_token_at", "last_token_at", "num_gaps")

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.num_gaps = 0  # inter-token gaps observed so far

    def tokens_sent(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.monotonic()
        if self.last_token_at is None:
            self.metrics.ttft.observe(now - self.arrival)
            self.metrics.recent.add_ttft(now - self.arrival)
            self.first_token_at = now
            num_gaps = num_tokens - 1
            gap = 0.0
        else:
            num_gaps, gap = num_tokens, (now - self.last_token_at) / num_tokens
        for _ in range(num_gaps):  # tokens that arrived together split the gap evenly
            self.metrics.itl.observe(gap)
        self.metrics.generation_tokens.inc(num_tokens)
        self.last_token_at = now
        self.num_gaps += num_gaps

    def finished(self, status: str) -> None:
        self.metrics.requests.labels(status=status).inc()
        if status in ("stop", "length"):
            self.metrics.e2e.observe(time.monotonic() - self.arrival)
            if self.num_gaps and self.first_token_at is not None and self.last_token_at is not None:
                self.metrics.recent.add_itl((self.last_token_at - self.first_token_at) / self.num_gaps)

    def kv_transfer(self, transfer: disaggregation_pb2.KVTransfer) -> None:
        if transfer.recomputed:
            self.metrics.kv_recomputes.inc()
        else:
            self.metrics.kv_transfer_bytes.inc(transfer.num_bytes)
            self.metrics.kv_transfer_seconds.observe(transfer.seconds)


class _InstanceCollector(Collector):
    """Each known instance's latest load report, read at scrape time."""

    def __init__(self, pool: InstancePool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["instance", "role", "address"]
        gauges = {
            "healthy": GaugeMetricFamily(
                "splitserve_instance_healthy", "1 if the gateway routes to this instance", labels=labels
            ),
            "waiting": GaugeMetricFamily(
                "splitserve_instance_num_waiting", "Requests waiting on the instance", labels=labels
            ),
            "running": GaugeMetricFamily(
                "splitserve_instance_num_running", "Requests running on the instance", labels=labels
            ),
            "free": GaugeMetricFamily("splitserve_instance_free_kv_blocks", "Free KV blocks", labels=labels),
            "total": GaugeMetricFamily("splitserve_instance_total_kv_blocks", "Total KV blocks", labels=labels),
            "hit": GaugeMetricFamily(
                "splitserve_instance_prefix_cache_hit_rate", "Prefix-cache hit rate since start", labels=labels
            ),
            "bytes": GaugeMetricFamily(
                "splitserve_instance_kv_transfer_bytes", "KV bytes pulled by this instance since start", labels=labels
            ),
            "seconds": GaugeMetricFamily(
                "splitserve_instance_kv_transfer_seconds", "Seconds spent pulling KV since start", labels=labels
            ),
            "pending": GaugeMetricFamily(
                "splitserve_instance_pending_prefill_tokens",
                "Prompt tokens queued or mid-prefill on the instance",
                labels=labels,
            ),
            "rate": GaugeMetricFamily(
                "splitserve_instance_prefill_tokens_per_second",
                "Prompt tokens per second over the instance's recent steps",
                labels=labels,
            ),
            "inflight": GaugeMetricFamily(
                "splitserve_instance_inflight_calls",
                "Calls from this gateway outstanding on the instance",
                labels=labels,
            ),
            "indexed": GaugeMetricFamily(
                "splitserve_instance_indexed_kv_blocks",
                "Prefix-cache blocks the gateway's index holds for the instance (kv routing)",
                labels=labels,
            ),
            "acceptance": GaugeMetricFamily(
                "splitserve_instance_spec_acceptance_rate",
                "Speculative decoding: accepted over verified draft tokens since start",
                labels=labels,
            ),
        }
        picked = CounterMetricFamily(
            "splitserve_instance_routed_requests", "Requests this gateway routed to the instance", labels=labels
        )
        # The instance's own event counts since it started: counters, though they reset with it.
        counters = {
            name: CounterMetricFamily(f"splitserve_instance_{name}", help_text, labels=labels)
            for name, help_text in _INSTANCE_COUNTERS.items()
        }
        healthy = {id(s) for role in ROLES for s in self.pool.healthy(role)}
        for state in list(self.pool.instances.values()):
            values = [state.instance_id, state.role, state.address]
            gauges["healthy"].add_metric(values, 1.0 if id(state) in healthy else 0.0)
            picked.add_metric(values, state.num_picked)
            gauges["indexed"].add_metric(values, self.pool.index.num_cached_blocks(state.address))
            report = state.report
            if report is None:
                continue
            gauges["waiting"].add_metric(values, report.num_waiting)
            gauges["running"].add_metric(values, report.num_running)
            gauges["free"].add_metric(values, report.num_free_blocks)
            gauges["total"].add_metric(values, report.num_total_blocks)
            gauges["hit"].add_metric(values, report.prefix_cache_hit_rate)
            gauges["bytes"].add_metric(values, report.kv_transfer_bytes)
            gauges["seconds"].add_metric(values, report.kv_transfer_seconds)
            gauges["pending"].add_metric(values, report.num_pending_prefill_tokens)
            gauges["rate"].add_metric(values, report.prefill_tokens_per_s)
            gauges["inflight"].add_metric(values, state.num_inflight)
            num_drafts = report.counters.num_spec_draft_tokens
            gauges["acceptance"].add_metric(
                values, report.counters.num_spec_accepted_tokens / num_drafts if num_drafts else 0.0
            )
            for name, counter in counters.items():
                counter.add_metric(values, getattr(report.counters, f"num_{name}"))
        yield from gauges.values()
        yield from counters.values()
        yield picked


_INSTANCE_COUNTERS = {
    "preemptions": "Running requests sent back to wait for lack of KV blocks (their KV recomputed later)",
    "lease_renewals": "Prefill: KV leases a decode instance renewed",
    "lease_expiries": "Prefill: pinned KV freed because nobody released or renewed it",
    "pulls_cut_off": "Prefill: KV pulls still reading blocks when those were unpinned",
    "kv_pull_failures": "Decode: KV pulls that failed",
    "kv_recomputes": "Decode: prompts recomputed locally after a failed pull",
    "kv_handbacks": "Decode: requests handed back to the gateway to prefill again",
    "kv_handles_refused": "Decode: calls refused for a KV handle that is unsigned or altered (docs/security.md)",
    "local_prefills": "Decode: calls prefilled on the decode instance itself (conditional disaggregation)",
    "spec_draft_tokens": "Speculative decoding: draft tokens the instance verified",
    "spec_accepted_tokens": "Speculative decoding: draft tokens the target accepted (each one a token gained)",
}
