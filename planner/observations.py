"""What the planner reads each interval, from the gateways' own ``/metrics`` (Prometheus text):
the traffic (requests dispatched, prompt and output tokens), the client-visible latencies
(TTFT, ITL and gateway queue histograms) and every instance as the gateway routes to it
(healthy, calls outstanding, and the instance's load report: waiting, running, KV blocks).

A :class:`Scrape` is one reading of one or more gateways (their counters and histogram
buckets summed; an instance healthy only if every gateway routes to it); an
:class:`Observation` is the difference of two scrapes over the interval between them. The
percentiles are read from the histograms' buckets as Prometheus's ``histogram_quantile`` does
(linear within the bucket), so they are as coarse as the buckets.
"""

from __future__ import annotations

import math
import socket
import time
import urllib.parse
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

TTFT = "splitserve_time_to_first_token_seconds"
ITL = "splitserve_inter_token_latency_seconds"
QUEUE = "splitserve_request_queue_time_seconds"
HISTOGRAMS = (TTFT, ITL, QUEUE)
PROMPT_TOKENS = "splitserve_prompt_tokens_total"
# Each finished request's output tokens, a histogram: its sum over its count is the mean output
# length of the requests that finished (tokens sent over requests ended is not, while streams
# start faster than they end).
OUTPUT_TOKENS_SUM = "splitserve_request_generation_tokens_sum"
OUTPUT_TOKENS_COUNT = "splitserve_request_generation_tokens_count"
FINISHED_REQUESTS = "splitserve_requests_total"  # summed over outcomes
_INSTANCE_GAUGES = {
    "splitserve_instance_healthy": "healthy",
    "splitserve_instance_inflight_calls": "inflight_calls",
    "splitserve_instance_num_waiting": "num_waiting",
    "splitserve_instance_num_running": "num_running",
    "splitserve_instance_free_kv_blocks": "free_blocks",
    "splitserve_instance_total_kv_blocks": "total_blocks",
}


@dataclass(slots=True)
class InstanceView:
    """One instance as the gateways see it: routed to (healthy), calls outstanding, and its
    latest load report."""

    instance_id: str
    role: str
    healthy: bool = True  # every gateway routes to it: ready
    routed: bool = False  # some gateway routes to it: not drained yet
    inflight_calls: int = 0  # summed over gateways
    num_waiting: int = 0
    num_running: int = 0
    free_blocks: int = 0
    total_blocks: int = 0

    @property
    def idle(self) -> bool:
        """Nothing here or on its way: no gateway routes to it nor has a call outstanding on it,
        and its report shows no request and every KV block free (none pinned for a pull)."""
        return (
            not self.routed
            and self.inflight_calls == 0
            and self.num_waiting == 0
            and self.num_running == 0
            and self.free_blocks == self.total_blocks
        )


@dataclass(slots=True)
class Scrape:
    at: float  # monotonic seconds
    counters: dict[str, float] = field(default_factory=dict)
    failed_requests: float = 0.0
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)  # histogram -> le -> cumulative count
    instances: dict[str, InstanceView] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Observation:
    """One interval's traffic and latencies, and the instances at its end."""

    interval_s: float
    request_rate: float  # requests dispatched to an instance a second
    prompt_tokens: float | None  # mean per request dispatched; None: none this interval
    output_tokens: float | None  # mean output tokens of the requests that finished; None: none did
    ttft_p90_s: float | None
    itl_p90_s: float | None
    queue_p90_s: float | None
    num_failed: int
    instances: dict[str, InstanceView]

    def role_instances(self, role: str) -> list[InstanceView]:
        return [view for view in self.instances.values() if view.role == role]

    def kv_usage(self, role: str) -> float:
        """Share of the role's KV blocks in use, over its instances together."""
        views = self.role_instances(role)
        total = sum(view.total_blocks for view in views)
        return 1 - sum(view.free_blocks for view in views) / total if total else 0.0

    def mean_batch(self, role: str) -> float:
        """Requests running per instance of the role."""
        views = self.role_instances(role)
        return sum(view.num_running for view in views) / len(views) if views else 0.0


def parse_metrics(texts: Iterable[str], at: float) -> Scrape:
    """One scrape from each gateway's ``/metrics`` text, summed."""
    scrape = Scrape(at)
    seen_by: dict[str, int] = {}
    num_texts = 0
    for text in texts:
        num_texts += 1
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name, labels, value = sample.name, sample.labels, sample.value
                if name in (PROMPT_TOKENS, OUTPUT_TOKENS_SUM, OUTPUT_TOKENS_COUNT, FINISHED_REQUESTS):
                    scrape.counters[name] = scrape.counters.get(name, 0.0) + value
                    if name == FINISHED_REQUESTS and _failed(labels.get("status", "")):
                        scrape.failed_requests += value
                elif name.endswith("_bucket") and name.removesuffix("_bucket") in HISTOGRAMS:
                    buckets = scrape.buckets.setdefault(name.removesuffix("_bucket"), {})
                    le = float(labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + value
                elif name in _INSTANCE_GAUGES and "instance" in labels:
                    _add_instance_gauge(scrape, seen_by, labels, _INSTANCE_GAUGES[name], value)
    # An instance one gateway has not found yet is not routed to by all of them.
    for instance_id, view in scrape.instances.items():
        if seen_by.get(instance_id, 0) < num_texts:
            view.healthy = False
    return scrape


def _failed(status: str) -> bool:
    """An outcome that is not a finish: ``error_<HTTP status>`` (gateway/generation.py) or an abort."""
    return status.startswith("error") or status == "abort"


def _add_instance_gauge(
    scrape: Scrape, seen_by: dict[str, int], labels: dict[str, str], attribute: str, value: float
) -> None:
    instance_id = labels["instance"]
    view = scrape.instances.get(instance_id)
    if view is None:
        view = scrape.instances[instance_id] = InstanceView(instance_id, labels.get("role", ""))
    if attribute == "healthy":
        seen_by[instance_id] = seen_by.get(instance_id, 0) + 1
        view.healthy = view.healthy and value >= 1
        view.routed = view.routed or value >= 1
    elif attribute == "inflight_calls":
        view.inflight_calls += int(value)
    else:  # the instance's own report: the same whichever gateway relays it
        setattr(view, attribute, int(value))


def histogram_quantile(quantile: float, before: dict[float, float], after: dict[float, float]) -> float | None:
    """The ``quantile`` of what a histogram counted between two scrapes, linear within its
    bucket as Prometheus interpolates; None when it counted nothing. Past the last finite
    bound it answers that bound (the histogram knows no more)."""
    bounds = sorted(after)
    counts = [after[le] - before.get(le, 0.0) for le in bounds]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None
    rank = quantile * total
    lower_bound, lower_count = 0.0, 0.0
    for le, count in zip(bounds, counts):
        if count >= rank:
            if math.isinf(le):
                return lower_bound
            if count == lower_count:
                return le
            return lower_bound + (le - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = le, count
    return lower_bound


def observe(before: Scrape, after: Scrape) -> Observation:
    """The interval between two scrapes."""
    interval_s = max(after.at - before.at, 1e-9)

    def delta(name: str) -> float:
        return max(0.0, after.counters.get(name, 0.0) - before.counters.get(name, 0.0))

    dispatched = _histogram_count(after, before, QUEUE)
    finished = delta(OUTPUT_TOKENS_COUNT)
    return Observation(
        interval_s=interval_s,
        request_rate=dispatched / interval_s,
        prompt_tokens=delta(PROMPT_TOKENS) / dispatched if dispatched else None,
        output_tokens=delta(OUTPUT_TOKENS_SUM) / finished if finished else None,
        ttft_p90_s=_p90(before, after, TTFT),
        itl_p90_s=_p90(before, after, ITL),
        queue_p90_s=_p90(before, after, QUEUE),
        num_failed=int(max(0.0, after.failed_requests - before.failed_requests)),
        instances=after.instances,
    )


def _histogram_count(after: Scrape, before: Scrape, name: str) -> float:
    bucket_after = after.buckets.get(name, {}).get(math.inf, 0.0)
    return max(0.0, bucket_after - before.buckets.get(name, {}).get(math.inf, 0.0))


def _p90(before: Scrape, after: Scrape, name: str) -> float | None:
    return histogram_quantile(0.9, before.buckets.get(name, {}), after.buckets.get(name, {}))


class GatewayScraper:
    """Reads the gateways' ``/metrics`` over HTTP, blocking (the planner's loop is a thread of
    its own). A gateway that does not answer raises OSError (urllib's URLError is one).

    ``every_address``: each URL's host names every gateway (a Kubernetes headless Service, one
    address per ready pod), resolved again at each scrape so that replicas come and go; each
    address is read. A Service with one address would show one replica's counters at a time."""

    def __init__(self, gateway_urls: Sequence[str], timeout_s: float = 5.0, every_address: bool = False) -> None:
        if not gateway_urls:
            raise ValueError("the planner needs at least one --gateway-url to read metrics from")
        self.gateway_urls = [url.rstrip("/") for url in gateway_urls]
        self.timeout_s = timeout_s
        self.every_address = every_address

    def urls(self) -> list[str]:
        """The gateways to read now."""
        if not self.every_address:
            return self.gateway_urls
        urls = []
        for url in self.gateway_urls:
            parts = urllib.parse.urlsplit(url)
            if parts.hostname is None:
                raise ValueError(f"--gateway-url {url} names no host")
            port = parts.port or (443 if parts.scheme == "https" else 80)
            infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
            addresses = sorted({str(info[4][0]) for info in infos})
            for address in addresses:
                host = f"[{address}]" if ":" in address else address
                urls.append(urllib.parse.urlunsplit(parts._replace(netloc=f"{host}:{port}")))
        return urls

    def scrape(self) -> Scrape:
        texts = []
        for url in self.urls():
            with urllib.request.urlopen(f"{url}/metrics", timeout=self.timeout_s) as response:
                texts.append(response.read().decode())
        return parse_metrics(texts, time.monotonic())

    def close(self) -> None:
        """Nothing held between scrapes; kept so callers close what they open."""
