"""``splitserve drain``: a pod's preStop hook, so that Kubernetes removing an instance (KEDA or
an HPA scaling a Deployment down at the planner's word) cuts no stream.

In call order: SIGUSR1 to the instance's process (``--pid``, 1 in a container whose entrypoint
is ``splitserve``): it turns NOT_SERVING in its health and its registry record, so gateways send
it nothing new, and it keeps serving what it holds (``serving/instance.py``); with
``--hand-over``, SIGUSR2: a decode instance then also hands each stream it may back to its
gateway, which resumes it on another decode instance, so it is idle within a step or two
instead of at the end of its longest stream; then read its own
metrics endpoint (``--metrics-port``, ``serving/metrics.py``) until it shows nothing held (no
request waiting or running, no KV pull in flight, every KV block free: none pinned for a pull)
``--idle-checks`` times in a row, a poll apart, since a gateway may still send what it routed
before it learnt; then return. Kubernetes sends SIGTERM only after the hook returns, and the
instance, holding nothing, stops at once. The pod's ``terminationGracePeriodSeconds`` bounds
hook and stop together: it must outlast the longest stream (deploy/kubernetes-autoscaling/).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

# The instance's series whose sum over its samples must be 0 for it to hold nothing
# (cluster/instance_counters.py names them).
HELD = ("splitserve_engine_num_waiting", "splitserve_engine_num_running", "splitserve_engine_kv_transfers_in_flight")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pid", type=int, default=1, help="the instance's process (1: the container's entrypoint)")
    parser.add_argument(
        "--metrics-url", required=True, help="the instance's own metrics, http://127.0.0.1:PORT/metrics"
    )
    parser.add_argument(
        "--hand-over",
        action="store_true",
        help="a decode instance hands its streams back to their gateways, to resume on another decode instance, "
        "instead of finishing them itself (SIGUSR2 rather than SIGUSR1)",
    )
    parser.add_argument("--poll-seconds", type=float, default=1.0, help="between two reads of its metrics")
    parser.add_argument("--idle-checks", type=int, default=3, help="reads in a row that must show nothing held")
    parser.add_argument(
        "--timeout", type=float, default=None, help="give up after this many seconds (default: the pod's grace)"
    )


def held(metrics_text: str) -> int:
    """Requests, pulls and KV blocks in use the instance's metrics show (0: idle)."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    missing = [name for name in (*HELD, "splitserve_engine_free_kv_blocks") if name not in totals]
    if missing:
        raise ValueError(f"the metrics read have no {', '.join(missing)}: is --metrics-url an instance's own?")
    blocks_in_use = totals.get("splitserve_engine_total_kv_blocks", 0.0) - totals["splitserve_engine_free_kv_blocks"]
    return int(sum(totals[name] for name in HELD) + blocks_in_use)


def run(args: argparse.Namespace) -> int:
    os.kill(args.pid, signal.SIGUSR2 if args.hand_over else signal.SIGUSR1)
    logger.info(
        "drain: told process %d to stop taking requests%s; waiting until it holds nothing",
        args.pid,
        " and hand its streams over" if args.hand_over else "",
    )
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    idle_in_a_row = 0
    while idle_in_a_row < args.idle_checks:
        if deadline is not None and time.monotonic() > deadline:
            logger.error("drain: still holding work after %.0f s; returning (the pod stops anyway)", args.timeout)
            return 1
        try:
            with urllib.request.urlopen(args.metrics_url, timeout=5) as response:
                in_use = held(response.read().decode())
        except OSError as error:  # an instance that stopped answering holds nothing we can wait for
            logger.warning("drain: %s did not answer (%s)", args.metrics_url, error)
            return 1
        idle_in_a_row = idle_in_a_row + 1 if in_use == 0 else 0
        if idle_in_a_row < args.idle_checks:
            time.sleep(args.poll_seconds)
    logger.info("drain: process %d holds nothing; it may stop", args.pid)
    return 0
