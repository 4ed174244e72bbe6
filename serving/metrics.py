"""An instance's own Prometheus endpoint (``--metrics-port``): its queue, KV use, step time,
KV transfers and event counters, read at scrape time from the engine's latest load snapshot
and the servicer's counters, so a scrape never waits for an engine step.

The gateway's ``/metrics`` shows the same load as it last polled it
(``splitserve_instance_*``); this endpoint is the instance's word, scraped directly, and it
keeps answering while the gateway is down or has dropped the instance.

Path of a scrape: prometheus_client's HTTP server thread calls ``InstanceCollector.collect``,
which reads ``AsyncEngine.latest_load_report`` (a snapshot the engine thread replaces after
each step) and the instance's plain counters; nothing is locked, nothing is awaited.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from serving.instance import Instance

logger = logging.getLogger(__name__)


class InstanceCollector(Collector):
    def __init__(self, instance: Instance) -> None:
        self.instance = instance

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        instance = self.instance
        labels = {"instance": instance.instance_id, "role": instance.role}
        names, values = list(labels), list(labels.values())

        def gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"splitserve_engine_{name}", help_text, labels=names)
            family.add_metric(values, value)
            return family

        def counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"splitserve_engine_{name}", help_text, labels=names)
            family.add_metric(values, value)
            return family

        report = instance.engine.latest_load_report()
        used = report.num_total_blocks - report.num_free_blocks
        counters = instance.counters
        yield gauge("up", "1 while the engine's step loop runs", 0.0 if instance.engine_error else 1.0)
        yield gauge("num_waiting", "Requests waiting (queued, or holding a KV handle)", report.num_waiting)
        yield gauge("num_running", "Requests running", report.num_running)
        yield gauge("free_kv_blocks", "Free KV blocks", report.num_free_blocks)
        yield gauge("total_kv_blocks", "KV blocks in all", report.num_total_blocks)
        yield gauge(
            "kv_usage",
            "Share of KV blocks in use, 0 to 1",
            used / report.num_total_blocks if report.num_total_blocks else 0.0,
        )
        yield gauge("pending_prefill_tokens", "Prompt tokens queued or mid-prefill", report.num_pending_prefill_tokens)
        yield gauge(
            "prefill_tokens_per_second", "Prompt tokens per second over recent steps", report.prefill_tokens_per_s
        )
        yield gauge("prefix_cache_hit_rate", "Prefix-cache hit rate since start", report.prefix_cache_hit_rate)
        yield counter("steps", "Engine steps that ran the model", report.num_steps)
        yield counter(
            "step_seconds",
            "Model time of those steps (mean step time: rate of this over rate of steps)",
            report.step_seconds,
        )
        yield counter("preemptions", "Running requests sent back to wait for lack of KV blocks", report.num_preemptions)
        yield counter("spec_draft_tokens", "Speculative decoding: draft tokens verified", report.num_spec_draft_tokens)
        yield counter(
            "spec_accepted_tokens", "Speculative decoding: draft tokens accepted", report.num_spec_accepted_tokens
        )
        yield gauge(
            "spec_acceptance_rate",
            "Speculative decoding: accepted over verified drafts since start",
            report.spec_acceptance_rate,
        )
        yield counter("kv_transfers", "KV pulls this instance made (decode)", instance.transfers.num_transfers)
        yield counter("kv_transfer_bytes", "KV bytes this instance pulled (decode)", instance.transfers.num_bytes)
        yield counter(
            "kv_transfer_seconds", "Seconds this instance spent pulling KV (decode)", instance.transfers.seconds
        )
        yield counter("lease_renewals", "KV leases a decode instance renewed (prefill)", counters.num_lease_renewals)
        yield counter(
            "lease_expiries",
            "Pinned KV freed because nobody released or renewed it (prefill)",
            counters.num_lease_expiries,
        )
        pulls_cut_off = instance.connector.num_pulls_cut_off if instance.connector is not None else 0
        yield counter(
            "pulls_cut_off", "KV pulls still reading blocks when those were unpinned (prefill)", pulls_cut_off
        )
        yield counter("kv_pull_failures", "KV pulls that failed (decode)", counters.num_kv_pull_failures)
        yield counter(
            "kv_recomputes", "Prompts recomputed locally after a failed pull (decode)", counters.num_kv_recomputes
        )
        yield counter(
            "kv_handbacks", "Requests handed back to the gateway to prefill again (decode)", counters.num_kv_handbacks
        )
        yield counter(
            "kv_handles_refused",
            "Calls refused for an unsigned or altered KV handle (decode)",
            counters.num_kv_handles_refused,
        )


class MetricsServer:
    """prometheus_client's HTTP server on its own thread, serving only this instance's registry."""

    def __init__(self, instance: Instance, host: str, port: int) -> None:
        registry = CollectorRegistry()
        registry.register(InstanceCollector(instance))
        self._server: WSGIServer
        self._thread: threading.Thread
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.port = self._server.server_port
        logger.info(
            "%s %s: Prometheus metrics on http://%s:%d/metrics", instance.role, instance.instance_id, host, self.port
        )

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
