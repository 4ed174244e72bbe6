"""The printed summary of ``bench.cluster_scale``: one row per figure, idle beside loaded."""

from __future__ import annotations

import statistics

from bench.simulated_cluster import GROUPS

# What a method's calls are, where the name alone misleads: KV events are pushed down a
# subscription's stream, and read by the paged call only to resync (docs/simulator.md).
METHOD_MEANINGS = {"WatchKVEvents": "KV-event subscriptions", "GetKVEvents": "KV-event resyncs and polls"}


def method_label(method: str) -> str:
    """``/package.Service/Method`` as a row's label: the method, and what its calls are."""
    name = method.rsplit("/", 1)[-1]
    return f"{name} ({METHOD_MEANINGS[name]})" if name in METHOD_MEANINGS else name


def summary(result: dict) -> str:
    """The figures as a table a reader takes in at a glance."""
    mib = 1024 * 1024
    rows = [("figure", "idle", "loaded")]
    idle, loaded = result["idle"], result["loaded"]
    rows.append(("Redis commands/s", f"{idle['redis_commands_per_s']:.1f}", f"{loaded['redis_commands_per_s']:.1f}"))
    for name in sorted(set(idle["redis_commands_per_s_by_command"]) | set(loaded["redis_commands_per_s_by_command"])):
        rows.append(
            (
                f"  {name.upper()}/s",
                f"{idle['redis_commands_per_s_by_command'].get(name, 0.0):.1f}",
                f"{loaded['redis_commands_per_s_by_command'].get(name, 0.0):.1f}",
            )
        )
    rows.append(("heartbeats/s", f"{idle['heartbeats_per_s']:.1f}", f"{loaded['heartbeats_per_s']:.1f}"))
    for key, label in (
        ("redis_net_in_bytes_per_s", "Redis in KiB/s"),
        ("redis_net_out_bytes_per_s", "Redis out KiB/s"),
    ):
        rows.append((label, f"{idle[key] / 1024:.1f}", f"{loaded[key] / 1024:.1f}"))
    rows.append(("gRPC calls/s to instances", f"{idle['grpc_calls_per_s']:.1f}", f"{loaded['grpc_calls_per_s']:.1f}"))
    for method in sorted(set(idle["grpc_calls_per_s_by_method"]) | set(loaded["grpc_calls_per_s_by_method"])):
        rows.append(
            (
                f"  {method_label(method)}/s",
                f"{idle['grpc_calls_per_s_by_method'].get(method, 0.0):.1f}",
                f"{loaded['grpc_calls_per_s_by_method'].get(method, 0.0):.1f}",
            )
        )
    for method, num_calls in result["grpc_calls_since_start_by_method"].items():
        if method.rsplit("/", 1)[-1] in METHOD_MEANINGS:  # the KV-event calls: most are made before the windows
            rows.append((f"{method_label(method)} since start", "", f"{num_calls:.0f}"))
    # The KV-event messages themselves, counted by the gateways that received them.
    since_start = result["kv_events_since_start"]
    for via, label in (("stream", "pushed"), ("poll", "polled")):
        messages, num_bytes = "kv_event_messages_per_s_by_via", "kv_event_bytes_per_s_by_via"
        rows.append((f"KV-event messages/s {label}", f"{idle[messages][via]:.1f}", f"{loaded[messages][via]:.1f}"))
        rows.append(
            (f"KV-event KiB/s {label}", f"{idle[num_bytes][via] / 1024:.1f}", f"{loaded[num_bytes][via] / 1024:.1f}")
        )
        rows.append((f"KV-event messages {label} since start", "", f"{since_start['messages_by_via'][via]:.0f}"))
        rows.append((f"KV-event MiB {label} since start", "", f"{since_start['bytes_by_via'][via] / mib:.2f}"))
    heartbeats = "kv_event_heartbeats_per_s"
    rows.append(("KV-event heartbeats/s", f"{idle[heartbeats]:.1f}", f"{loaded[heartbeats]:.1f}"))
    for group in GROUPS:
        i, l_ = idle["groups"][group], loaded["groups"][group]
        rows.append((f"{group} CPU cores", f"{i['cpu_cores']:.3f}", f"{l_['cpu_cores']:.3f}"))
        for peer in sorted(set(idle["socket_bytes_per_s"][group]) | set(loaded["socket_bytes_per_s"][group])):
            rows.append(
                (
                    f"{group}<->{peer} KiB/s sent+received",
                    f"{sum(idle['socket_bytes_per_s'][group].get(peer, {}).values()) / 1024:.1f}",
                    f"{sum(loaded['socket_bytes_per_s'][group].get(peer, {}).values()) / 1024:.1f}",
                )
            )
    rows.append(("streamed tokens/s", "", f"{loaded['load']['tokens_per_s']:.0f}"))
    memory = result["memory"]
    per_instance = statistics.mean(memory["gateway_rss_bytes_per_instance"])
    per_request = statistics.mean(memory["gateway_rss_bytes_per_inflight_request"])
    rows.append(("gateway RSS MiB (mean)", f"{statistics.mean(memory['gateway_rss_bytes_idle']) / mib:.1f}",
                 f"{statistics.mean(loaded['gateway_rss_bytes_median']) / mib:.1f}"))  # fmt: skip
    rows.append(("gateway KiB per instance", f"{per_instance / 1024:.1f}", ""))
    rows.append(("gateway KiB per in-flight request", "", f"{per_request / 1024:.1f}"))
    width = max(len(row[0]) for row in rows)
    return "\n".join(f"{a:<{width}}  {b:>12}  {c:>12}" for a, b, c in rows)
