"""cluster/instance_counters.py is the one list of instance counters, and every place that
shows them follows it: the proto has a field for each reported counter and a counter for each
load field; each source attribute (the engine's load report, ServiceCounters,
TransferCounters, the connector) has its counter; ``Instance.load_report`` fills every one from
its source; and each counter reaches the instance's /metrics, the gateway's /metrics for that
instance, and, where the table says so, the status page's data, with the table's kind and help.

One instance with a distinct value in every source, so that a counter dropped, or read from the
wrong source, anywhere on the way shows as a wrong or missing value."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from types import SimpleNamespace

import pytest
import torch
from google.protobuf.descriptor import FieldDescriptor
from prometheus_client import CollectorRegistry, generate_latest

from cluster.instance_counters import INSTANCE_COUNTERS, STATUS_PAGE_COUNTERS, InstanceCounter, values
from engine.load_report import EngineLoad
from gateway.instances import InstancePool
from gateway.metrics import GatewayMetrics
from gateway.status import RecentLatencies, StatusResponse, status_snapshot
from kv_connector.base import KVConnector
from kv_connector.fingerprint import Fingerprint
from serving.instance import Instance, ServiceCounters, TransferCounters
from serving.metrics import InstanceCollector
from splitserve.v1 import disaggregation_pb2

# LoadReport's numeric fields that are no load: what the gateway checks prompts against.
NOT_COUNTERS = {"max_model_len"}
NUMERIC = {
    FieldDescriptor.CPPTYPE_INT32,
    FieldDescriptor.CPPTYPE_INT64,
    FieldDescriptor.CPPTYPE_UINT32,
    FieldDescriptor.CPPTYPE_UINT64,
    FieldDescriptor.CPPTYPE_DOUBLE,
    FieldDescriptor.CPPTYPE_FLOAT,
}
FINGERPRINT = Fingerprint(model="m", dtype="float32", block_size=16, num_layers=1, num_kv_heads=1, head_dim=8)
ADDRESS = "decode-host:50071"


def make_connector() -> KVConnector:
    """A KVConnector whose transport methods are never called: its base class counts pulls cut off."""
    methods = {name: lambda *args, **kwargs: None for name in KVConnector.__abstractmethods__}
    connector_class = type("IdleConnector", (KVConnector,), {**methods, "name": "idle"})
    return connector_class(torch.zeros(4, 1, 2, 16, 1, 8), FINGERPRINT)


def make_instance() -> tuple[Instance, dict[str, list[float]]]:
    """An instance over a stand-in engine, every source attribute a distinct value; and the
    values each counter must show, by name: one, or one per index for an entry per index."""
    fields = dataclasses.fields(EngineLoad)
    engine_values: dict[str, int | float | tuple[int, ...]] = {
        f.name: (1000 + 10 * index, 1001 + 10 * index, 1002 + 10 * index)
        if f.type.startswith("tuple")
        else index + 1 + (0.5 if f.type == "float" else 0)
        for index, f in enumerate(fields)
    }
    engine_values |= {"num_free_blocks": 30, "num_total_blocks": 40}  # a quarter of the cache in use
    engine_report = EngineLoad(**engine_values)  # type: ignore[arg-type]
    engine = SimpleNamespace(
        latest_load_report=lambda: engine_report, is_alive=True, error=None, core=SimpleNamespace(max_model_len=2048)
    )
    counters = ServiceCounters(**{f.name: 101 + i for i, f in enumerate(dataclasses.fields(ServiceCounters))})
    transfers = TransferCounters(num_transfers=201, num_bytes=202, seconds=203.5)
    connector = make_connector()
    connector.num_pulls_cut_off = 301
    instance = Instance("decode", engine, connector, FINGERPRINT, "decode-1", counters=counters, transfers=transfers)
    holders = {"engine": engine_report, "service": counters, "transfers": transfers, "connector": connector}
    derived = {
        "up": 1.0,
        "kv_usage": 0.25,
        "spec_acceptance_rate": engine_report.num_spec_accepted_tokens / engine_report.num_spec_draft_tokens,
    }
    assert {c.name for c in INSTANCE_COUNTERS if c.derive is not None} == set(derived), "a derived counter to check"
    expected = {
        c.name: [float(v) for v in _as_list(getattr(holders[c.source[0]], c.source[1]))]
        if c.source is not None
        else [derived[c.name]]
        for c in INSTANCE_COUNTERS
    }
    every_value = [v for vs in expected.values() for v in vs]
    assert len(set(every_value)) >= len(every_value) - 2, "sources' values are distinct (up and a ratio aside)"
    return instance, expected


def _as_list(value: object) -> list[float]:
    return list(value) if isinstance(value, tuple) else [value]  # type: ignore[list-item]


def samples(text: str, prefix: str) -> dict[str, tuple[str, str, list[str], list[float]]]:
    """{counter name: (type, help, label sets, values)} of the single-instance series
    ``<prefix><name>``, in the order written (a counter's series, its help and type lines end
    in ``_total``; an entry per index writes one series per index)."""
    types = dict(re.findall(rf"^# TYPE {prefix}(\w+) (\w+)$", text, re.MULTILINE))
    helps = dict(re.findall(rf"^# HELP {prefix}(\w+) (.*)$", text, re.MULTILINE))
    found: dict[str, tuple[str, str, list[str], list[float]]] = {}
    for name, labels, value in re.findall(rf"^{prefix}(\w+)\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE):
        kind = types[name]
        entry = found.setdefault(
            name.removesuffix("_total") if kind == "counter" else name, (kind, helps[name], [], [])
        )
        entry[2].append(labels)
        entry[3].append(float(value))
    return found


def check_series(
    found: dict[str, tuple[str, str, list[str], list[float]]], expected: dict[str, list[float]], where: str
) -> None:
    for counter in INSTANCE_COUNTERS:
        assert counter.name in found, f"{counter.name} is missing from {where}"
        kind, help_text, label_sets, found_values = found[counter.name]
        assert (kind, help_text) == (counter.kind, counter.help), counter.name
        assert found_values == pytest.approx(expected[counter.name]), counter.name
        if counter.per is not None:  # one series per index, labelled with it
            assert [f'{counter.per}="{i}"' in labels for i, labels in enumerate(label_sets)] == [True] * len(label_sets)


def test_every_load_report_field_has_its_counter_and_every_counter_its_field() -> None:
    report, counters = disaggregation_pb2.LoadReport.DESCRIPTOR, disaggregation_pb2.InstanceCounters.DESCRIPTOR
    proto_fields = {f.name for f in report.fields if f.cpp_type in NUMERIC and f.name not in NOT_COUNTERS}
    proto_fields |= {f"counters.{f.name}" for f in counters.fields}
    assert all(f.cpp_type in NUMERIC for f in counters.fields)
    table_fields = [c.field for c in INSTANCE_COUNTERS if c.field is not None]
    assert len(table_fields) == len(set(table_fields)), "two counters in one field"
    assert set(table_fields) == proto_fields


def test_every_source_attribute_has_its_counter_and_every_counter_its_source() -> None:
    connector = make_connector()
    sourced = {c.source for c in INSTANCE_COUNTERS if c.source is not None}
    assert len(sourced) == len([c for c in INSTANCE_COUNTERS if c.source is not None]), "one attribute read twice"
    expected = {("engine", f.name) for f in dataclasses.fields(EngineLoad)}
    expected |= {("service", f.name) for f in dataclasses.fields(ServiceCounters)}
    expected |= {("transfers", f.name) for f in dataclasses.fields(TransferCounters)}
    connector_state = ("num_pulls_cut_off", "num_transfers_in_flight", "num_connections")
    expected |= {("connector", name) for name in connector_state if hasattr(connector, name)}
    assert sourced == expected


def test_names_are_unique_and_units_fit_their_kinds() -> None:
    names = [c.name for c in INSTANCE_COUNTERS]
    assert len(names) == len(set(names))
    for counter in INSTANCE_COUNTERS:
        if counter.unit in ("seconds", "bytes"):  # Prometheus's base units, named in the series
            assert counter.name.endswith(f"_{counter.unit}"), counter.name
        if counter.unit in ("ratio", "boolean"):
            assert counter.kind == "gauge", counter.name
        if counter.kind == "counter":
            assert counter.field is not None, f"{counter.name}: a running total comes from the instance"
    assert [c.name for c in STATUS_PAGE_COUNTERS] == ["num_waiting", "num_running", "kv_usage"]


def test_a_counter_is_either_reported_or_derived() -> None:
    with pytest.raises(RuntimeError, match="a bug"):
        InstanceCounter("x", "gauge", "ratio", "help", derive=lambda report: 0.0, per="position")
    with pytest.raises(RuntimeError, match="a bug in the table"):
        InstanceCounter("x", "gauge", "ratio", "help", field="num_waiting", derive=lambda report: 0.0)
    with pytest.raises(RuntimeError, match="a bug in the table"):
        InstanceCounter("x", "gauge", "ratio", "help", field="num_waiting")


def test_every_counter_reaches_the_load_report_both_metrics_endpoints_and_the_status_page() -> None:
    instance, expected = make_instance()

    report = instance.load_report()
    for counter in INSTANCE_COUNTERS:
        assert [value for _, value in values(counter, report)] == pytest.approx(expected[counter.name]), counter.name
    assert disaggregation_pb2.LoadReport.FromString(report.SerializeToString()) == report

    registry = CollectorRegistry()
    registry.register(InstanceCollector(instance.load_report))
    instance_text = generate_latest(registry).decode()
    check_series(samples(instance_text, "splitserve_engine_"), expected, "the instance's /metrics")
    assert 'instance="decode-1",role="decode"' in instance_text

    async def gateway_view() -> tuple[str, StatusResponse]:
        pool = InstancePool(stale_after_s=30.0)
        try:
            pool.add(ADDRESS, "decode")
            pool.record_report(ADDRESS, report, serving=True)
            text = GatewayMetrics(pool).render().decode()
            return text, status_snapshot(pool, RecentLatencies(), "m", ready=True)
        finally:
            await pool.close()

    gateway_text, status = asyncio.run(gateway_view())
    check_series(samples(gateway_text, "splitserve_instance_"), expected, "the gateway's /metrics")
    assert f'address="{ADDRESS}",instance="decode-1",role="decode"' in gateway_text

    assert [(c.name, c.label, c.unit, c.help) for c in status.columns] == [
        (c.name, c.status_label, c.unit, c.help) for c in STATUS_PAGE_COUNTERS
    ]
    (shown,) = status.instances
    assert shown.counters == pytest.approx({c.name: expected[c.name][0] for c in STATUS_PAGE_COUNTERS})
