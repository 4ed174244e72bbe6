"""``splitserve planner``: size the prefill and decode pools behind running gateways to the
TTFT and ITL SLOs, starting and stopping simulated instances on this host (one process each,
``planner/actuator.py``), which register in the gateways' Redis registry; or, with
``--actuator metrics``, only publishing the counts it wants for KEDA or an HPA to act on.

In call order: parse; start the initial instances; every ``--plan-interval`` run one tick of
``planner/loop.py``; on SIGTERM or SIGINT stop every instance it started (each drains as on any
SIGTERM) and exit. ``--metrics-port`` serves the planner's series (``planner/metrics.py``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from prometheus_client import start_http_server

from launcher.processes import splitserve_command
from planner.actuator import LocalActuator
from planner.capacity import scaled_profile
from planner.capacity_profile import check_slo, load_capacity_profile
from planner.decision import Role
from planner.flags import add_planner_arguments, bounds_of, slo_of
from planner.kubernetes_scaler import KubernetesScaler
from planner.loop import Planner, PlannerConfig
from planner.metrics import PlannerMetrics
from planner.observations import GatewayScraper
from simulator.timing_model import DEFAULT_PROFILE, load_profile

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gateway-url",
        action="append",
        required=True,
        help="a gateway whose /metrics the planner reads (repeat for several gateways)",
    )
    parser.add_argument(
        "--gateway-every-address",
        action="store_true",
        help="each --gateway-url's host resolves to every gateway (a headless Service): read each address, "
        "resolved again every interval",
    )
    parser.add_argument(
        "--actuator",
        choices=["local", "metrics", "kubernetes"],
        default="local",
        help="local: start and stop simulated instances here, one process each; metrics: only publish the desired "
        "counts (splitserve_planner_desired_instances) for KEDA or an HPA to scale Deployments by "
        "(deploy/kubernetes-autoscaling/), with --metrics-port; kubernetes: set the Deployments' replicas through "
        "the API's scale subresource (docs/planner.md)",
    )
    parser.add_argument("--kubernetes-api-url", help="--actuator kubernetes: the API server (default: in-cluster)")
    parser.add_argument(
        "--kubernetes-namespace", help="--actuator kubernetes: the Deployments' namespace (default: the pod's)"
    )
    parser.add_argument(
        "--kubernetes-token-file", help="--actuator kubernetes: a bearer token's file (default: the pod's)"
    )
    parser.add_argument("--prefill-deployment", default="prefill", help="--actuator kubernetes: P's Deployment")
    parser.add_argument("--decode-deployment", default="decode", help="--actuator kubernetes: D's Deployment")
    parser.add_argument("--registry-url", help="--actuator local: redis://HOST:PORT the instances register in")
    parser.add_argument(
        "--simulate-profile",
        default=DEFAULT_PROFILE,
        metavar="NAME|FILE",
        help="the simulated instances' timing profile, which also prices their capacity (docs/simulator.md)",
    )
    parser.add_argument("--time-scale", type=float, default=1.0, help="the simulated instances' --time-scale")
    parser.add_argument(
        "--capacity-profile",
        default=None,
        metavar="FILE",
        help="what `splitserve profile` measured one instance of each role to sustain at these SLOs: it corrects "
        "the timing profile's capacity (docs/planner.md)",
    )
    parser.add_argument("--model", default=None, help="the model folder the instances read config and tokenizer from")
    parser.add_argument("--heartbeat-seconds", type=float, default=1.0, help="the instances' registry heartbeat")
    parser.add_argument("--initial-prefill", type=int, default=1, help="prefill instances to start with")
    parser.add_argument("--initial-decode", type=int, default=1, help="decode instances to start with")
    parser.add_argument("--metrics-port", type=int, default=None, help="serve the planner's metrics on this port")
    parser.add_argument("--metrics-host", default="127.0.0.1")
    parser.add_argument("--instance-log-dir", default=None, help="where each instance's log goes (default: a temp dir)")
    add_planner_arguments(parser)


def simulated_instance_command(args: argparse.Namespace) -> Callable[[Role, str], list[str]]:
    """The command line of one simulated instance of a role, as the actuator starts it."""

    def command(role: Role, instance_id: str) -> list[str]:
        model = ["--model", args.model] if args.model else []
        return splitserve_command(
            "--log-level",
            args.log_level,
            "simulate",
            role,
            *model,
            "--profile",
            args.simulate_profile,
            "--time-scale",
            str(args.time_scale),
            "--num-instances",
            "1",
            "--instance-id",
            instance_id,
            "--port",
            "0",
            "--registry-url",
            args.registry_url,
            "--heartbeat-seconds",
            str(args.heartbeat_seconds),
        )

    return command


def run(args: argparse.Namespace) -> int:
    if args.actuator == "local" and not args.registry_url:
        raise ValueError("--actuator local starts instances that register in a registry: pass --registry-url")
    if args.actuator == "metrics" and args.metrics_port is None:
        raise ValueError("--actuator metrics publishes the desired counts on its metrics port: pass --metrics-port")
    measured = None
    if args.capacity_profile is not None:
        measured = load_capacity_profile(args.capacity_profile)
        check_slo(measured, slo_of(args))
    config = PlannerConfig(
        profile=scaled_profile(load_profile(args.simulate_profile), args.time_scale),
        slo=slo_of(args),
        bounds=bounds_of(args),
        interval_s=args.plan_interval,
        predictor=args.predictor,
        initial_instances={"prefill": args.initial_prefill, "decode": args.initial_decode},
        prompt_tokens=args.plan_prompt_tokens,
        output_tokens=args.plan_output_tokens,
        measured=measured,
    )
    metrics = PlannerMetrics()
    if args.metrics_port is not None:
        start_http_server(args.metrics_port, args.metrics_host, registry=metrics.registry)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    scraper = GatewayScraper(args.gateway_url, every_address=args.gateway_every_address)
    actuator = None
    if args.actuator == "local":
        log_dir = Path(args.instance_log_dir or tempfile.mkdtemp(prefix="splitserve-planner-"))
        actuator = LocalActuator(simulated_instance_command(args), log_dir)
        logger.info("planner: instances' logs in %s", log_dir)
    scaler = None
    if args.actuator == "kubernetes":
        scaler = KubernetesScaler.from_environment(
            {"prefill": args.prefill_deployment, "decode": args.decode_deployment},
            args.kubernetes_api_url,
            args.kubernetes_namespace,
            args.kubernetes_token_file,
        )
    planner = Planner(config, scraper, actuator, metrics, scaler)
    try:
        planner.start_initial()
        planner.run(stop)
    finally:
        scraper.close()
    return 0
