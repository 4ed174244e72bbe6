"""An instance's own Prometheus endpoint (``--metrics-port``): its queue, KV use, step time,
KV transfers and event counters, one series ``splitserve_engine_<name>`` for each entry of
``cluster/instance_counters.py``, read at scrape time from the instance's load report, so a
scrape never waits for an engine step; and the phases of the requests it served
(``splitserve_engine_phase_seconds``, :class:`PhaseMetrics`); and the gRPC calls its server
received, by method (``splitserve_engine_grpc_calls_total``, ``cluster/call_counts.py``), with
what its cluster-secret check refused and remembers (``cluster/auth.py``).

The gateway's ``/metrics`` shows the same load report as it last polled it
(``splitserve_instance_<name>``, the same table); this endpoint is the instance's word, scraped
directly, and it keeps answering while the gateway is down or has dropped the instance.

Path of a scrape: prometheus_client's HTTP server thread calls ``InstanceCollector.collect``,
which calls ``Instance.load_report``: that reads ``AsyncEngine.latest_load_report`` (a snapshot
the engine thread replaces after each step) and the instance's plain counters; nothing is
locked, nothing is awaited.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cluster.instance_counters import INSTANCE_COUNTERS, metric_family, values
from cluster.internal_grpc import InternalPlane
from cluster.request_phases import PHASE_BUCKETS, Phase, phase_seconds
from serving.metrics_http import BoundedWSGIServer, start_metrics_http_server
from splitserve.v1 import disaggregation_pb2
from splitserve.v1.generation_pb2 import RequestPhases

logger = logging.getLogger(__name__)


class InstanceCollector(Collector):
    """Every instance counter of one load report, labelled with the instance and its role."""

    def __init__(self, load_report: Callable[[], disaggregation_pb2.LoadReport]) -> None:
        self.load_report = load_report

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        report = self.load_report()
        labels = {"instance": report.instance_id, "role": report.role}
        for counter in INSTANCE_COUNTERS:
            family = metric_family(counter, "splitserve_engine_", list(labels))
            for label_values, value in values(counter, report):
                family.add_metric([*labels.values(), *label_values], value)
            yield family


class CallCountCollector(Collector):
    """The calls an instance's gRPC server received, one series per method; with a cluster
    secret, the calls its check refused and the nonces it remembers against replays."""

    def __init__(self, plane: InternalPlane, instance_id: str, role: str) -> None:
        self.plane = plane
        self._labels = [instance_id, role]

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        labels = ["instance", "role"]
        family = CounterMetricFamily(
            "splitserve_engine_grpc_calls",
            "gRPC calls this instance's server received since start, by method (refused ones too)",
            labels=[*labels, "method"],
        )
        for method, num_calls in sorted(self.plane.call_counts.snapshot().items()):
            family.add_metric([*self._labels, method], num_calls)
        yield family
        if (checks := self.plane.credential_check_counts()) is None:
            return
        num_refused, num_remembered = checks
        refused = CounterMetricFamily(
            "splitserve_engine_grpc_calls_refused",
            "Calls refused since start for a missing, stale, replayed or foreign cluster credential",
            labels=labels,
        )
        refused.add_metric(self._labels, num_refused)
        yield refused
        remembered = GaugeMetricFamily(
            "splitserve_engine_call_nonces_remembered",
            "Nonces of accepted calls remembered to refuse replays (those of the last window, at most the cap)",
            labels=labels,
        )
        remembered.add_metric(self._labels, num_remembered)
        yield remembered


class PhaseMetrics:
    """This instance's phases of the requests it served (``serving/request_timing.py``), one
    histogram series per phase; the servicers observe each call's once, at its first output."""

    def __init__(self, instance_id: str, role: str) -> None:
        self.registry = CollectorRegistry()  # this instance's endpoint serves it (MetricsServer)
        self._labels = (instance_id, role)
        self._seconds = Histogram(
            "splitserve_engine_phase_seconds",
            "Seconds of each phase of the requests this instance served (prefill_queue, prefill_compute and "
            "kv_publish on a prefill instance; decode_queue, kv_pull and first_decode_step for a hand-off)",
            ["instance", "role", "phase"],
            buckets=PHASE_BUCKETS,
            registry=self.registry,
        )

    def observe(self, phases: RequestPhases, names: tuple[Phase, ...]) -> None:
        for name in names:
            self._seconds.labels(*self._labels, name).observe(phase_seconds(phases, name))


class MetricsServer:
    """prometheus_client's WSGI app on a bounded HTTP server of its own thread, serving only this
    instance's registry."""

    def __init__(
        self,
        load_report: Callable[[], disaggregation_pb2.LoadReport],
        name: str,
        host: str,
        port: int,
        registry: CollectorRegistry | None = None,
        plane: InternalPlane | None = None,
    ) -> None:
        """``load_report``: the instance's (read at each scrape); ``name``: how the log names it;
        ``registry``: what else the endpoint serves (``PhaseMetrics.registry``); ``plane``: its
        gRPC server's, whose call counts and credential check are exported when given."""
        registry = registry or CollectorRegistry()
        registry.register(InstanceCollector(load_report))
        if plane is not None:
            report = load_report()
            registry.register(CallCountCollector(plane, report.instance_id, report.role))
        self._server: BoundedWSGIServer
        self._thread: threading.Thread
        # Connections capped and given a deadline (serving/metrics_http.py): the port is open to all.
        self._server, self._thread = start_metrics_http_server(host, port, registry)
        self.port = self._server.server_port
        logger.info("%s: Prometheus metrics on http://%s:%d/metrics", name, host, self.port)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
