"""The cluster's own traffic and the gateway's memory at scale: dozens of simulated instances
heartbeating into Redis and pushing their KV events to several gateways (issue 38, item 4).

    python -m bench.cluster_scale --output-dir /tmp/cluster-scale --num-instances 64 --num-gateways 4

It starts a Redis registry, ``--num-gateways`` gateway processes on ports of their own (each its
own ``splitserve gateway --registry-url``, as replicas on several hosts run), then the
simulated instances (``splitserve simulate``, half prefill and half decode, in
``--processes-per-role`` processes of each role), each with its Prometheus endpoint on. In order:

1. Each gateway's resident memory with no instance, with the first process of each role
   registered, and with every instance registered and routed to (``/ready`` of every gateway
   counts them all): the memory per instance is the slope between the last two, so that the
   first instances' one-off costs (channels, the tokenizer) stay out of it.
2. A warm-up, a stream per gateway for two requests (so that the idle memory holds what a
   gateway allocates once for its first requests), ``--settle`` seconds, then an idle window of
   ``--duration`` seconds, then a loaded one: ``--streams`` streamed
   completions in a closed loop, spread evenly over the gateways, measured once every stream
   has had its first token. Over each window, from counters, never from intervals:

   - discovery: Redis commands per second by command (``INFO commandstats``; the bench's own
     ``INFO`` left out), its network bytes (``INFO stats``); heartbeats per second are its SETs,
     as only instances write;
   - the cluster's own calls: gRPC calls per second the instances received, by method (each
     instance's ``splitserve_engine_grpc_calls_total``, ``cluster/call_counts.py``):
     ``WatchKVEvents`` (KV-event subscriptions: one call per stream, however many messages it
     pushes), ``GetKVEvents`` (the paged reads a subscription resyncs by, and the polls of an
     instance that refuses one), ``GetLoadReport``, the health ``Check``, and during load the
     requests' own calls; and the calls since start, by method, once the loaded window ends;
   - the KV-event messages the gateways received (each gateway's
     ``splitserve_kv_event_messages_total`` and ``_message_bytes_total``,
     ``gateway/kv_event_traffic.py``), by stream (pushed: one per engine step that changed an
     instance's prefix cache, per subscribed gateway) and by poll (resyncs, first contacts),
     their serialized bytes, and the heartbeats of quiet subscriptions; per second in each
     window and since start;
   - bytes per second over TCP, each group's sockets by peer (the gateways' with the instances:
     pushed KV events, polls and requests; with Redis; with the client), from the kernel's
     per-connection counters (``bench/socket_bytes.py``; a connection closed within the
     window is missed, and the cluster's stay open);
   - CPU (cores) and resident memory of each group: gateways, instance processes, Redis, this
     client (``bench/proc_stats.py``).
3. The memory per in-flight request: each gateway's median resident memory over the loaded
   window, less its idle one, over the streams it held open.

Writes ``cluster_scale.json`` in ``--output-dir`` and prints a summary table. Every process it
started is stopped by its pid, whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import statistics
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import redis
from prometheus_client.parser import text_string_to_metric_families

from bench.cluster_scale_report import summary
from bench.proc_stats import ProcSample, group_rates, sample
from bench.simulated_cluster import (
    GROUPS,
    START_TIMEOUT_S,
    Cluster,
    get_json,
    ready_bodies,
    redis_answers,
    split,
    start_gateways,
    start_instances,
    start_redis,
    wait_until,
)
from bench.socket_bytes import SocketBytes, SocketKey, bytes_by_peer, established_sockets
from bench.stream_loop import LoadLoop
from gateway.kv_event_liveness import DEFAULT_HEARTBEAT_S
from launcher.processes import free_port

logger = logging.getLogger(__name__)

CALLS_METRIC = "splitserve_engine_grpc_calls"
# What the gateways count of the KV events they receive (gateway/kv_event_traffic.py): the
# instances cannot count what they push down a stream.
KV_EVENT_MESSAGES = "splitserve_kv_event_messages_total"
KV_EVENT_BYTES = "splitserve_kv_event_message_bytes_total"
KV_EVENT_HEARTBEATS = "splitserve_kv_event_heartbeats_total"
KV_EVENT_VIAS = ("stream", "poll")
KV_EVENT_SUBSCRIPTIONS = "/splitserve.v1.Load/WatchKVEvents"
KV_EVENT_READS = "/splitserve.v1.Load/GetKVEvents"
# The calls a gateway may make of each instance on its own account: shown even when none was
# made. Once subscribed, a gateway calls nothing for KV events until a stream ends (its lifetime)
# or resyncs; with Redis, load reports ride on the heartbeats, and an instance is polled only
# once its report is stale.
CLUSTER_METHODS = (
    KV_EVENT_SUBSCRIPTIONS,
    KV_EVENT_READS,
    "/splitserve.v1.Load/GetLoadReport",
    "/grpc.health.v1.Health/Check",
)


@dataclass(slots=True)
class Snapshot:
    """Every counter the bench reads, each with the moment it was read."""

    proc_at: float
    procs: dict[str, list[ProcSample]]
    redis_at: float
    redis_commands: dict[str, int]  # calls by command, since Redis started
    redis_net_bytes: tuple[int, int]  # (in, out)
    calls_at: float
    calls: dict[str, float]  # gRPC calls the instances received, by method, summed over instances
    kv_events_at: float
    kv_events: dict[str, float]  # the gateways' KV-event counters, summed over gateways: "<sample>/<via>"
    sockets_at: float
    sockets: dict[SocketKey, SocketBytes]


def rss_by_gateway(cluster: Cluster) -> list[int]:
    return [sample(pid).rss_bytes for pid in cluster.pids("gateways")]


def calls_by_method(cluster: Cluster) -> dict[str, float]:
    """gRPC calls received so far by every instance, by method (their /metrics)."""
    totals: dict[str, float] = {}
    for url in cluster.metrics_urls:
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            if family.name != CALLS_METRIC:
                continue
            for s in family.samples:
                if s.name == f"{CALLS_METRIC}_total":
                    method = s.labels["method"]
                    totals[method] = totals.get(method, 0.0) + s.value
    return totals


def kv_event_counts(cluster: Cluster) -> dict[str, float]:
    """KV-event messages, bytes and heartbeats the gateways received so far (their /metrics),
    as ``"<sample>/<via>"`` (no via for heartbeats), summed over gateways."""
    totals = {f"{name}/{via}": 0.0 for name in (KV_EVENT_MESSAGES, KV_EVENT_BYTES) for via in KV_EVENT_VIAS}
    totals[f"{KV_EVENT_HEARTBEATS}/"] = 0.0
    for url in cluster.gateway_urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = f"{s.name}/{s.labels.get('via', '')}"
                if key in totals:
                    totals[key] += s.value
    return totals


def kv_event_rates(before: dict[str, float], after: dict[str, float], seconds: float) -> dict:
    """The gateways' KV-event counters per second between two reads."""

    def rate(name: str, via: str) -> float:
        return (after[f"{name}/{via}"] - before[f"{name}/{via}"]) / seconds

    return {
        "kv_event_messages_per_s_by_via": {via: rate(KV_EVENT_MESSAGES, via) for via in KV_EVENT_VIAS},
        "kv_event_bytes_per_s_by_via": {via: rate(KV_EVENT_BYTES, via) for via in KV_EVENT_VIAS},
        "kv_event_heartbeats_per_s": rate(KV_EVENT_HEARTBEATS, ""),
    }


def kv_event_totals(counts: dict[str, float]) -> dict:
    """The gateways' KV-event counters as read (since each gateway started)."""
    return {
        "messages_by_via": {via: counts[f"{KV_EVENT_MESSAGES}/{via}"] for via in KV_EVENT_VIAS},
        "bytes_by_via": {via: counts[f"{KV_EVENT_BYTES}/{via}"] for via in KV_EVENT_VIAS},
        "heartbeats": counts[f"{KV_EVENT_HEARTBEATS}/"],
    }


def snapshot(cluster: Cluster, client: redis.Redis) -> Snapshot:
    proc_at = time.monotonic()
    procs = {group: [sample(pid) for pid in cluster.pids(group)] for group in GROUPS}
    redis_at = time.monotonic()
    commandstats = client.info("commandstats")
    stats = client.info("stats")
    commands = {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in commandstats.items()}
    calls_at = time.monotonic()
    calls = calls_by_method(cluster)
    kv_events_at = time.monotonic()
    kv_events = kv_event_counts(cluster)
    sockets_at = time.monotonic()
    sockets = established_sockets({pid for group in GROUPS for pid in cluster.pids(group)})
    return Snapshot(
        proc_at=proc_at,
        procs=procs,
        redis_at=redis_at,
        redis_commands=commands,
        redis_net_bytes=(int(stats["total_net_input_bytes"]), int(stats["total_net_output_bytes"])),
        calls_at=calls_at,
        calls=calls,
        kv_events_at=kv_events_at,
        kv_events=kv_events,
        sockets_at=sockets_at,
        sockets=sockets,
    )


def window_figures(cluster: Cluster, before: Snapshot, after: Snapshot) -> dict:
    """Rates per second between two snapshots, each source over its own interval."""
    redis_s = after.redis_at - before.redis_at
    commands = {
        name: (after.redis_commands[name] - before.redis_commands.get(name, 0)) / redis_s
        for name in after.redis_commands
        if name != "info"  # the bench's own reads
    }
    commands = {name: rate for name, rate in sorted(commands.items()) if rate > 0}
    calls_s = after.calls_at - before.calls_at
    calls = {
        method: (after.calls.get(method, 0.0) - before.calls.get(method, 0.0)) / calls_s
        for method in sorted(set(after.calls) | set(CLUSTER_METHODS))
    }
    proc_s = after.proc_at - before.proc_at
    sockets_s = after.sockets_at - before.sockets_at
    socket_bytes = {}
    for group in GROUPS:
        pids = set(cluster.pids(group))
        by_peer = bytes_by_peer(before.sockets, after.sockets, pids, cluster.peer_of(group))
        socket_bytes[group] = {
            peer: {direction: num_bytes / sockets_s for direction, num_bytes in counts.items()}
            for peer, counts in sorted(by_peer.items())
        }
    return {
        "seconds": proc_s,
        "redis_commands_per_s": sum(commands.values()),
        "redis_commands_per_s_by_command": commands,
        "heartbeats_per_s": commands.get("set", 0.0),
        "redis_net_in_bytes_per_s": (after.redis_net_bytes[0] - before.redis_net_bytes[0]) / redis_s,
        "redis_net_out_bytes_per_s": (after.redis_net_bytes[1] - before.redis_net_bytes[1]) / redis_s,
        "grpc_calls_per_s": sum(calls.values()),
        "grpc_calls_per_s_by_method": {m: rate for m, rate in calls.items() if rate > 0 or m in CLUSTER_METHODS},
        **kv_event_rates(before.kv_events, after.kv_events, after.kv_events_at - before.kv_events_at),
        "socket_bytes_per_s": socket_bytes,
        "groups": {group: asdict(group_rates(before.procs[group], after.procs[group], proc_s)) for group in GROUPS},
    }


async def loaded_window(cluster: Cluster, client: redis.Redis, args: argparse.Namespace, model: str) -> dict:
    loop = LoadLoop(cluster.gateway_urls, model, args.streams, args.max_tokens, args.prompt_words)
    task = asyncio.create_task(loop.run())
    deadline = time.monotonic() + START_TIMEOUT_S
    while loop.num_started < args.streams:
        if task.done():
            task.result()
            raise RuntimeError("the load loop ended before every stream started")
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {loop.num_started} of {args.streams} streams had a first token")
        await asyncio.sleep(0.1)
    before = await asyncio.to_thread(snapshot, cluster, client)
    requests_before, tokens_before, failed_before = loop.num_requests, loop.num_tokens, loop.num_failed
    rss_samples: list[list[int]] = []
    open_samples: list[list[int]] = []
    end = time.monotonic() + args.duration
    while time.monotonic() < end:
        open_samples.append(list(loop.num_open))
        rss_samples.append(await asyncio.to_thread(rss_by_gateway, cluster))
        await asyncio.sleep(min(1.0, max(0.0, end - time.monotonic())))
    after = await asyncio.to_thread(snapshot, cluster, client)
    figures = window_figures(cluster, before, after)
    loop.stopping = True
    await task
    seconds = figures["seconds"]
    figures["load"] = {
        "streams": args.streams,
        "requests_per_s": (loop.num_requests - requests_before) / seconds,
        "tokens_per_s": (loop.num_tokens - tokens_before) / seconds,
        "num_failed": loop.num_failed - failed_before,
    }
    figures["gateway_rss_bytes_median"] = [int(statistics.median(column)) for column in zip(*rss_samples)]
    figures["gateway_open_streams_median"] = [statistics.median(column) for column in zip(*open_samples)]
    return figures


def measure(args: argparse.Namespace, cluster: Cluster, env: dict[str, str], log) -> dict:
    client = redis.Redis.from_url(cluster.redis_url)
    wait_until(cluster, lambda: redis_answers(client), "Redis answers")
    start_gateways(cluster, args, env, log)
    wait_until(cluster, lambda: all("instances" in body for body in ready_bodies(cluster)), "every gateway answers")
    rss_none = rss_by_gateway(cluster)
    per_role = args.num_instances // 2
    counts = split(per_role, args.processes_per_role)
    expected: dict[str, int] = {"prefill": 0, "decode": 0}

    def all_routed() -> bool:
        counts = [body.get("instances", {}) for body in ready_bodies(cluster)]
        return all(c.get("prefill") == expected["prefill"] and c.get("decode") == expected["decode"] for c in counts)

    # The first process of each role, then the rest.
    for stage in (range(1), range(1, args.processes_per_role)):
        for role in ("prefill", "decode"):
            for index in stage:
                start_instances(cluster, args, env, log, role, index, counts[index])
                expected[role] += counts[index]
        wait_until(cluster, all_routed, f"every gateway routes to {expected}")
        if stage.start == 0:
            num_first = expected["prefill"] + expected["decode"]
            rss_first = rss_by_gateway(cluster)
    rss_all = rss_by_gateway(cluster)
    model = get_json(f"{cluster.gateway_urls[0]}/v1/models")["data"][0]["id"]
    # A stream per gateway first, so that the idle memory includes what a gateway allocates once
    # for its first requests, and the loaded window's growth is the streams' alone.
    warmup = LoadLoop(cluster.gateway_urls, model, args.num_gateways, args.max_tokens, args.prompt_words)
    warmup.requests_per_stream = 2
    asyncio.run(warmup.run())
    if warmup.num_failed:
        raise RuntimeError(f"{warmup.num_failed} warm-up requests failed: see {cluster.log_path}")
    # Let every gateway read each instance's KV-event snapshot and settle its polls before measuring.
    time.sleep(args.settle)
    before = snapshot(cluster, client)
    time.sleep(args.duration)
    idle = window_figures(cluster, before, snapshot(cluster, client))
    idle_rss = rss_by_gateway(cluster)
    loaded = asyncio.run(loaded_window(cluster, client, args, model))
    # Since start: the subscriptions (and first-contact resyncs) happen before the windows.
    calls_since_start = calls_by_method(cluster)
    kv_events_since_start = kv_event_counts(cluster)
    # The slope from the first stage's instances, or from none when there is one process a role.
    baseline, num_added = (
        (rss_first, args.num_instances - num_first)
        if num_first < args.num_instances
        else (rss_none, args.num_instances)
    )
    memory = {
        "gateway_rss_bytes_no_instances": rss_none,
        f"gateway_rss_bytes_{num_first}_instances": rss_first,
        f"gateway_rss_bytes_{args.num_instances}_instances": rss_all,
        "gateway_rss_bytes_idle": idle_rss,
        "gateway_rss_bytes_per_instance": [(all_ - first) / num_added for first, all_ in zip(baseline, rss_all)],
        "gateway_rss_bytes_per_inflight_request": [
            (busy - quiet) / open_ if open_ else 0.0
            for busy, quiet, open_ in zip(
                loaded["gateway_rss_bytes_median"], idle_rss, loaded["gateway_open_streams_median"]
            )
        ],
    }
    # What the settings imply, beside what was counted: a heartbeat every --heartbeat-seconds (plus
    # the SET's own time) per instance; a KV-event subscription per gateway and instance at least;
    # and, to read the KV-event calls against, what polling every instance every --poll-interval
    # costs (the gateways before events were pushed, or one whose instances refuse subscriptions);
    # and a KV-event heartbeat per subscription every --kv-event-heartbeat at most (the gateways'
    # default), while its instance's cache is quiet.
    expected = {
        "heartbeats_per_s_at_most": args.num_instances / args.heartbeat_seconds,
        "kv_event_heartbeats_per_s_at_most": args.num_gateways * args.num_instances / DEFAULT_HEARTBEAT_S,
        "kv_event_subscriptions_since_start_at_least": args.num_gateways * args.num_instances,
        "kv_event_polls_per_s_if_polled": args.num_gateways * args.num_instances / args.poll_interval,
    }
    return {
        "idle": idle,
        "loaded": loaded,
        "memory": memory,
        "grpc_calls_since_start_by_method": {
            method: calls_since_start.get(method, 0.0)
            for method in sorted(set(calls_since_start) | set(CLUSTER_METHODS))
        },
        "kv_events_since_start": kv_event_totals(kv_events_since_start),
        "expected": expected,
        "num_instances_first_stage": num_first,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--num-instances", type=int, default=64, help="simulated instances, half prefill, half decode")
    parser.add_argument("--processes-per-role", type=int, default=4, help="simulate processes of each role")
    parser.add_argument("--num-gateways", type=int, default=4, help="gateway processes, each on its own port")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of each window, idle and loaded")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds after every gateway routes to all")
    parser.add_argument("--streams", type=int, default=128, help="concurrent streams of the loaded window")
    parser.add_argument("--max-tokens", type=int, default=256, help="completion tokens of each request")
    parser.add_argument("--prompt-words", type=int, default=64)
    parser.add_argument("--profile", default="llama-3.1-8b-h100", help="the instances' timing profile")
    parser.add_argument("--heartbeat-seconds", type=float, default=1.0, help="the instances' registry heartbeat")
    parser.add_argument("--poll-interval", type=float, default=0.5, help="the gateways' scans, resubscriptions, polls")
    args = parser.parse_args(argv)
    if args.num_instances < 2 or args.num_instances % 2:
        raise ValueError(
            f"--num-instances must be even and at least 2 (half prefill, half decode), got {args.num_instances}"
        )
    if not 1 <= args.processes_per_role <= args.num_instances // 2:
        raise ValueError(f"--processes-per-role must be 1 to {args.num_instances // 2}, got {args.processes_per_role}")
    if args.num_gateways < 1 or args.streams < args.num_gateways:
        raise ValueError("--num-gateways must be at least 1 and --streams at least --num-gateways")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    log_path = args.output_dir / "cluster.log"
    env = {**os.environ, "SPLITSERVE_CLUSTER_SECRET": "bench-cluster-scale-" + os.urandom(8).hex()}
    redis_port = free_port()
    cluster = Cluster(redis_port=redis_port, log_path=log_path)
    with log_path.open("w") as log:
        try:
            start_redis(cluster, log)
            result = measure(args, cluster, env, log)
        finally:
            cluster.stop()
    result["args"] = vars(args) | {"output_dir": str(args.output_dir)}
    (args.output_dir / "cluster_scale.json").write_text(json.dumps(result, indent=2))
    print(summary(result))
    return 0


if __name__ == "__main__":
    # A SIGTERM unwinds through main's finally, so that every process it started is stopped.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    raise SystemExit(main())
