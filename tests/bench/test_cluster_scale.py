"""``python -m bench.cluster_scale`` on a small cluster (4 simulated instances in 4 processes,
2 gateways): every figure is there and none is negative, and what it counted agrees with the
cluster's settings: a heartbeat per instance per period, a KV-event subscription per gateway and
instance and no KV-event polling once subscribed, the pushed KV-event messages counted by the
gateways that received them, the requests' own calls under load and none failed.

The benchmark starts and stops its processes itself (by pid, in a ``finally``); it runs in the
test's process, so that a failing test still stops them."""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.cluster_scale import CLUSTER_METHODS, KV_EVENT_READS, KV_EVENT_SUBSCRIPTIONS, main

NUM_INSTANCES = 4
NUM_GATEWAYS = 2
HEARTBEAT_S = 0.5
POLL_INTERVAL_S = 0.5


def numbers(value: object, path: str = "") -> list[tuple[str, float]]:
    """Every number in a JSON value, with where it is."""
    if isinstance(value, dict):
        return [item for key, inner in value.items() for item in numbers(inner, f"{path}.{key}")]
    if isinstance(value, list):
        return [item for i, inner in enumerate(value) for item in numbers(inner, f"{path}[{i}]")]
    if isinstance(value, int | float) and not isinstance(value, bool):
        return [(path, float(value))]
    return []


def test_a_small_cluster_reports_every_figure_and_counts_agree_with_its_settings(tmp_path: Path) -> None:
    argv = [
        "--output-dir", str(tmp_path), "--num-instances", str(NUM_INSTANCES), "--processes-per-role", "2",
        "--num-gateways", str(NUM_GATEWAYS), "--duration", "3", "--settle", "1", "--streams", "4",
        "--max-tokens", "16", "--heartbeat-seconds", str(HEARTBEAT_S), "--poll-interval", str(POLL_INTERVAL_S),
    ]  # fmt: skip
    assert main(argv) == 0
    result = json.loads((tmp_path / "cluster_scale.json").read_text())

    for window in ("idle", "loaded"):
        figures = result[window]
        for path, value in numbers(figures):
            assert math.isfinite(value) and value >= 0, f"{window}{path} = {value}"
        # Only instances write to Redis: its SETs are their heartbeats, one per instance per period
        # at most (a beat's own time adds to the period).
        assert figures["heartbeats_per_s"] == figures["redis_commands_per_s_by_command"]["set"]
        assert 0.5 * NUM_INSTANCES / HEARTBEAT_S < figures["heartbeats_per_s"] <= 1.2 * NUM_INSTANCES / HEARTBEAT_S
        assert figures["redis_commands_per_s_by_command"]["scan"] > 0, "the gateways scan the registry"
        # Subscribed before the window, the gateways make no KV-event call in it unless a stream
        # ends or resyncs: fewer than one round of calls to every instance, where polling every
        # --poll-interval would make one round per interval.
        by_method = figures["grpc_calls_per_s_by_method"]
        kv_event_calls = (by_method[KV_EVENT_SUBSCRIPTIONS] + by_method[KV_EVENT_READS]) * figures["seconds"]
        assert kv_event_calls < NUM_GATEWAYS * NUM_INSTANCES, f"{window}: {by_method}"
        polled = figures["kv_event_messages_per_s_by_via"]["poll"] * figures["seconds"]
        assert polled < NUM_GATEWAYS * NUM_INSTANCES, f"{window}: {figures['kv_event_messages_per_s_by_via']}"
        assert figures["kv_event_heartbeats_per_s"] <= 1.2 * result["expected"]["kv_event_heartbeats_per_s_at_most"]
        assert set(CLUSTER_METHODS) <= set(by_method)
        assert figures["socket_bytes_per_s"]["gateways"]["redis"]["received"] > 0
        for group in ("gateways", "instances", "redis", "client"):
            assert figures["groups"][group]["rss_bytes"] > 0, group
        # Redis and the client may use less than a clock tick in a short window; the gateways scan
        # the registry and the instances heartbeat.
        assert figures["groups"]["gateways"]["cpu_cores"] > 0 and figures["groups"]["instances"]["cpu_cores"] > 0
    idle, loaded = result["idle"], result["loaded"]
    assert set(idle["grpc_calls_per_s_by_method"]) == set(CLUSTER_METHODS), "no request is sent while idle"
    by_method = loaded["grpc_calls_per_s_by_method"]
    assert by_method["/splitserve.v1.Prefill/Prefill"] > 0 and by_method["/splitserve.v1.Decode/Decode"] > 0
    assert loaded["load"]["tokens_per_s"] > 0 and loaded["load"]["num_failed"] == 0
    # The requests' calls, and the prefix-cache changes pushed down the subscriptions.
    assert loaded["socket_bytes_per_s"]["gateways"]["instances"]["sent"] > 0
    assert loaded["socket_bytes_per_s"]["gateways"]["instances"]["received"] > 0
    # Every gateway subscribed to every instance, and read each one's events once to start from
    # (its first subscription, from no cursor, is answered with a resync marker).
    since_start = result["grpc_calls_since_start_by_method"]
    assert since_start[KV_EVENT_SUBSCRIPTIONS] >= result["expected"]["kv_event_subscriptions_since_start_at_least"]
    assert since_start[KV_EVENT_READS] >= NUM_GATEWAYS * NUM_INSTANCES
    # The gateways counted the messages: first contact's marker pushed and snapshot polled per
    # gateway and instance, then the prefix-cache changes of the loaded window pushed.
    kv_events = result["kv_events_since_start"]
    for via in ("stream", "poll"):
        assert kv_events["messages_by_via"][via] >= NUM_GATEWAYS * NUM_INSTANCES, kv_events
        assert kv_events["bytes_by_via"][via] > 0, kv_events
    assert loaded["kv_event_messages_per_s_by_via"]["stream"] > 0
    assert loaded["kv_event_bytes_per_s_by_via"]["stream"] > 0
    assert loaded["socket_bytes_per_s"]["client"]["gateways"]["received"] > 0

    memory = result["memory"]
    for key in ("gateway_rss_bytes_no_instances", f"gateway_rss_bytes_{NUM_INSTANCES}_instances"):
        assert len(memory[key]) == NUM_GATEWAYS and all(rss > 0 for rss in memory[key]), key
    # Slopes of a noisy quantity: there, finite, one per gateway (their size is the quiet machine's to say).
    for key in ("gateway_rss_bytes_per_instance", "gateway_rss_bytes_per_inflight_request"):
        assert len(memory[key]) == NUM_GATEWAYS and all(math.isfinite(v) for v in memory[key]), key
