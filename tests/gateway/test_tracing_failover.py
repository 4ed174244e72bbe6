"""A retried and a migrated request across real processes (a gateway, two prefill and two
decode instances; tiny random model, UCX on loopback), traced into a real OTLP/gRPC receiver
on loopback (tests/gateway/otlp_collector.py): the retry and the migration are events of the
request's root span, each attempt is a call span of the gateway's, and the attempt that took
over has its spans, from the surviving process, under its call in the same trace.

The gateway polls its instances once, at its start: it still believes a killed instance
healthy when the request reaches it, so that the call itself fails and fails over. It routes
by load (``--routing load``): two idle instances tie and the first in the gateway's tie order
(the lower instance id) is picked, where
kv routing would pick the one that measured the faster prefill at start-up (either one), and
its KV-event streams would reconnect to a killed instance and mark it down before any call. After
each scenario every surviving instance has all its KV blocks free."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.trace.v1 import trace_pb2

from tests.gateway.otlp_collector import (
    DECODE,
    DECODE_CALL,
    GATEWAY,
    PREFILL,
    PREFILL_CALL,
    Collector,
    ReceivedSpan,
    attribute_values,
    new_trace_id,
    running_collector,
    traceparent,
)
from tests.gateway.processes import HTTPProcess, routes, running_gateway, stream_killing_decode
from tests.services.client import assert_all_free
from tests.services.processes import Service, running

pytest.importorskip("ucxx")

SHORT = {"prompt": "Once upon a time, in a land far away,", "max_tokens": 12, "ignore_eos": True, "temperature": 0}
# Long enough to be killed mid-stream (as tests/gateway/test_migration.py kills it).
LONG = {**SHORT, "max_tokens": 300}
# The first poll is the only one: the gateway learns of a death only from a failed call.
POLLED_ONCE = ("--poll-interval", "3600", "--stale-after", "7200")
BY_LOAD = ("--routing", "load")
ERROR = trace_pb2.Status.STATUS_CODE_ERROR


@dataclass(frozen=True, slots=True)
class Cluster:
    gateway: HTTPProcess
    prefills: list[Service]
    decodes: list[Service]

    def alive(self, services: list[Service]) -> list[Service]:
        return [service for service in services if service.process.poll() is None]


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    with running_collector() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def cluster(model: Path, collector: Collector) -> Iterator[Cluster]:
    """Two of each role, all tracing to the collector; the tests kill some of them."""
    traced = ("--otlp-traces-endpoint", collector.endpoint)
    with ExitStack() as stack:
        prefills = [stack.enter_context(running("prefill", model, "--lease-seconds", "10", *traced)) for _ in "ab"]
        decodes = [stack.enter_context(running("decode", model, *traced)) for _ in "ab"]
        flags = (*routes(*prefills, *decodes), *POLLED_ONCE, *BY_LOAD, *traced)
        gateway = stack.enter_context(running_gateway(model, *flags))
        yield Cluster(gateway, prefills, decodes)


def calls(spans: list[ReceivedSpan], method: str) -> list[ReceivedSpan]:
    """The gateway's calls of ``method``, in the order they started."""
    found = [s for s in spans if s.service == GATEWAY and s.name == method]
    return sorted(found, key=lambda s: s.span.start_time_unix_nano)


def served(spans: list[ReceivedSpan], service: str, method: str, call: ReceivedSpan) -> ReceivedSpan:
    """The instance's span of the gateway's ``call``."""
    (found,) = [
        s for s in spans if s.service == service and s.name == method and s.span.parent_span_id == call.span.span_id
    ]
    return found


def children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> set[str]:
    return {s.name for s in spans if s.span.parent_span_id == parent.span.span_id}


def is_reprefill(span: ReceivedSpan) -> bool:
    """P's span of the prefill that a (first) migration asked for: its request id is the request's plus ``.m1``."""
    return (
        span.service == PREFILL
        and span.name == PREFILL_CALL
        and str(span.attribute("gen_ai.request.id")).endswith(".m1")
        and span.attribute("splitserve.kv_only") is True
    )


def root_of(spans: list[ReceivedSpan]) -> ReceivedSpan:
    (root,) = [s for s in spans if s.is_root]
    return root


def test_a_prefill_retried_on_another_instance_shows_the_retry_and_the_attempt_that_served(
    cluster: Cluster, collector: Collector
) -> None:
    """The prefill instance the gateway picks first (as idle as the other, so first in its tie
    order: the lower instance id, gateway/tie_break.py) is dead: its call fails with
    UNAVAILABLE, the root has the retry, and the other P's span hangs under the second call."""
    victim, survivor = sorted(cluster.prefills, key=lambda prefill: prefill.load().instance_id)
    victim_id = victim.load().instance_id
    victim.stop(signal.SIGKILL)
    survivor_id = survivor.load().instance_id
    trace_id = new_trace_id()
    response = httpx.post(
        f"{cluster.gateway.url}/v1/completions", json=SHORT, headers=traceparent(trace_id), timeout=120
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == SHORT["max_tokens"]

    def complete(spans: list[ReceivedSpan]) -> bool:
        return any(s.is_root for s in spans) and {(PREFILL, PREFILL_CALL), (DECODE, DECODE_CALL)} <= {
            (s.service, s.name) for s in spans
        }

    spans = collector.trace(trace_id, complete)
    root = root_of(spans)
    (retry,) = root.events("retry")
    assert attribute_values(retry.attributes) == {
        "splitserve.phase": "prefill",
        "splitserve.instance.id": victim_id,
        "rpc.grpc.status_code": "UNAVAILABLE",
    }
    failed, answered = calls(spans, PREFILL_CALL)
    assert [call.attribute("server.address") for call in (failed, answered)] == [victim.address, survivor.address]
    assert failed.span.status.code == ERROR and failed.attribute("rpc.grpc.status_code") == "UNAVAILABLE"
    assert answered.span.status.code != ERROR
    assert failed.span.parent_span_id == answered.span.parent_span_id == root.span.span_id
    # The retry came between the two attempts (the gateway's own clock).
    assert failed.span.end_time_unix_nano <= retry.time_unix_nano <= answered.span.start_time_unix_nano
    # The surviving P's spans, under the attempt that reached it; none under the failed one.
    prefill = served(spans, PREFILL, PREFILL_CALL, answered)
    assert prefill.instance == survivor_id
    assert {"queue", "prefill chunk", "kv publish"} <= children(spans, prefill)
    assert not children(spans, failed)
    (decode_call,) = calls(spans, DECODE_CALL)
    decode = served(spans, DECODE, DECODE_CALL, decode_call)
    assert {"decode queue", "kv pull", "first decode step"} <= children(spans, decode)
    assert_all_free(survivor, *cluster.decodes)


def test_a_migrated_request_shows_the_migration_and_the_new_decode_instances_spans(
    cluster: Cluster, collector: Collector
) -> None:
    """The decode instance streaming the request is killed mid-stream: the root has the
    migration, the prompt and the tokens sent so far are prefilled again, and the other D's
    spans hang under the second Decode call."""
    decodes = cluster.alive(cluster.decodes)
    instance_ids = {decode.address: decode.load().instance_id for decode in decodes}
    trace_id = new_trace_id()
    chunks, survivor = stream_killing_decode(
        cluster.gateway, decodes, LONG, after_chunks=5, headers=traceparent(trace_id)
    )
    assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
    (victim,) = [decode for decode in decodes if decode is not survivor]
    survivor_id = instance_ids[survivor.address]

    def complete(spans: list[ReceivedSpan]) -> bool:
        return (
            any(s.is_root for s in spans)
            and any(s.instance == survivor_id and s.name == DECODE_CALL for s in spans)
            and any(is_reprefill(s) for s in spans)
        )

    spans = collector.trace(trace_id, complete)
    root = root_of(spans)
    (migration,) = root.events("migration")
    moved = attribute_values(migration.attributes)
    assert moved["splitserve.migration"] == 1 and int(moved["splitserve.num_output_tokens"]) >= 5
    # The failed call counts as a retry of the decode phase too (gateway/failover.py), then migrates.
    (retry,) = root.events("retry")
    assert attribute_values(retry.attributes)["splitserve.phase"] == "decode"
    assert attribute_values(retry.attributes)["splitserve.instance.id"] == instance_ids[victim.address]
    lost, resumed = calls(spans, DECODE_CALL)
    first_prefill, reprefill = calls(spans, PREFILL_CALL)
    assert [call.attribute("server.address") for call in (lost, resumed)] == [victim.address, survivor.address]
    assert lost.span.status.code == ERROR and resumed.span.status.code != ERROR
    for call in (lost, resumed, first_prefill, reprefill):
        assert call.span.parent_span_id == root.span.span_id
    # In the gateway's order (its own clock): the lost call and its retry event, the migration,
    # the prompt prefilled again, the new D.
    assert lost.span.start_time_unix_nano <= retry.time_unix_nano <= lost.span.end_time_unix_nano
    assert lost.span.end_time_unix_nano <= migration.time_unix_nano <= reprefill.span.start_time_unix_nano
    assert reprefill.span.end_time_unix_nano <= resumed.span.start_time_unix_nano
    # The re-prefill's span on P carries the migration's prefill request id; the new D's span
    # hangs under the resumed call, with its phases under it.
    assert is_reprefill(served(spans, PREFILL, PREFILL_CALL, reprefill))
    decode = served(spans, DECODE, DECODE_CALL, resumed)
    assert decode.instance == survivor_id and decode.span.status.code != ERROR
    assert {"decode queue", "kv pull", "first decode step"} <= children(spans, decode)
    # It streamed the rest: every token after the one it continued from, the budget unchanged.
    assert decode.attribute("gen_ai.usage.output_tokens") == LONG["max_tokens"] - moved["splitserve.num_output_tokens"]
    assert_all_free(*cluster.alive(cluster.prefills), survivor)
