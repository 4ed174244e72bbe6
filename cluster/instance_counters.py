"""Every number an instance reports about itself, listed once: its series name, kind, unit,
help text, where the instance reads it, which load-report field carries it, and whether the
status page shows it.

Each place that lists instance counters derives from ``INSTANCE_COUNTERS``:

1. ``serving.instance.Instance.load_report`` fills the ``LoadReport`` message (and its
   ``InstanceCounters``) with :func:`fill_load_report`, from the sources named here: the
   engine's ``engine.load_report.EngineLoad`` snapshot, the servicer's ``ServiceCounters``,
   the ``TransferCounters`` of KV pulls, and the KV connector.
2. The instance's own ``/metrics`` (``serving/metrics.py``) reads that message and exports
   each entry as ``splitserve_engine_<name>``.
3. A gateway polls the message (or reads it from the registry) and exports each entry per
   instance as ``splitserve_instance_<name>`` (``gateway/metrics.py``), beside what only the
   gateway knows of the instance (its health as routed, calls in flight, requests routed).
4. The status page (``gateway/status.py``) sends the entries with a ``status_label`` and the
   page draws one column for each.

The .proto is static, so ``tests/cluster/test_instance_counters.py`` keeps it and the table
in line: every entry has its field and every load field has its entry. Derived entries (KV
use, acceptance rate, up) are computed here once, from the message's other fields. An entry
``per`` an index (a repeated field: speculative decoding by draft position) is one series per
index, labelled with it; :func:`values` reads any entry's series.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from splitserve.v1 import disaggregation_pb2

Kind = Literal["counter", "gauge"]  # counter: a running total since the instance started
Unit = Literal[
    "boolean",
    "requests",
    "calls",
    "blocks",
    "tokens",
    "tokens/s",
    "steps",
    "pulls",
    "connections",
    "leases",
    "seconds",
    "bytes",
    "ratio",
]
# engine: engine.load_report.EngineLoad; service: serving.instance.ServiceCounters;
# transfers: serving.instance.TransferCounters; connector: kv_connector.base.KVConnector.
Source = Literal["engine", "service", "transfers", "connector"]
LoadReport = disaggregation_pb2.LoadReport


@dataclass(frozen=True, slots=True)
class InstanceCounter:
    """One series: either reported (``field`` and ``source`` set: the instance copies the
    source's attribute into the load report's field) or derived (``derive`` set: computed
    from the report's other fields wherever it is read)."""

    name: str  # series name after its prefix: splitserve_engine_<name>, splitserve_instance_<name>
    kind: Kind
    unit: Unit
    help: str
    field: str | None = None  # the LoadReport field that carries it; "counters.x": in InstanceCounters
    source: tuple[Source, str] | None = None  # (source, attribute) Instance.load_report reads
    derive: Callable[[LoadReport], float] | None = None
    status_label: str | None = None  # the status page's column header; None: not on the page
    per: str | None = None  # a repeated field: one series per index, this label naming it

    def __post_init__(self) -> None:
        reported = self.field is not None and self.source is not None and self.derive is None
        derived = self.field is None and self.source is None and self.derive is not None
        if not (reported or derived):
            raise RuntimeError(f"instance counter {self.name}: give field and source, or derive (a bug in the table)")
        if self.per is not None and (self.derive is not None or self.status_label is not None):
            raise RuntimeError(f"instance counter {self.name}: a series per index is reported, off the page (a bug)")


def kv_usage(report: LoadReport) -> float:
    used = report.num_total_blocks - report.num_free_blocks
    return used / report.num_total_blocks if report.num_total_blocks else 0.0


def spec_acceptance_rate(report: LoadReport) -> float:
    drafts = report.counters.num_spec_draft_tokens
    return report.counters.num_spec_accepted_tokens / drafts if drafts else 0.0


def engine_up(report: LoadReport) -> float:
    return 0.0 if report.engine_error else 1.0


def _gauge(
    name: str, unit: Unit, help: str, field: str, source: tuple[Source, str], status_label: str | None = None
) -> InstanceCounter:
    return InstanceCounter(name, "gauge", unit, help, field=field, source=source, status_label=status_label)


def _counter(
    name: str, unit: Unit, help: str, field: str, source: tuple[Source, str], per: str | None = None
) -> InstanceCounter:
    return InstanceCounter(name, "counter", unit, help, field=field, source=source, per=per)


def _derived(
    name: str, unit: Unit, help: str, derive: Callable[[LoadReport], float], status_label: str | None = None
) -> InstanceCounter:
    return InstanceCounter(name, "gauge", unit, help, derive=derive, status_label=status_label)


# Names are the series names dashboards (compose/grafana) and alerts query: keep them.
# fmt: off
INSTANCE_COUNTERS: tuple[InstanceCounter, ...] = (
    # name, unit, help, load-report field, (source, attribute)
    _derived("up", "boolean", "1 while the engine's step loop runs", engine_up),
    _gauge("num_waiting", "requests", "Requests waiting (queued, or holding a KV handle)",
           "num_waiting", ("engine", "num_waiting"), status_label="waiting"),
    _gauge("num_running", "requests", "Requests running",
           "num_running", ("engine", "num_running"), status_label="running"),
    _gauge("free_kv_blocks", "blocks", "Free KV blocks", "num_free_blocks", ("engine", "num_free_blocks")),
    _gauge("total_kv_blocks", "blocks", "KV blocks in all", "num_total_blocks", ("engine", "num_total_blocks")),
    _derived("kv_usage", "ratio", "Share of KV blocks in use, 0 to 1", kv_usage, status_label="KV use"),
    _gauge("pending_prefill_tokens", "tokens", "Prompt tokens queued or mid-prefill",
           "num_pending_prefill_tokens", ("engine", "num_pending_prefill_tokens")),
    _gauge("prefill_tokens_per_second", "tokens/s", "Prompt tokens per second over recent steps (0 until measured)",
           "prefill_tokens_per_s", ("engine", "prefill_tokens_per_s")),
    _gauge("prefix_cache_hit_rate", "ratio", "Prefix-cache hit rate since start",
           "prefix_cache_hit_rate", ("engine", "prefix_cache_hit_rate")),
    _counter("steps", "steps", "Engine steps that ran the model",
             "counters.num_steps", ("engine", "num_steps")),
    _counter("step_seconds", "seconds", "Model time of those steps (mean step time: rate of this over rate of steps)",
             "counters.step_seconds", ("engine", "step_seconds")),
    _counter("preemptions", "requests",
             "Running requests sent back to wait for lack of KV blocks (their KV recomputed later)",
             "counters.num_preemptions", ("engine", "num_preemptions")),
    _counter("kv_transfers", "pulls", "Decode: KV pulls this instance made",
             "kv_transfers", ("transfers", "num_transfers")),
    _counter("kv_transfer_bytes", "bytes", "Decode: KV bytes this instance pulled",
             "kv_transfer_bytes", ("transfers", "num_bytes")),
    _counter("kv_transfer_seconds", "seconds", "Decode: seconds this instance spent pulling KV",
             "kv_transfer_seconds", ("transfers", "seconds")),
    _counter("lease_renewals", "leases", "Prefill: KV leases a decode instance renewed",
             "counters.num_lease_renewals", ("service", "num_lease_renewals")),
    _counter("lease_expiries", "leases", "Prefill: pinned KV freed because nobody released or renewed it",
             "counters.num_lease_expiries", ("service", "num_lease_expiries")),
    _gauge("kv_transfers_in_flight", "pulls", "KV pulls being served (prefill) or made (decode) now",
           "num_kv_transfers_in_flight", ("connector", "num_transfers_in_flight")),
    _gauge("kv_connections", "connections",
           "KV connections held open now (prefill: from decode instances; decode: kept for the next pull)",
           "num_kv_connections", ("connector", "num_connections")),
    _counter("pulls_cut_off", "pulls", "Prefill: KV pulls still reading blocks when those were unpinned",
             "counters.num_pulls_cut_off", ("connector", "num_pulls_cut_off")),
    _counter("kv_pull_failures", "pulls", "Decode: KV pulls that failed",
             "counters.num_kv_pull_failures", ("service", "num_kv_pull_failures")),
    _counter("kv_recomputes", "requests", "Decode: prompts recomputed locally after a failed pull",
             "counters.num_kv_recomputes", ("service", "num_kv_recomputes")),
    _counter("kv_handbacks", "requests", "Decode: requests handed back to the gateway to prefill again",
             "counters.num_kv_handbacks", ("service", "num_kv_handbacks")),
    _counter("kv_handles_refused", "calls",
             "Decode: calls refused for a KV handle that is unsigned or altered (docs/security.md)",
             "counters.num_kv_handles_refused", ("service", "num_kv_handles_refused")),
    _counter("local_prefills", "calls",
             "Decode: calls prefilled on the decode instance itself (conditional disaggregation)",
             "counters.num_local_prefills", ("service", "num_local_prefills")),
    _counter("handovers", "requests",
             "Decode: streams a draining instance handed back to their gateways to resume on another (SIGUSR2)",
             "counters.num_handovers", ("service", "num_handovers")),
    _counter("spec_draft_tokens", "tokens", "Speculative decoding: draft tokens the instance verified",
             "counters.num_spec_draft_tokens", ("engine", "num_spec_draft_tokens")),
    _counter("spec_accepted_tokens", "tokens",
             "Speculative decoding: draft tokens the target accepted (each one a token gained)",
             "counters.num_spec_accepted_tokens", ("engine", "num_spec_accepted_tokens")),
    _derived("spec_acceptance_rate", "ratio", "Speculative decoding: accepted over verified draft tokens since start",
             spec_acceptance_rate),
    _counter("spec_draft_tokens_per_pos", "tokens",
             "Speculative decoding: draft tokens verified at each position of their chain (0: the first draft)",
             "counters.num_spec_draft_tokens_per_pos", ("engine", "num_spec_draft_tokens_per_pos"), per="position"),
    _counter("spec_accepted_tokens_per_pos", "tokens",
             "Speculative decoding: draft tokens accepted at each position (accepted only if all before it were)",
             "counters.num_spec_accepted_tokens_per_pos", ("engine", "num_spec_accepted_tokens_per_pos"),
             per="position"),
    _counter("spec_verifications_by_accepted", "calls",
             "Speculative decoding: verifications (one request's drafts in one step) that accepted exactly n drafts",
             "counters.num_spec_verifications_by_accepted", ("engine", "num_spec_verifications_by_accepted"),
             per="accepted"),
)
# fmt: on

STATUS_PAGE_COUNTERS = tuple(counter for counter in INSTANCE_COUNTERS if counter.status_label is not None)


def _message_and_name(report: LoadReport, field: str) -> tuple[LoadReport | disaggregation_pb2.InstanceCounters, str]:
    """The message that holds ``field`` (the report, or its counters) and the field's name there."""
    if field.startswith("counters."):
        return report.counters, field.removeprefix("counters.")
    return report, field


def read(counter: InstanceCounter, report: LoadReport) -> float:
    """The counter's value in a load report (one series: not an entry ``per`` an index)."""
    if counter.derive is not None:
        return counter.derive(report)
    if counter.field is None or counter.per is not None:
        raise RuntimeError(f"instance counter {counter.name} has no single value (a bug in the caller)")
    message, name = _message_and_name(report, counter.field)
    return float(getattr(message, name))


def values(counter: InstanceCounter, report: LoadReport) -> list[tuple[list[str], float]]:
    """The counter's series in a load report: (label values beyond the instance's, value) each;
    one series with no label of its own, or one per index labelled with it."""
    if counter.per is None or counter.field is None:
        return [([], read(counter, report))]
    message, name = _message_and_name(report, counter.field)
    return [([str(index)], float(value)) for index, value in enumerate(getattr(message, name))]


def fill_load_report(report: LoadReport, sources: Mapping[Source, object | None]) -> None:
    """Copy every reported counter from its source into ``report``. A source that is None (a
    colocated instance has no connector) reports 0."""
    for counter in INSTANCE_COUNTERS:
        if counter.field is None or counter.source is None:
            continue
        source, attribute = counter.source
        holder = sources[source]
        message, name = _message_and_name(report, counter.field)
        if counter.per is not None:
            getattr(message, name).extend(getattr(holder, attribute) if holder is not None else ())
        else:
            setattr(message, name, getattr(holder, attribute) if holder is not None else 0)


def metric_family(counter: InstanceCounter, prefix: str, labels: list[str]) -> CounterMetricFamily | GaugeMetricFamily:
    """An empty Prometheus family for the counter, named ``<prefix><name>``, labelled by
    ``labels`` and, for an entry per index, that index's label."""
    family = CounterMetricFamily if counter.kind == "counter" else GaugeMetricFamily
    return family(f"{prefix}{counter.name}", counter.help, labels=[*labels, *([counter.per] if counter.per else [])])
